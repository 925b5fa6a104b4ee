"""Checkpoint manager: a full rank-0 file or per-rank shards; resume, reshard, consolidate.

Full:    fsdp_cpt{step}.pth, written by rank 0: plain tensors that model.GPT loads as they are.
Sharded: fsdp_sharded_cpt{step}_rank{r}.pth, one per rank: each parameter's and optimizer
         moment's dim-0 slice with its global shape and offset, so any world size and
         strategy can reassemble its own slices; fsdp_sharded_cpt{step}.complete marks the set
         complete once every rank has written.

Both carry `step`, `model_config`, `config` (resolved) and `train_state`. Data position and
dropout RNG are functions of (seed, step), so `step` restores both.
"""
import glob
import os
import re
import sys
import threading
import zlib

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map_only

from config import MODEL_SHAPE_KEYS, UserError, to_dict
from model import GPT, GPTConfig

FULL_RE = re.compile(r"fsdp_cpt(\d+)\.pth$")
SHARD_RE = re.compile(r"fsdp_sharded_cpt(\d+)_rank(\d+|\{rank\})\.pth$")
MARKER_RE = re.compile(r"fsdp_sharded_cpt(\d+)\.complete$")
FULL_OPTIONS = StateDictOptions(full_state_dict=True, cpu_offload=True)
LOAD_OPTIONS = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def full_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"fsdp_cpt{step}.pth")


def shard_path(directory: str, step: int, rank: int) -> str:
    return os.path.join(directory, f"fsdp_sharded_cpt{step}_rank{rank}.pth")


def marker_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"fsdp_sharded_cpt{step}.complete")


class CorruptCheckpoint(UserError):
    """A checkpoint that is damaged or incomplete (as opposed to one that doesn't fit)."""


def _crc32(obj) -> int:
    """Checksum of every tensor's bytes and every other value: torch.load notices a truncated
    file, but not flipped bytes inside tensor data."""
    crc = 0
    for leaf in tree_leaves(obj):
        if isinstance(leaf, torch.Tensor):
            data = leaf.detach().reshape(-1).contiguous().view(torch.uint8).numpy()
        else:
            data = repr(leaf).encode()
        crc = zlib.crc32(data, crc)
    return crc


def save_atomically(obj: dict, path: str) -> None:
    """Temp file, fsync, rename: the final name only ever holds a complete file."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(obj | {"crc32": _crc32(obj)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def read_verified(path: str, mmap: bool = False) -> dict:
    """torch.load(weights_only=True), then the checksum written with the file."""
    if not os.path.isfile(path):
        raise CorruptCheckpoint(f"checkpoint file not found: {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError... for damaged files
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt or truncated ({str(e).splitlines()[0][:120]}); "
                        f"resume from an earlier checkpoint")
    if not isinstance(obj, dict) or obj.pop("crc32", None) != _crc32(obj):
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: its checksum does not match its contents; "
                        f"resume from an earlier checkpoint")
    return obj


def load_file(path: str, mmap: bool = False) -> dict:
    obj = read_verified(path, mmap)
    if not {"model", "optimizer", "step", "model_config"} <= obj.keys():
        raise CorruptCheckpoint(f"{path} is not a checkpoint of this trainer (needs model, optimizer, step, model_config)")
    return obj


def check_model_shape(path: str, saved: dict, cfg) -> None:
    for key in MODEL_SHAPE_KEYS:
        if saved.get(key) != getattr(cfg, key):
            raise UserError(f"checkpoint {path} has {key}={saved.get(key)} but the config has {key}="
                            f"{getattr(cfg, key)}: set --{key}={saved.get(key)} to resume it")


def local_slice(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's dim-0 slice of a (possibly FSDP-sharded) tensor and its global offset.

    FSDP2 shards dim 0 like torch.chunk: rank i of n holds rows [i*c, min((i+1)*c, rows)),
    c = ceil(rows / n), possibly none.
    """
    if not isinstance(t, DTensor):
        return t, 0
    offset = 0
    for mesh_dim, placement in enumerate(t.placements):
        if placement.is_shard(0):
            n, i = t.device_mesh.size(mesh_dim), t.device_mesh.get_local_rank(mesh_dim)
            offset += min(i * -(-t.shape[0] // n), t.shape[0])
    return t.to_local(), offset


def _pieces(t: torch.Tensor) -> dict:
    local, offset = local_slice(t)
    return {"shape": list(t.shape), "offset": offset, "data": local.detach().to("cpu", copy=True)}


def _slices(pieces: list[dict], offset: int, rows: int) -> list[torch.Tensor]:
    """Views of the saved slices that make up rows [offset, offset + rows) of a tensor."""
    parts, cursor = [], offset
    for piece in sorted(pieces, key=lambda p: p["offset"]):
        start, data = piece["offset"], piece["data"]
        end = start + data.shape[0]
        if start <= cursor < end and cursor < offset + rows:
            take = min(end, offset + rows) - cursor
            parts.append(data[cursor - start:cursor - start + take])
            cursor += take
    if cursor != offset + rows:
        raise CorruptCheckpoint(f"sharded checkpoint is missing rows {cursor}..{offset + rows} of a tensor")
    return parts


def _assemble(pieces: list[dict], offset: int, rows: int) -> torch.Tensor:
    parts = _slices(pieces, offset, rows)
    return torch.cat(parts) if parts else pieces[0]["data"][:0]


def _fill(target: torch.Tensor, pieces: list[dict]) -> None:
    local, offset = local_slice(target)
    with torch.no_grad():
        local.copy_(_assemble(pieces, offset, local.shape[0]))


def _parameter_names(model) -> dict:
    """{parameter: name}, the same names under FSDP and DDP (whose wrapper adds 'module.')."""
    return {p: name for name, p in getattr(model, "module", model).named_parameters()}


def _aliases(model) -> dict:
    """{second name: first name} for parameters registered twice (the tied LM head)."""
    module = getattr(model, "module", model)
    first = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        first.setdefault(p, name)
    return {name: first[p] for name, p in module.named_parameters(remove_duplicate=False) if first[p] != name}


def _write(writes: list, pending: dict) -> None:
    try:
        for obj, path in writes:
            save_atomically(obj, path)
    except Exception as e:  # any failure, reported on the training thread by CheckpointManager.wait()
        pending["error"] = e


def _agree(fn):
    """Run fn on this rank; if any rank raised UserError, every rank raises the first one.

    Ranks that read files alone must not leave the others waiting in a collective.
    """
    try:
        result, error = fn(), None
    except UserError as e:
        result, error = None, e
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise first
    return result


def complete_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, "full" | "sharded") of every checkpoint visible under its final name."""
    found = []
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if m := FULL_RE.fullmatch(name):
            found.append((int(m.group(1)), "full"))
        elif m := MARKER_RE.fullmatch(name):
            found.append((int(m.group(1)), "sharded"))
    return found


def read_sharded(directory: str, step: int) -> list[dict]:
    """Every rank file of a complete sharded checkpoint, memory-mapped and verified."""
    marker = marker_path(directory, step)
    if not os.path.isfile(marker):
        raise CorruptCheckpoint(f"sharded checkpoint of step {step} in {directory}/ is incomplete "
                                f"(no {os.path.basename(marker)}): some rank never finished writing it")
    saved_world = read_verified(marker)["world_size"]
    files = [load_file(shard_path(directory, step, r), mmap=True) for r in range(saved_world)]
    for r, f in enumerate(files):
        if (f["step"], f["rank"]) != (step, r):
            raise CorruptCheckpoint(f"rank file {shard_path(directory, step, r)} holds step {f['step']} of rank "
                                    f"{f['rank']}: the set mixes files of different checkpoints")
    # every tensor whole across the files (views only): later reads can't fail on one rank alone
    for name, piece in files[0]["model"].items():
        _slices([f["model"][name] for f in files], 0, piece["shape"][0])
    for name, saved in files[0]["optimizer"].items():
        for key, piece in saved.items():
            if isinstance(piece, dict):
                _slices([f["optimizer"][name][key] for f in files], 0, piece["shape"][0])
    return files


def _whole_model(files: list[dict]) -> dict:
    """The full model state dict from a sharded set's rank files, tied names included."""
    model = {name: _whole([f["model"][name] for f in files]) for name in files[0]["model"]}
    return model | {alias: model[name] for alias, name in files[0]["aliases"].items()}


def _whole(pieces: list[dict]) -> torch.Tensor:
    return _assemble(pieces, 0, pieces[0]["shape"][0]).clone()  # clone: off the memory maps


def consolidate(shard_file: str, out_path: str) -> None:
    """Sharded checkpoint -> one full file, offline: as fsdp_cpt{step}.pth of the same step."""
    match = SHARD_RE.search(os.path.basename(shard_file))
    if not match:
        raise UserError(f"{shard_file} is not named fsdp_sharded_cpt{{step}}_rank{{rank}}.pth")
    files = read_sharded(os.path.dirname(shard_file), int(match.group(1)))
    first = files[0]
    state = {name: {key: _whole([f["optimizer"][name][key] for f in files]) if isinstance(value, dict) else value
                    for key, value in saved.items()} for name, saved in first["optimizer"].items()}
    header = {k: first[k] for k in ("step", "model_config", "config", "train_state")}
    save_atomically(header | {"model": _whole_model(files),
                              "optimizer": {"state": state, "param_groups": first["param_groups"]}}, out_path)


def read_model(path: str) -> tuple[dict, dict]:
    """(checkpoint, full model state dict) in one process, no process group: from a full file,
    any rank's file of a sharded set, or a folder (its newest complete checkpoint)."""
    if os.path.isdir(path):
        found = sorted(complete_checkpoints(path), reverse=True)
        if not found:
            raise UserError(f"no complete checkpoint in {path}/")
        step, kind = found[0]
        path = full_path(path, step) if kind == "full" else shard_path(path, step, 0)
    if match := SHARD_RE.search(os.path.basename(path)):
        files = read_sharded(os.path.dirname(path), int(match.group(1)))
        return files[0], _whole_model(files)
    ckpt = load_file(path)
    return ckpt, ckpt["model"]


def load_gpt(path: str, device: torch.device) -> tuple[GPT, dict]:
    """A plain model.GPT in eval mode with a checkpoint's weights, and the checkpoint."""
    ckpt, state = read_model(path)
    with torch.device("meta"):
        model = GPT(GPTConfig(**ckpt["model_config"]))
    model.load_state_dict(state, assign=True)
    model.tie_weights()
    return model.to(device).eval(), ckpt


class CheckpointManager:
    def __init__(self, cfg, topo):
        self.cfg, self.topo, self.dir = cfg, topo, cfg.checkpoint_dir
        self._pending = None  # the save being written: step, paths, thread, error
        self.last_saved = None  # this rank's file of the newest finished save
        if topo.is_main:
            os.makedirs(self.dir, exist_ok=True)
        dist.barrier()

    # ---- saving ----
    def _header(self, step: int) -> dict:
        cfg = self.cfg
        return {"step": step, "model_config": cfg.model_shape | {"dropout": cfg.dropout},
                "config": to_dict(cfg), "train_state": {"next_step": step + 1, "seed": cfg.seed}}

    def save(self, step: int, model, optimizer) -> None:
        """Copy the state off the training tensors, then write it (in the background with async_save)."""
        self.wait()  # one save in flight at a time
        if self.cfg.checkpoint_type == "full":
            # collectives on every rank; rank 0 alone receives the full dicts (host copies) and writes
            state = {"model": get_model_state_dict(model, options=FULL_OPTIONS),
                     "optimizer": get_optimizer_state_dict(model, optimizer, options=FULL_OPTIONS)}
            path, marker = full_path(self.dir, step), None
            if self.cfg.async_save:  # a 1-rank gather may alias the live tensors: own the bytes
                state = tree_map_only(torch.Tensor, torch.clone, state)
            writes = [(self._header(step) | state, path)] if self.topo.is_main else []
        else:
            names = _parameter_names(model)
            state = {"model": {name: _pieces(p) for p, name in names.items()},
                     "optimizer": {names[p]: {k: _pieces(v) if v.dim() else v.clone() for k, v in s.items()}
                                   for p, s in optimizer.state.items()},
                     "rank": self.topo.rank, "world_size": self.topo.world_size,
                     # what consolidation needs to write the full format: tied names, hyperparameters
                     "aliases": _aliases(model),
                     "param_groups": [{k: v for k, v in g.items() if k != "params"} | {
                         "params": [names[p] for p in g["params"]]} for g in optimizer.param_groups]}
            path, marker = shard_path(self.dir, step, self.topo.rank), marker_path(self.dir, step)
            writes = [(self._header(step) | state, path)]
        self._pending = {"step": step, "path": path, "marker": marker, "error": None}
        if self.cfg.async_save:
            self._pending["thread"] = threading.Thread(target=_write, args=(writes, self._pending), daemon=True)
            self._pending["thread"].start()
        else:
            _write(writes, self._pending)
            self.wait()

    def wait(self) -> None:
        """Finish the save in flight: every rank calls this at the same point (it may hold a barrier)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if "thread" in pending:
            pending["thread"].join()
        def check():
            if pending["error"]:
                raise UserError(f"writing checkpoint {pending['path']} failed: {pending['error']}")
        _agree(check)  # a failed write on any rank stops every rank, none left in a barrier
        if pending["marker"]:
            dist.barrier()  # every rank's file is renamed into place before the marker says so
            if self.topo.is_main:
                save_atomically({"step": pending["step"], "world_size": self.topo.world_size}, pending["marker"])
        self.last_saved = pending["path"]
        if self.topo.is_main:
            print(f"saved checkpoint {pending['marker'] or pending['path']}", flush=True)
        self._prune()

    def _prune(self) -> None:
        if not self.cfg.keep_last or not self.topo.is_main:
            return
        for step, kind in sorted(complete_checkpoints(self.dir), reverse=True)[self.cfg.keep_last:]:
            if kind == "full":
                os.remove(full_path(self.dir, step))
            else:
                os.remove(marker_path(self.dir, step))  # first: the set stops being visible
                for path in glob.glob(os.path.join(self.dir, f"fsdp_sharded_cpt{step}_rank*.pth")):
                    os.remove(path)

    def close(self) -> None:
        self.wait()
        dist.barrier()

    # ---- resuming ----
    def resume(self, resume_from: str | None, model, optimizer) -> int:
        """Load model and optimizer state; return the step to continue after (0: fresh start)."""
        if resume_from is None:
            return 0
        if resume_from == "latest":
            return self._resume_latest(model, optimizer)
        step = self._load(resume_from, model, optimizer)
        if self.topo.is_main:
            print(f"resumed from {resume_from} at step {step}", flush=True)
        return step

    def _resume_latest(self, model, optimizer) -> int:
        # rank 0's listing decides, so every rank tries the same checkpoints in the same order
        found = [sorted(complete_checkpoints(self.dir), reverse=True) if self.topo.is_main else None]
        dist.broadcast_object_list(found, src=0)
        for step, kind in found[0]:
            path = full_path(self.dir, step) if kind == "full" else shard_path(self.dir, step, 0)
            try:  # loaders raise before touching the model, on every rank alike
                return self.resume(path, model, optimizer)
            except CorruptCheckpoint as e:
                if self.topo.is_main:
                    print(f"skipping a damaged checkpoint: {e}", flush=True)
        if self.topo.is_main:
            print(f"no usable checkpoint in {self.dir}/ yet: starting from scratch", flush=True)
        return 0

    def _load(self, path: str, model, optimizer) -> int:
        if match := SHARD_RE.search(os.path.basename(path)):
            return self._load_sharded(os.path.dirname(path), int(match.group(1)), model, optimizer)
        return self._load_full(path, model, optimizer)

    def _load_full(self, path: str, model, optimizer) -> int:
        def read():
            ckpt = load_file(path)
            check_model_shape(path, ckpt["model_config"], self.cfg)
            return ckpt
        ckpt = _agree(read if self.topo.is_main else dict)
        step = [ckpt.get("step")]
        dist.broadcast_object_list(step, src=0)
        set_model_state_dict(model, ckpt.get("model", {}), options=LOAD_OPTIONS)
        set_optimizer_state_dict(model, optimizer, ckpt.get("optimizer", {}), options=LOAD_OPTIONS)
        return step[0]

    def _load_sharded(self, directory: str, step: int, model, optimizer) -> int:
        def read():
            files = read_sharded(directory, step)
            check_model_shape(shard_path(directory, step, 0), files[0]["model_config"], self.cfg)
            return files
        files = _agree(read)
        names = _parameter_names(model)
        for p, name in names.items():
            _fill(p, [f["model"][name] for f in files])
        for p, name in names.items():
            saved = files[0]["optimizer"].get(name)
            if saved is None:
                continue
            state = {}
            for key, value in saved.items():
                if isinstance(value, dict):
                    state[key] = torch.zeros_like(p)
                    _fill(state[key], [f["optimizer"][name][key] for f in files])
                else:
                    state[key] = value.clone()
            optimizer.state[p] = state
        return step


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "consolidate":
        print("usage: python fsdp_ckpt.py consolidate fsdp_sharded_cpt{step}_rank0.pth OUT.pth", file=sys.stderr)
        return 2
    try:
        consolidate(argv[1], argv[2])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

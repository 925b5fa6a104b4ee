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
import threading

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from config import MODEL_SHAPE_KEYS, UserError, to_dict

FULL_RE = re.compile(r"fsdp_cpt(\d+)\.pth$")
SHARD_RE = re.compile(r"fsdp_sharded_cpt(\d+)_rank(\d+|\{rank\})\.pth$")
MARKER_RE = re.compile(r"fsdp_sharded_cpt(\d+)\.complete$")
FULL_OPTIONS = StateDictOptions(full_state_dict=True, cpu_offload=True)
LOAD_OPTIONS = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def shard_path(directory: str, step: int, rank: int) -> str:
    return os.path.join(directory, f"fsdp_sharded_cpt{step}_rank{rank}.pth")


def marker_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"fsdp_sharded_cpt{step}.complete")


def save_atomically(obj, path: str) -> None:
    """Temp file, fsync, rename: the final name only ever holds a complete file."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def load_file(path: str, mmap: bool = False) -> dict:
    if not os.path.isfile(path):
        raise UserError(f"checkpoint file not found: {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError... for damaged files
        raise UserError(f"checkpoint {path} is corrupt or truncated ({str(e).splitlines()[0][:120]}); "
                        f"resume from an earlier checkpoint")
    if not isinstance(obj, dict) or not {"model", "optimizer", "step", "model_config"} <= obj.keys():
        raise UserError(f"{path} is not a checkpoint of this trainer (needs model, optimizer, step, model_config)")
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


def _assemble(pieces: list[dict], offset: int, rows: int) -> torch.Tensor:
    """Rows [offset, offset + rows) of a tensor from the slices the saving ranks held."""
    parts, cursor = [], offset
    for piece in sorted(pieces, key=lambda p: p["offset"]):
        start, data = piece["offset"], piece["data"]
        end = start + data.shape[0]
        if start <= cursor < end and cursor < offset + rows:
            take = min(end, offset + rows) - cursor
            parts.append(data[cursor - start:cursor - start + take])
            cursor += take
    if cursor != offset + rows:
        raise UserError(f"sharded checkpoint is missing rows {cursor}..{offset + rows} of a tensor")
    return torch.cat(parts) if parts else pieces[0]["data"][:0]


def _fill(target: torch.Tensor, pieces: list[dict]) -> None:
    local, offset = local_slice(target)
    with torch.no_grad():
        local.copy_(_assemble(pieces, offset, local.shape[0]))


def _parameter_names(model) -> dict:
    """{parameter: name}, the same names under FSDP and DDP (whose wrapper adds 'module.')."""
    return {p: name for name, p in getattr(model, "module", model).named_parameters()}


def _write(writes: list, pending: dict) -> None:
    try:
        for obj, path in writes:
            save_atomically(obj, path)
    except OSError as e:  # reported on the training thread by CheckpointManager.wait()
        pending["error"] = e


def _agree(fn):
    """Run fn on this rank; if any rank raised UserError, every rank raises the first one.

    Ranks that read files alone must not leave the others waiting in a collective.
    """
    try:
        result, error = fn(), None
    except UserError as e:
        result, error = None, str(e)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise UserError(first)
    return result


class CheckpointManager:
    def __init__(self, cfg, topo):
        self.cfg, self.topo, self.dir = cfg, topo, cfg.checkpoint_dir
        self._pending = None  # the save being written: step, paths, thread, error
        if topo.is_main:
            os.makedirs(self.dir, exist_ok=True)
        dist.barrier()

    # ---- saving ----
    def _header(self, step: int) -> dict:
        cfg = self.cfg
        return {"step": step, "model_config": {k: getattr(cfg, k) for k in MODEL_SHAPE_KEYS} | {"dropout": cfg.dropout},
                "config": to_dict(cfg), "train_state": {"next_step": step + 1, "seed": cfg.seed}}

    def save(self, step: int, model, optimizer) -> None:
        """Copy the state off the training tensors, then write it (in the background with async_save)."""
        self.wait()  # one save in flight at a time
        if self.cfg.checkpoint_type == "full":
            # collectives on every rank; rank 0 alone receives the full dicts (host copies) and writes
            state = {"model": get_model_state_dict(model, options=FULL_OPTIONS),
                     "optimizer": get_optimizer_state_dict(model, optimizer, options=FULL_OPTIONS)}
            path, marker = os.path.join(self.dir, f"fsdp_cpt{step}.pth"), None
            if self.cfg.async_save:  # a 1-rank gather may alias the live tensors: own the bytes
                state = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, state)
            writes = [(self._header(step) | state, path)] if self.topo.is_main else []
        else:
            names = _parameter_names(model)
            state = {"model": {name: _pieces(p) for p, name in names.items()},
                     "optimizer": {names[p]: {k: _pieces(v) if v.dim() else v.clone() for k, v in s.items()}
                                   for p, s in optimizer.state.items()},
                     "rank": self.topo.rank, "world_size": self.topo.world_size}
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
        if self.topo.is_main:
            print(f"saved checkpoint {pending['marker'] or pending['path']}", flush=True)
        self._prune()

    def _prune(self) -> None:
        if not self.cfg.keep_last or not self.topo.is_main:
            return
        for step, kind in sorted(self.complete_checkpoints(), reverse=True)[self.cfg.keep_last:]:
            if kind == "full":
                os.remove(os.path.join(self.dir, f"fsdp_cpt{step}.pth"))
            else:
                os.remove(marker_path(self.dir, step))  # first: the set stops being visible
                for path in glob.glob(os.path.join(self.dir, f"fsdp_sharded_cpt{step}_rank*.pth")):
                    os.remove(path)

    def close(self) -> None:
        self.wait()
        dist.barrier()

    # ---- resuming ----
    def complete_checkpoints(self) -> list[tuple[int, str]]:
        found = []
        for name in os.listdir(self.dir) if os.path.isdir(self.dir) else []:
            if m := FULL_RE.fullmatch(name):
                found.append((int(m.group(1)), "full"))
            elif m := MARKER_RE.fullmatch(name):
                found.append((int(m.group(1)), "sharded"))
        return found

    def resume(self, resume_from: str | None, model, optimizer) -> int:
        """Load model and optimizer state; return the step to continue after (0: fresh start)."""
        if resume_from is None:
            return 0
        if resume_from == "latest":
            # rank 0's view decides, so every rank loads the same checkpoint
            found = [max(self.complete_checkpoints(), default=None) if self.topo.is_main else None]
            dist.broadcast_object_list(found, src=0)
            if found[0] is None:
                if self.topo.is_main:
                    print(f"no checkpoint in {self.dir}/ yet: starting from scratch", flush=True)
                return 0
            step, kind = found[0]
            resume_from = os.path.join(self.dir, f"fsdp_cpt{step}.pth" if kind == "full" else
                                       f"fsdp_sharded_cpt{step}_rank0.pth")
        match = SHARD_RE.search(os.path.basename(resume_from))
        if match:
            step = self._load_sharded(os.path.dirname(resume_from), int(match.group(1)), model, optimizer)
        else:
            step = self._load_full(resume_from, model, optimizer)
        if self.topo.is_main:
            print(f"resumed from {resume_from} at step {step}", flush=True)
        return step

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
            marker = marker_path(directory, step)
            if not os.path.isfile(marker):
                raise UserError(f"sharded checkpoint of step {step} in {directory}/ is incomplete "
                                f"(no {os.path.basename(marker)}): some rank never finished writing it")
            saved_world = torch.load(marker, weights_only=True)["world_size"]
            files = [load_file(shard_path(directory, step, r), mmap=True) for r in range(saved_world)]
            for f in files:
                if f["step"] != step:
                    raise UserError(f"rank file {shard_path(directory, step, f['rank'])} holds step {f['step']}, not {step}")
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

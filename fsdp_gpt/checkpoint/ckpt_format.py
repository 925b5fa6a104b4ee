"""Checkpoint files: names, atomic writes, checksums, sharded pieces, and offline readers.

Full:    fsdp_cpt{step}.pth, written by rank 0: plain tensors that model.GPT loads as they are.
Sharded: fsdp_sharded_cpt{step}_rank{r}.pth, one per rank: each parameter's and optimizer
         moment's dim-0 slice with its global shape and offset (a replicated slice written by
         one replica only), so any world size and strategy can reassemble its own slices;
         fsdp_sharded_cpt{step}.complete marks the set complete once every rank has written,
         and indexes which file holds which rows (ckpt_index.py).

Nothing here needs a process group: sample.py, export_hf.py and consolidation read sets offline.
"""
import errno
import glob
import os
import re
import shutil
import zlib

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from fsdp_gpt.config import UserError, in_one_line
from fsdp_gpt.distributed.float8 import plain
from fsdp_gpt.distributed.shards import local_slice
from fsdp_gpt.families import FAMILIES
from fsdp_gpt.model import GPT, GPTConfig
from fsdp_gpt.model_keys import DEFINING_KEYS

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


def sharded_step(path: str) -> int | None:
    """The step of the sharded set a path names (any rank's file, the {rank} pattern or the marker);
    None where it names no sharded set."""
    name = os.path.basename(path)
    match = SHARD_RE.search(name) or MARKER_RE.search(name)
    return int(match.group(1)) if match else None


def check_named_rank_file(path: str) -> None:
    """Any rank's file names its whole set, if it exists: one that doesn't beside the set's others (rank 5
    of a 2-rank set, a typo) is refused, naming the ranks whose files the folder holds ({rank} and the
    marker name the set; a set of which nothing is there is not found as a set is)."""
    named = SHARD_RE.search(os.path.basename(path))
    if named and named.group(2) != "{rank}" and not os.path.isfile(path):
        directory, step = os.path.dirname(path) or ".", int(named.group(1))
        ranks = sorted(int(m.group(2)) for name in (os.listdir(directory) if os.path.isdir(directory) else [])
                       if (m := SHARD_RE.fullmatch(name)) and int(m.group(1)) == step)
        if ranks:
            raise UserError(f"{path} not found: {directory}/ holds the files of ranks {', '.join(map(str, ranks))} of "
                            f"step {step}'s sharded set")


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


class WriteFailed(UserError):
    """A checkpoint file that could not be written (no space, quota, file too large, I/O error)."""


class _WriteThrough:
    """What torch.save writes into: every byte goes straight to the OS, and the OS's refusal is
    kept, since torch's zip writer reports it only as an "unexpected pos"."""

    def __init__(self, fd: int):
        self.fd, self.error = fd, None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as e:
            self.error = e
            raise
        return len(data)

    def flush(self) -> None:
        pass


def _megabytes(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _write_failure(path: str, error: BaseException, obj: dict) -> str:
    """One line: the file, the OS's reason, and for a full disk the bytes needed and free."""
    if isinstance(error, OSError) and error.errno:
        reason = f"{os.strerror(error.errno)} (errno {error.errno})"
        if error.errno == errno.ENOSPC:
            needed = sum(t.numel() * t.element_size() for t in tree_leaves(obj) if isinstance(t, torch.Tensor))
            reason += (f": it needs about {_megabytes(needed)}, "
                       f"{_megabytes(shutil.disk_usage(os.path.dirname(path) or '.').free)} free there")
    else:
        reason = in_one_line(error)
    return f"writing checkpoint {path} failed: {reason}"


def save_atomically(obj: dict, path: str) -> None:
    """Temp file, fsync, rename: the final name only ever holds a complete file. A failed write
    removes its temp file and raises WriteFailed naming the file and the OS's reason."""
    tmp = f"{path}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as e:  # no room even for the name, a quota on files, a read-only filesystem
        raise WriteFailed(_write_failure(path, e, obj)) from None
    out = _WriteThrough(fd)
    try:
        torch.save(obj | {"crc32": _crc32(obj)}, out)
        os.fsync(fd)
    except Exception as e:  # noqa: BLE001 - torch's writer or the OS: reported with the OS's reason
        os.close(fd)
        os.remove(tmp)
        raise WriteFailed(_write_failure(path, out.error or e, obj)) from None
    os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def read_verified(path: str, mmap: bool = False, checksum: bool = True) -> dict:
    """torch.load(weights_only=True), then (unless checksum is off: a look at the header, the tensors
    memory-mapped and unread) the checksum written with the file."""
    if os.path.isdir(path):
        raise UserError(f"{path} is a folder, not a checkpoint file: name a file in it, or set --checkpoint_dir={path} "
                        f"and --resume_from=latest for its newest complete checkpoint")
    if not os.path.isfile(path):
        raise CorruptCheckpoint(f"checkpoint file not found: {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError... for damaged files
        # and EINVAL for one cut short to a few KB (its zip reader seeks before the file's start); any
        # other OSError is the filesystem failing, not the file: an error, never "damaged, skip it"
        if isinstance(e, OSError) and e.errno != errno.EINVAL:
            raise UserError(f"could not read checkpoint {path}: {e}; check the filesystem and run again")
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt or truncated ({in_one_line(e)}); "
                                f"resume from an earlier checkpoint")
    written = obj.pop("crc32", None) if isinstance(obj, dict) else None
    if written is None:  # every file this trainer writes carries one (save_atomically)
        raise CorruptCheckpoint(f"{path} is not a checkpoint of this trainer: no checksum was written with it")
    if checksum and written != _crc32(obj):
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: its checksum does not match its contents; "
                        f"resume from an earlier checkpoint")
    return obj


def load_file(path: str, mmap: bool = False, checksum: bool = True) -> dict:
    obj = read_verified(path, mmap, checksum)
    if not {"model", "optimizer", "step", "model_config"} <= obj.keys():
        raise CorruptCheckpoint(f"{path} is not a checkpoint of this trainer (needs model, optimizer, step, model_config)")
    return obj


def load_full(path: str, mmap: bool = False, checksum: bool = True) -> dict:
    """A full checkpoint file, under whatever name: a rank's file of a sharded set, renamed, is not one."""
    obj = load_file(path, mmap, checksum)
    if "rank" in obj:
        raise CorruptCheckpoint(
            f"{path} is rank {obj['rank']}'s file of a sharded checkpoint of {obj['world_size']} ranks, not a full "
            f"one: give it as fsdp_sharded_cpt{obj['step']}_rank{obj['rank']}.pth beside the set's other files")
    return obj


def check_model_shape(source: str, saved: dict, cfg) -> dict[str, tuple]:
    """The model the config builds must be the one `source` holds, every key that defines the model
    (model_keys.DEFINING_KEYS) alike (keys a checkpoint lacks, written before they existed, take their
    defaults: the GPT-2 layout), but for the keys its family lets a resume change (Family.resumable:
    RoPE holds no weights per position, so the same weights run at any block_size, with another base
    or scaling): their changes are returned, {key: (saved, configured)}."""
    theirs, ours = GPTConfig(**saved), GPTConfig.of(cfg)
    changes = {}
    for key in DEFINING_KEYS:  # arch first: a change of layout is refused as that
        was, now = getattr(theirs, key), getattr(ours, key)
        if was == now:
            continue
        if key in theirs.family.resumable and key in ours.family.resumable:
            changes[key] = (was, now)
            continue
        if getattr(cfg, "init_from", None):  # the folder set the key: --key=was would contradict it
            raise UserError(f"{source} has {key}={was} but init_from {cfg.init_from} defines {key}={now}: give the "
                            f"init_from the checkpoint's run started from")
        resumable = [family.name for family in FAMILIES if key in family.resumable]
        why = f" (only {', '.join(resumable)} may change {key} on resume)" if resumable else ""
        raise UserError(f"{source} has {key}={was} but the config has {key}={now}: set --{key}={was} to "
                        f"resume it{why}")
    return changes


def rope_base_moves(saved: dict, cfg) -> list[str]:
    """The layers a resume moves from one RoPE base to the other (a window_pattern or sliding_window
    changed beside rope_local_theta, or rope_local_theta set or unset), one entry per kind of move:
    the window's change alone would not say that these layers' positions now rotate otherwise."""
    theirs, ours = GPTConfig(**saved), GPTConfig.of(cfg)
    moves = {}
    for layer in range(ours.n_layer):
        was, now = theirs.rope_base(layer), ours.rope_base(layer)
        if was and now and was[0] != now[0]:
            moves.setdefault((was, now), []).append(layer)
    return [f"layers {layers} from {was[0]} {was[1]:g} to {now[0]} {now[1]:g}" for (was, now), layers in moves.items()]


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy that owns its bytes: what is written never aliases a training tensor, and
    device tensors (a fused optimizer's `step` lives on the GPU) leave the device first; a weight
    FSDP2 all-gathers in FP8 is written as the plain tensor under torchao's wrapper."""
    return plain(t).detach().to("cpu", copy=True)


def is_first_replica(t: torch.Tensor, rank: int) -> bool:
    """Replicas (HYBRID_SHARD's replica groups, NO_SHARD, DDP) hold the same slice: the one at
    coordinate 0 of every replicated mesh dim (for a plain tensor, rank 0) writes its rows, and
    on resume reads them for the others."""
    if not isinstance(t, DTensor):
        return rank == 0
    return all(t.device_mesh.get_local_rank(d) == 0 for d, p in enumerate(t.placements) if p.is_replicate())


def piece_of(t: torch.Tensor, rank: int) -> dict:
    local, offset = local_slice(t)
    return {"shape": list(t.shape), "offset": offset, "data": host_copy(local if is_first_replica(t, rank) else local[:0])}


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


def fill_local(target: torch.Tensor, pieces: list[dict]) -> None:
    local, offset = local_slice(target)
    with torch.no_grad():
        local.copy_(_assemble(pieces, offset, local.shape[0]))


def complete_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, "full" | "sharded") of every checkpoint visible under its final name."""
    found = []
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if m := FULL_RE.fullmatch(name):
            found.append((int(m.group(1)), "full"))
        elif m := MARKER_RE.fullmatch(name):
            found.append((int(m.group(1)), "sharded"))
    return found


def incomplete_sets(directory: str) -> list[int]:
    """The steps of sharded sets with rank files but no marker, newest first."""
    ranked = {int(m.group(1)) for name in (os.listdir(directory) if os.path.isdir(directory) else [])
              if (m := SHARD_RE.fullmatch(name))}
    return sorted((step for step in ranked if not os.path.isfile(marker_path(directory, step))), reverse=True)


def incomplete(directory: str, step: int) -> str:
    return (f"sharded checkpoint of step {step} in {directory}/ is incomplete (no "
            f"{os.path.basename(marker_path(directory, step))}): some rank never finished writing it")


def read_marker(directory: str, step: int) -> dict:
    """The .complete marker of a sharded set: step, world_size and (since the index) index."""
    marker = marker_path(directory, step)
    if not os.path.isfile(marker):
        if not glob.glob(os.path.join(glob.escape(directory), f"fsdp_sharded_cpt{step}_rank*.pth")):
            raise CorruptCheckpoint(f"sharded checkpoint of step {step} not found in {directory}/ (neither its marker "
                                    f"nor a rank's file)")
        raise CorruptCheckpoint(incomplete(directory, step))
    return read_verified(marker)


def open_rank_files(directory: str, step: int, ranks, checksum: bool = True) -> list[dict]:
    """The given ranks' files of a sharded set, memory-mapped and verified (checksum off: each whole,
    as torch.load reads a file's header and tensor records, and of this set; its bytes unread)."""
    files = [load_file(shard_path(directory, step, r), mmap=True, checksum=checksum) for r in ranks]
    for r, f in zip(ranks, files):
        if (f["step"], f["rank"]) != (step, r):
            raise CorruptCheckpoint(f"rank file {shard_path(directory, step, r)} holds step {f['step']} of rank "
                                    f"{f['rank']}: the set mixes files of different checkpoints")
    return files


def read_sharded(directory: str, step: int) -> list[dict]:
    """Every rank file of a complete sharded checkpoint, memory-mapped and verified (offline readers)."""
    files = open_rank_files(directory, step, range(read_marker(directory, step)["world_size"]))
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
    if (step := sharded_step(shard_file)) is None:
        raise UserError(f"{shard_file} is not named as a sharded checkpoint (fsdp_sharded_cpt{{step}}_rank{{rank}}.pth or "
                        f"its .complete marker)")
    check_named_rank_file(shard_file)
    files = read_sharded(os.path.dirname(shard_file), step)
    first = files[0]
    state = {name: {key: _whole([f["optimizer"][name][key] for f in files]) if isinstance(value, dict) else value
                    for key, value in saved.items()} for name, saved in first["optimizer"].items()}
    header = {k: first[k] for k in ("step", "world_size", "model_config", "config", "train_state")}
    save_atomically(header | {"model": _whole_model(files),
                              "optimizer": {"state": state, "param_groups": first["param_groups"]}}, out_path)


def read_model(path: str) -> tuple[dict, dict]:
    """(checkpoint, full model state dict) in one process, no process group: from a full file,
    any rank's file of a sharded set or its marker, or a folder (its newest complete checkpoint)."""
    if os.path.isdir(path):
        found = sorted(complete_checkpoints(path), reverse=True)
        if not found:
            raise UserError(f"no complete checkpoint in {path}/")
        step, kind = found[0]
        path = full_path(path, step) if kind == "full" else shard_path(path, step, 0)
    if (step := sharded_step(path)) is not None:
        check_named_rank_file(path)
        files = read_sharded(os.path.dirname(path), step)
        return files[0], _whole_model(files)
    ckpt = load_full(path)
    return ckpt, ckpt["model"]


def load_gpt(path: str, device: torch.device) -> tuple[GPT, dict]:
    """A plain model.GPT in eval mode with a checkpoint's weights, and the checkpoint."""
    ckpt, state = read_model(path)
    with torch.device("meta"):
        model = GPT(GPTConfig(**ckpt["model_config"]))
    model.load_state_dict(state, assign=True)
    model.tie_weights()
    return model.to(device).eval(), ckpt



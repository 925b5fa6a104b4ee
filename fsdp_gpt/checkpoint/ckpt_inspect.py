"""What a checkpoint holds, in words: python fsdp_ckpt.py PATH [--verify]

PATH is a full file, any rank's file (or the .complete marker) of a sharded set, or a folder: then
every checkpoint in it, complete or not, and the newest complete one's details. For one checkpoint:
its step, the tokens seen, the world size and format it was written with, the model (family, shape,
parameters), the config keys that differ from the defaults, the data position, and whether it is
complete. One process, no process group: the files' headers are read and their tensors left unread
(memory-mapped), unless --verify reads every byte against the checksums written with them. Exit 0
when the checkpoint is complete (a folder: when it holds a complete one), 1 when it is not.
"""
import argparse
import glob
import os

import torch
import yaml

from fsdp_gpt.checkpoint.ckpt_format import (
    FULL_RE, MARKER_RE, SHARD_RE, CorruptCheckpoint, check_named_rank_file, full_path, load_file, load_full, marker_path,
    open_rank_files, read_marker, shard_path, sharded_step)
from fsdp_gpt.checkpoint.ckpt_index import check_file, check_whole
from fsdp_gpt.checkpoint.run_state import tokens_seen
from fsdp_gpt.config import FIELDS, UserError
from fsdp_gpt.model import GPT, GPTConfig


def _full(path: str, verify: bool) -> tuple[dict, str]:
    """(header, why it is complete) of a full file; CorruptCheckpoint where it is not."""
    ckpt = load_full(path, mmap=True, checksum=verify)
    return ckpt, "yes: one file under its final name" + (", its checksum matches" if verify else "")


def _sharded(directory: str, step: int, verify: bool) -> tuple[dict, str]:
    """(rank 0's header, why the set is complete) of a sharded set; CorruptCheckpoint where it is not."""
    marker = read_marker(directory, step)
    world, index = marker["world_size"], marker.get("index")
    missing = [r for r in range(world) if not os.path.isfile(shard_path(directory, step, r))]
    if missing:
        raise CorruptCheckpoint(f"the files of ranks {missing} of {world} are missing")
    if index is not None:
        check_whole(index, marker_path(directory, step))
    # every file whole, of this set, holding what the index lists: what a resume opens (--verify: every byte too)
    files = open_rank_files(directory, step, range(world), checksum=verify)
    for r, f in enumerate(files if index is not None else []):
        check_file(index, f, r, shard_path(directory, step, r))
    first = files[0]
    rows = f"its index holds every row of {len(index)} tensors" if index is not None else "a set older than the index"
    return first, f"yes: the marker and {world} of {world} rank files; {rows}" + (
        ", every checksum matches" if verify else "")


def _any_header(directory: str, step: int) -> dict | None:
    """The header of any readable rank file of an incomplete sharded set (None: none is)."""
    for path in sorted(glob.glob(os.path.join(directory, f"fsdp_sharded_cpt{step}_rank*.pth"))):
        try:
            return load_file(path, mmap=True, checksum=False)
        except CorruptCheckpoint:
            continue
    return None


def read_checkpoint(directory: str, step: int | None, kind: str, verify: bool,
                    path: str | None = None) -> tuple[dict | None, bool, str]:
    """(its header where one is readable, whether it is complete, why or why not); path: a full file
    under a name of its own (consolidate.py's output, a renamed copy)."""
    try:
        ckpt, why = (_full(path or full_path(directory, step), verify) if kind == "full"
                     else _sharded(directory, step, verify))
        return ckpt, True, why
    except CorruptCheckpoint as e:
        return (None if kind == "full" else _any_header(directory, step)), False, f"no: {e}"


def _value(value) -> str:
    """A config value as --key=value takes it (null, true, [a, b], {a: 1})."""
    return yaml.safe_dump(value, default_flow_style=True, width=10 ** 6).strip().removesuffix("...").strip()


def _model(model_config: dict) -> str:
    cfg = GPTConfig(**model_config)
    with torch.device("meta"):
        gpt = GPT(cfg)
    n_params, idle = gpt.num_params(), gpt.idle_expert_params()
    kv = cfg.n_kv_head or cfg.n_head
    return (f"{cfg.family.name}, {cfg.n_layer} layers x {cfg.n_embd} wide, {cfg.n_head} heads"
            f"{f' ({kv} key/value)' if kv != cfg.n_head else ''}"
            f"{f', {cfg.moe_experts} experts (top {cfg.moe_top_k})' if cfg.moe_experts else ''}, context "
            f"{cfg.block_size}, vocabulary {cfg.vocab_size}: {n_params:,} parameters"
            f"{f' ({n_params - idle:,} active a token)' if idle else ''}")


def _tokens(ckpt: dict) -> str:
    tokens, how = tokens_seen(ckpt)
    if tokens is None:
        return "unknown (the checkpoint predates its count)"
    return f"{tokens:,}" + (f" ({how}: the checkpoint predates its count)" if how else "")


def _writer(ckpt: dict, kind: str, config: dict) -> str:
    world = ckpt.get("world_size")
    ranks = f"{world} rank{'s' * (world != 1)}" if world else "ranks not recorded (the checkpoint predates it)"
    if world == 1 and not (config.get("force_fsdp") or config.get("cpu_offload")):  # launch.wrapping's rule
        layout = "not wrapped"  # one process trains the plain model
    else:
        layout = config.get("sharding_strategy", "?") if config.get("fsdp", True) else "DDP"
    layout += "".join(f", {key} {config[key]}" for key in ("cp_size", "ep_size") if config.get(key, 1) > 1)
    written = kind + (" (consolidated from the run's sharded set)" if kind == "full" and
                      config.get("checkpoint_type") == "sharded" else "")
    return f"{ranks}, {layout}; {written} format"


def _data(step: int, config: dict, train_state: dict) -> str:
    mix = config.get("data_mix")
    source = "mixture " + ", ".join(f"{name}: {path}" for name, path in mix.items()) if mix else config.get("data_path")
    words = f"{source}, seed {train_state.get('seed', config.get('seed'))}: step {step + 1}'s batch next"
    mixture = train_state.get("data", {}).get("mixture")
    if mixture:
        weights = ", ".join(f"{name} {w:g}" for name, w in mixture["segment"]["weights"].items())
        supplied = ", ".join(f"{name} {rows:,}" for name, rows in mixture["supplied"].items())
        segment = mixture["segment"]  # a checkpoint before segments kept their train_batch counts the run's rows
        since = f"step {segment['start_step'] + 1:,}" if "start_step" in segment else f"row {segment['start_row']:,}"
        words += f"; rows supplied: {supplied}; weights {weights} from {since}"
    return words


def _wrapped(label: str, items: list[str], width: int = 110) -> list[str]:
    """`label` and the items, as many to a line as fit (an item never split), under one another."""
    lines = [f"  {label:<13}"]
    for item in items:
        if len(lines[-1]) + len(item) > width and lines[-1].strip() != label:
            lines.append(" " * 15)
        lines[-1] += item if lines[-1].endswith(" ") else f" {item}"
    return lines


def describe(ckpt: dict, kind: str) -> list[str]:
    """A checkpoint's header in words, a line a field (the config's may wrap)."""
    step, config, train_state = ckpt["step"], ckpt.get("config", {}), ckpt.get("train_state", {})
    changed = [f"{key}={_value(value)}" + ("" if key in FIELDS else " (no longer a key)")
               for key, value in config.items() if key not in FIELDS or value != FIELDS[key].default]
    return [f"  step         {step}: the state after it; a resume continues with step {step + 1}",
            f"  tokens seen  {_tokens(ckpt)}",
            f"  written by   {_writer(ckpt, kind, config)}",
            f"  model        {_model(ckpt['model_config'])}",
            *_wrapped("config", (changed or ["none"]) + ["(the keys that differ from the defaults)"]),
            f"  data         {_data(step, config, train_state)}"]


def _report(read: tuple[dict | None, bool, str], kind: str) -> list[str]:
    """read_checkpoint's answer in words."""
    ckpt, _, why = read
    return (describe(ckpt, kind) if ckpt else []) + [f"  complete     {why}"]


def _in_folder(directory: str) -> list[tuple[int, str]]:
    """(step, kind) of every checkpoint in a folder, complete or not (a sharded set by any of its files)."""
    found = set()
    for name in os.listdir(directory):
        if m := FULL_RE.fullmatch(name):
            found.add((int(m.group(1)), "full"))
        elif m := SHARD_RE.fullmatch(name) or MARKER_RE.fullmatch(name):
            found.add((int(m.group(1)), "sharded"))
    return sorted(found)


def inspect(path: str, verify: bool = False) -> tuple[str, bool]:
    """(the report on a file, a sharded set or a folder, whether its checkpoint is complete)."""
    if os.path.isdir(path):
        found = _in_folder(path)
        if not found:
            raise UserError(f"no checkpoint in {path}/ (fsdp_cpt{{step}}.pth, fsdp_sharded_cpt{{step}}_rank{{r}}.pth)")
        lines, newest = [f"{path}/: {len(found)} checkpoint{'s' * (len(found) > 1)}"], None
        for step, kind in found:
            read = read_checkpoint(path, step, kind, verify)
            newest = (step, kind, read) if read[1] else newest
            lines.append(f"  step {step}, {kind}: {'complete' if read[1] else 'not complete: ' + read[2][4:]}")
        if newest is None:
            return "\n".join(lines + ["no complete checkpoint"]), False
        step, kind, read = newest
        name = full_path(path, step) if kind == "full" else shard_path(path, step, 0)
        # a resume reads every byte of the files it opens against their checksums, skipping a damaged set:
        # only a look at every byte names what it takes
        taken = ("what --resume_from=latest takes" if verify else
                 "unverified: --resume_from=latest takes it where its checksums match, --verify checks them")
        return "\n".join(lines + [f"the newest complete, {name} ({taken}):"] + _report(read, kind)), True
    step = sharded_step(path)
    if step is None and not path.endswith(".pth"):
        raise UserError(f"{path} is not named as a checkpoint (a .pth file, fsdp_sharded_cpt{{step}}_rank{{r}}.pth "
                        f"or its .complete marker), nor a folder")
    check_named_rank_file(path)
    if not os.path.exists(path) and "{rank}" not in path:
        raise UserError(f"{path} not found")
    kind = "full" if step is None else "sharded"  # a full file under any name: the one given, read as it is
    read = read_checkpoint(os.path.dirname(path) or ".", step, kind, verify, path=path if step is None else None)
    return "\n".join([f"{path}:"] + _report(read, kind)), read[1]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fsdp_ckpt.py", description=__doc__.splitlines()[0],
                                     epilog="exit 0: complete; 1: not complete (docs/checkpoints.md)")
    parser.add_argument("path", help="a full file, any rank's file of a sharded set, or a folder of checkpoints")
    parser.add_argument("--verify", action="store_true", help="read every byte against the files' checksums")
    args = parser.parse_args(argv)
    report, complete = inspect(args.path.rstrip("/") or "/", args.verify)
    print(report)
    return 0 if complete else 1

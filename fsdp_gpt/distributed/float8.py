"""FP8 matmuls (`fp8`) through torchao's float8 training, applied from outside as the other
parallelisms are (model.py knows nothing of it): which of the blocks' linears become torchao's
Float8Linear, FSDP2's float8 all-gather of their weights (tensorwise), the weights' scales computed
once after each optimizer step, and the plain tensors a checkpoint holds.

What converts: the nn.Linear layers inside the blocks (attention's and the MLP's, a mixture's shared
experts), by `fp8_layers`. What stays in high precision: the embeddings and the LM head (tied to the
embedding, and the chunked loss multiplies by its weight directly, never calling it), a mixture's
routers (their scores pick the experts) and its routed experts (stacked weights in grouped matmuls:
torchao's FP8 grouped matmul is a prototype that needs CUDA and Triton, untested here), a linear
layer's gates (HIGH_PRECISION).

torchao is imported only when `fp8` is set: a run, evaluate.py or sample.py without it never needs it.
"""
import collections
import contextlib
import dataclasses
import logging
import re
import sys

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_gpt.compat import float8_training
from fsdp_gpt.config import UserError
from fsdp_gpt.distributed.precision import Chip

EXTRA = "pip install -e \".[fp8]\" (torchao 0.18)"


class QuietImport(logging.Filter):
    """Drops two notes of importing torchao that ask nothing of a user: its CUDA extensions that did
    not load (MX formats and CUTLASS kernels; float8 training calls torch._scaled_mm, not them) and
    torch's deprecation of how torchao registers an enum with torch.compile."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Failed to load") and "torchao" in message) and \
            "is an Enum subclass and is now natively supported" not in message


@contextlib.contextmanager
def quiet_torchao():
    """Importing torchao, directly or through transformers (whose models import it where it is
    installed), without QuietImport's two notes."""
    quiet, loggers = QuietImport(), [logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


def torchao_float8():
    """torchao.float8, imported quietly (ImportError where torchao is not installed)."""
    with quiet_torchao():
        import torchao.float8
    return torchao.float8


def fp8_matmuls(chip: Chip) -> bool:
    """Whether the device multiplies FP8 matrices (torch._scaled_mm on tensor cores): CUDA from sm89
    (Ada: L4, L40S; Hopper: H100, H200; Blackwell)."""
    return chip.type == "cuda" and chip.capability >= (8, 9)


def check_fp8(cfg, chip: Chip) -> None:
    """fp8's refusals that need the launch (the keys' values are config.py's): torch, torchao, the device."""
    if cfg.fp8 is None:
        return
    if not float8_training():
        raise UserError(f"fp8 needs torch 2.11 or newer (torchao 0.18's float8 training), this is torch "
                        f"{torch.__version__}: upgrade torch, or set fp8: null")
    try:
        torchao_float8()
    except ImportError:
        raise UserError(f"fp8: {cfg.fp8} needs torchao, which is not installed: {EXTRA}") from None
    if not cfg.fp8_emulate and not fp8_matmuls(chip):
        raise UserError(f"fp8: {cfg.fp8} needs FP8 matmuls, which {chip.describe()} lacks (a GPU of sm89 or "
                        f"newer: L4, L40S, H100, H200, B200): set fp8_emulate: true to run its casts with fp32 "
                        f"matmuls (slow), or fp8: null")


def pays(recipe: str, n: int, k: int) -> bool:
    """Whether FP8 pays for a linear of n outputs and k inputs: torchao's cut-offs, measured on an
    H100 (float8_linear_utils._auto_filter_for_recipe; rowwise_with_gw_hp, which that filter refuses,
    takes rowwise's, its backward being no cheaper)."""
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


# the blocks' linears that stay in high precision: the routers (their scores pick the experts) and a linear
# layer's gates (each head's decay and write strength, through exp and sigmoid)
HIGH_PRECISION = (".router", ".in_proj_a", ".in_proj_b")


def candidates(model: nn.Module) -> dict[str, nn.Linear]:
    """{name: linear} of the blocks' linears that may run in FP8 (HIGH_PRECISION's never do)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.startswith("blocks.") and not name.endswith(HIGH_PRECISION)}


def chosen(recipe: str, layers: str, linear: nn.Linear) -> bool:
    n, k = linear.weight.shape
    return n % 16 == 0 and k % 16 == 0 and (layers == "all" or pays(recipe, n, k))


def convert(model: nn.Module, cfg, wrap: str, shard_ranks: int = 1) -> str:
    """Swap the chosen linears for torchao's Float8Linear (on the meta device, before activation
    checkpointing, compile and fully_shard, as torchtitan does); returns the start-up line. FSDP2
    all-gathers their weights in FP8 under tensorwise (torchao's float8 all-gather: tensorwise only),
    unless cpu_offload keeps the shards on the host, or a weight's rows don't divide by the shard
    group's `shard_ranks`: there the weight is gathered as the others are, then cast."""
    float8 = torchao_float8()
    recipe = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(cfg.fp8), emulate=cfg.fp8_emulate)
    linears = candidates(model)
    picked = {name for name, m in linears.items() if chosen(cfg.fp8, cfg.fp8_layers, m)}
    gathered = {name for name in picked
                if float8_all_gather(cfg, wrap) and evenly_sharded(linears[name], shard_ranks)}
    for names, all_gather in ((gathered, True), (picked - gathered, False)):
        if names:  # (torchao refuses a config of float8 all-gather with rowwise scales, even for none)
            config = dataclasses.replace(recipe, enable_fsdp_float8_all_gather=all_gather)
            float8.convert_to_float8_training(model, config=config,
                                              module_filter_fn=lambda m, fqn, names=names: fqn in names)
    return note(cfg, wrap, gathered, shard_ranks, linears, picked, len(model.moe_layers()))


def float8_all_gather(cfg, wrap: str) -> bool:
    """Whether FSDP2 may all-gather the FP8 linears' weights in FP8: tensorwise scales (torchao's float8
    all-gather has no other), under FSDP2, with the shards on the device."""
    return cfg.fp8 == "tensorwise" and wrap == "fsdp" and not cfg.cpu_offload


def evenly_sharded(linear: nn.Linear, shard_ranks: int) -> bool:
    """Whether FSDP2 gives each rank of the shard group as many of the weight's rows. torchao 0.18's
    float8 all-gather hook (the one-argument fsdp_pre_all_gather) returns a short rank's shard without
    FSDP2's padding, and FSDP2 checks the padding only for the five-argument form: the ranks' gathers
    mismatch and hang (pytorch/ao#3982). A weight sharded unevenly gathers in high precision instead."""
    return linear.weight.shape[0] % shard_ranks == 0


def note(cfg, wrap: str, gathered: set, shard_ranks: int, linears: dict, picked: set, moe_layers: int) -> str:
    """The start-up line: how the FP8 linears run, which they are, and what stays in high precision."""
    how = ["emulated: fp32 matmuls"] * cfg.fp8_emulate
    how += ["float8 all-gather, scales computed after each step"] * bool(gathered)
    cast_after = sorted(picked - gathered) if wrap == "fsdp" else []
    if cast_after and float8_all_gather(cfg, wrap):  # left out of the float8 all-gather for their rows alone
        how.append(f"{len(cast_after)} weights all-gathered in high precision, then cast: their rows don't divide by "
                   f"the shard group's {shard_ranks} ranks ({_kinds(cast_after)})")
    elif cast_after:
        how.append("weights all-gathered in high precision, then cast")
    if not (cfg.compile or cfg.fp8_emulate):  # published: uncompiled rowwise at 0.23x bf16's speed
        how.append("uncompiled, torchao's casts run eagerly: slower than without fp8, set compile: true")
    rest = sorted(set(linears) - picked)
    high = ["the embeddings and LM head"]
    high += [f"{len(rest)} by fp8_layers {cfg.fp8_layers} ({_kinds(rest)})"] * bool(rest)
    high += [f"the routers and experts of {moe_layers} MoE layers"] * bool(moe_layers)
    how = f" ({'; '.join(how)})" if how else ""
    chosen_kinds = f" ({_kinds(sorted(picked))})" if picked else ""
    return (f"fp8 {cfg.fp8}{how}: {len(picked)} of {len(linears)} block linears in FP8{chosen_kinds}; high "
            f"precision: {', '.join(high)}")


def _kinds(names) -> str:
    """blocks.0.attn.c_proj, blocks.1.attn.c_proj -> 'attn.c_proj x2'."""
    counts = collections.Counter(re.sub(r"^blocks\.\d+\.", "", name) for name in names)
    return ", ".join(f"{kind} x{n}" for kind, n in counts.items())


def plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor under torchao's float8 all-gather wrapper (WeightWithDynamicFloat8CastTensor), t
    itself otherwise: checkpoints hold plain tensors, which torch.load(weights_only=True) reads
    without torchao."""
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")
    return t._tensor if fsdp_utils and isinstance(t, fsdp_utils.WeightWithDynamicFloat8CastTensor) else t


def gathered_in_fp8(p: torch.Tensor) -> bool:
    """Whether FSDP2 all-gathers p in FP8: its shard is torchao's wrapper."""
    local = p.to_local() if isinstance(p, DTensor) else p
    return plain(local) is not local


class Float8Scales:
    """The scales of the weights FSDP2 all-gathers in FP8, computed for all of them together (one
    all-reduce of their amaxes) after each optimizer step, as torchtitan does; without it each
    weight's gather would reduce its own amax, as the first step's gathers do (the same scales). A
    collective: every rank calls it, at the same points. Nothing to do without float8 all-gather."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.active = "torchao.float8" in sys.modules and any(gathered_in_fp8(p) for p in model.parameters())

    def step(self) -> None:
        if self.active:
            sys.modules["torchao.float8"].precompute_float8_dynamic_scale_for_fsdp(self.model)

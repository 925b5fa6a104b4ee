"""Which DecoderBlocks share an FSDP unit (fsdp_blocks_per_unit): the fixed cost of sharding.

Every FSDP unit costs host work each micro-step whatever its size: FSDP2's hooks around its forward
and backward, in them work for each of its parameters (shards copied into the gather buffer and out
of it, DTensors swapped out of the modules and back), and one all-gather and one reduce-scatter.
Where a block computes in less time than that, the GPU waits for the host: GPT-2 124M on one H100,
a unit a block under FULL_SHARD, ran 0.774x the unwrapped model (FSDP::pre_forward about 1.5 ms a
block, pre_backward 1.3 ms, 2026-11-27). k consecutive blocks in one unit pay it once, at the price of
k blocks' parameters gathered at once instead of one.

auto picks the fewest blocks whose compute at the device's peak takes UNIT_HOST_SECONDS, what FSDP2's
host work for a unit takes: a unit's compute then covers it. A block that computes that long alone
stays a unit of its own (Llama 1B on a GPU; the 25M model of tests/test_scale.py on a CPU core);
where the whole model computes in less, it is one unit: the root's, with the embeddings and the head,
gathered once a step (the tiny models of the tests and bench/speed.py's fixed_cost). Where
ranks communicate on GPUs, at least OVERLAP_UNITS units, so that collectives overlap compute. A unit
gathers UNIT_GATHER_BYTES at most, and under cpu_offload (chosen for memory) a unit is a block.

The units are a runtime choice: FSDP2 shards each parameter along its rows whatever unit it is in,
so checkpoints and the optimizer's state are the same under any layout, and at 2 ranks every number
computed too. At 3 or more on gloo a layout's change may move the last bits: gloo reduce-scatters as
an all-reduce of the unit's whole buffer, whose ring segments follow the buffer's size.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_gpt.distributed.launch import decided_on_rank0
from fsdp_gpt.distributed.precision import Chip
from fsdp_gpt.distributed.peak_flops import gpu_peak_flops, timed_matmul_flops, vector_peak_flops
from fsdp_gpt.model import GPT

# FSDP2's host work for one unit and micro-step, forward and backward: the two hooks traced on an
# H100's host (2.8 ms, 2026-11-27) and the post-backward's reduce-scatter, rounded up
UNIT_HOST_SECONDS = 4e-3
# On a GPU, NCCL's collectives run on their own stream: unit i+1's all-gather beside unit i's compute,
# and unit i's reduce-scatter beside unit i-1's backward. What no compute hides is about the first
# unit's gather and the last one's reduce-scatter: with this many units, a quarter of the step's
# communication at most. So auto keeps at least this many where ranks communicate on GPUs (on a CPU,
# gloo's collectives hide nothing: FSDP2 waits for each). A judgment, not yet measured on a cluster.
OVERLAP_UNITS = 4
# What one unit may hold gathered (a FULL_SHARD step holds about two units at once, more with
# fsdp_prefetch): a model of billions at small micro-batches would otherwise take units of several
# GB for host cost alone. A judgment: 1 GiB holds 8 Llama 1B blocks in bf16, 2 of a 7B model's.
UNIT_GATHER_BYTES = 2**30


@dataclass(frozen=True)
class UnitLayout:
    sizes: tuple[int, ...]  # consecutive blocks a unit, in order; one unit: the whole model, the root's
    why: str  # how the sizes were chosen, for the start-up line

    @classmethod
    def of(cls, blocks_per_unit: int, n_layer: int, why: str) -> "UnitLayout":
        """Units of blocks_per_unit blocks, the last holding what is left."""
        full, rest = divmod(n_layer, blocks_per_unit)
        return cls((blocks_per_unit,) * full + ((rest,) if rest else ()), why)

    @classmethod
    def balanced(cls, count: int, n_layer: int, why: str) -> "UnitLayout":
        """count units, their sizes a block apart at most (12 blocks in 2: 6 and 6)."""
        return cls(tuple(n_layer // count + (i < n_layer % count) for i in range(count)), why)

    @property
    def whole_model(self) -> bool:
        """One unit: the blocks are none of their own, the root's unit holds everything."""
        return len(self.sizes) == 1

    def units(self, blocks) -> list[list[torch.nn.Module]]:
        """The blocks grouped into units, in order; none for the whole model."""
        if self.whole_model:
            return []
        starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        return [list(blocks[start:start + size]) for start, size in zip(starts, self.sizes)]

    def describe(self) -> str:
        if self.whole_model:
            return f"FSDP units: the whole model one unit ({self.why})"
        sizes = (f"{self.sizes[0]} block{'s' * (self.sizes[0] > 1)} each" if len(set(self.sizes)) == 1 else
                 f"{', '.join(map(str, self.sizes[:-1]))} and {self.sizes[-1]} blocks")
        return f"FSDP units: {len(self.sizes)} of {sizes}, and the root (embeddings, final norm, head) ({self.why})"


def device_peak_flops(chip: Chip, dtype: torch.dtype) -> float | None:
    """The device's peak FLOP/s in dtype: a GPU's data sheet (None for a GPU the table lacks), a CPU's
    vector units at the threads this process has (or a timed matmul where /proc/cpuinfo tells nothing)."""
    if chip.type == "cuda":
        return gpu_peak_flops(chip.name, dtype)
    threads = torch.get_num_threads()
    bound = vector_peak_flops(threads)
    return bound[0] if bound else timed_matmul_flops()


def block_flops_per_micro_step(gpt: GPT, micro_tokens: int) -> float:
    """Training FLOPs of one (average) block for a rank's micro-batch: the model's, less the LM head's."""
    head = 6 * gpt.lm_head.weight.numel()
    return (gpt.flops_per_token() - head) / gpt.config.n_layer * micro_tokens


def choose_layout(cfg, gpt: GPT, chip: Chip, dtype: torch.dtype) -> UnitLayout:
    """The run's layout, decided on rank 0 and sent to every rank (a timed CPU peak may differ
    between ranks, and ranks whose units differ would wait in different collectives)."""
    n = gpt.config.n_layer
    if cfg.fsdp_blocks_per_unit != "auto":
        return UnitLayout.of(min(cfg.fsdp_blocks_per_unit, n), n, "fsdp_blocks_per_unit")
    if cfg.cpu_offload:
        return UnitLayout.of(1, n, "auto: a unit a block under cpu_offload, which is chosen for memory")
    return decided_on_rank0(lambda: auto_layout(gpt, cfg.micro_batch * cfg.block_size // cfg.cp_size, chip, dtype,
                                                overlap=chip.type == "cuda" and dist.get_world_size() > 1))


def auto_layout(gpt: GPT, micro_tokens: int, chip: Chip, dtype: torch.dtype, overlap: bool = False) -> UnitLayout:
    """overlap: ranks communicate on GPUs, where OVERLAP_UNITS units hide most of it behind compute."""
    n = gpt.config.n_layer
    peak = device_peak_flops(chip, dtype)
    if peak is None:
        return UnitLayout.of(1, n, "auto: a unit a block, this GPU's peak FLOP/s is unknown")
    block_seconds = block_flops_per_micro_step(gpt, micro_tokens) / peak
    # as many units as hold at least the blocks whose compute covers a unit's host work
    count = max(1, n // math.ceil(UNIT_HOST_SECONDS / block_seconds))
    why = (f"auto: a block computes {block_seconds * 1e3:.2g} ms a micro-step at the device's peak, FSDP2's host "
           f"work a unit about {UNIT_HOST_SECONDS * 1e3:.0f} ms")
    if overlap and count < OVERLAP_UNITS:
        count = min(n, OVERLAP_UNITS)  # 7 blocks: 2, 2, 2 and 1, not 7 units of one
        why += f"; at least {OVERLAP_UNITS} units, whose collectives overlap compute"
    block_bytes = max(sum(p.numel() for p in block.parameters()) for block in gpt.blocks) * dtype.itemsize
    most = max(1, UNIT_GATHER_BYTES // block_bytes)
    if math.ceil(n / count) > most:
        count = math.ceil(n / most)
        why += f"; at most {most} blocks a unit ({UNIT_GATHER_BYTES / 2**30:g} GiB gathered)"
    return UnitLayout.balanced(count, n, why)

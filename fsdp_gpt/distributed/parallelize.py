"""The model made ready for its ranks, in a fixed order: built on the meta device, context
and expert parallelism swapped in, FP8 linears (fp8), activation checkpointing, compile,
fully_shard per unit of blocks (fsdp_units.py) and then the root, the vectors left whole (replicated.py)
(or DDP, or nothing at one process), weights
initialised on rank 0 and broadcast into the shards. model.py knows nothing of this: every part here is applied from outside.
"""
import contextlib

import torch
from torch._subclasses import FakeTensorMode
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from fsdp_gpt.compat import average_over_gloo
from fsdp_gpt.config import FIELDS, UserError
from fsdp_gpt.distributed.context_parallel import apply_context_parallel, swaps_attention
from fsdp_gpt.distributed.ring_attention import ring_refusal
from fsdp_gpt.distributed.expert_parallel import apply_expert_parallel, shard_experts
from fsdp_gpt.distributed.float8 import convert
from fsdp_gpt.distributed.fsdp_units import choose_layout
from fsdp_gpt.distributed.launch import STRATEGY_TABLE, Topology, agree
from fsdp_gpt.distributed.precision import DTYPES, autocast, compute_dtype
from fsdp_gpt.distributed.replicated import replicated_params, replicates
from fsdp_gpt.hf_format import read_hf_folder
from fsdp_gpt.model import GPT, GPTConfig
from fsdp_gpt.moe import MoE


def initial_state(cfg, gpt_cfg: GPTConfig) -> dict:
    """The full starting weights: a Hugging Face folder's (init_from), or the seed's."""
    if cfg.init_from:  # define_model made cfg the folder's model: its tensors fit
        return read_hf_folder(cfg.init_from)[1]
    torch.manual_seed(cfg.seed)
    return GPT(gpt_cfg).state_dict()


def build_model(cfg, gpt_cfg: GPTConfig, topo: Topology, fake: FakeTensorMode | None = None) -> torch.nn.Module:
    """fake: a dry run's fake tensors (observe/plan.py), the weights' once the model is shaped, converted and
    wrapped on the meta device: shapes without values, nothing to initialise."""
    with torch.device("meta"):
        model = GPT(gpt_cfg)
    if topo.is_main:  # before the (for large models, long) initialisation
        n_params, idle = model.num_params(), model.idle_expert_params()
        active = f", {n_params - idle:,} active per token ({(n_params - idle) / 1e6:.1f}M)" if idle else ""
        print(f"parameters: {n_params:,} ({n_params / 1e6:.1f}M){active}", flush=True)
    if cfg.cp_mode == "ring" and (refusal := ring_refusal(topo.chip, compute_dtype(cfg.dtype, topo.chip))):
        raise UserError(refusal)
    if swaps_attention(cfg.cp_mode, topo.cp_size):
        apply_context_parallel(model, cfg.cp_mode, topo.cp_group, topo.cp_size, topo.cp_rank, cfg.block_size,
                               topo.device)
    if topo.ep_size > 1:
        apply_expert_parallel(model, topo.expert_mesh["ep"])
    if cfg.fp8:
        note = convert(model, cfg, topo.wrap, topo.mesh.shape[-1] if topo.mesh is not None else 1)  # the shard group
        if topo.is_main:
            print(note, flush=True)
    model.activation_checkpointing = cfg.activation_checkpointing
    model.chunks_for = topo.chip.type  # the device's (a dry run's: the planned GPU's)
    if cfg.compile:
        compile_model(model, cfg.compile_mode)
    param_device = topo.device
    unused = [f"{key}={getattr(cfg, key)}" for key in ("fsdp_blocks_per_unit", "fsdp_prefetch")
              if getattr(cfg, key) != FIELDS[key].default]
    if topo.wrap == "none" and unused and topo.is_main:  # (DDP refuses them: config_checks)
        print(f"note: {' and '.join(unused)} take{'s' * (len(unused) == 1)} no effect: one process runs the model unwrapped, nothing sharded "
              f"(force_fsdp: true wraps it)", flush=True)
    if topo.wrap == "fsdp":
        _, reshard = STRATEGY_TABLE[cfg.sharding_strategy]
        dtype = compute_dtype(cfg.dtype, topo.chip)
        # cast_forward_inputs off: a block's input x is in the compute dtype already (computed with
        # cast parameters), and the fp32 RoPE tables the root hands each block must stay fp32
        shard_args = dict(mesh=topo.mesh, mp_policy=MixedPrecisionPolicy(
            param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=DTYPES[cfg.reduce_dtype],
            cast_forward_inputs=False), ignored_params=replicated_params(cfg, dtype, model))
        if cfg.cpu_offload:
            shard_args["offload_policy"] = CPUOffloadPolicy(pin_memory=topo.device.type == "cuda")
            param_device = torch.device("cpu")
        layout = choose_layout(cfg, model, topo.chip, dtype)
        if topo.is_main:
            print(layout.describe(), flush=True)
        units = layout.units(model.blocks)
        for i, unit in enumerate(units or [list(model.blocks)]):  # the whole model one unit: the blocks join the root
            # the last unit's parameters are needed first in backward: keep them gathered
            keep = reshard and i < len(units) - 1
            for moe in (block.mlp for block in unit if topo.ep_size > 1 and isinstance(block.mlp, MoE)):
                shard_experts(moe, topo, keep, shard_args)  # units of their own, on the experts' mesh
            if units:
                fully_shard(unit, reshard_after_forward=keep, **shard_args)  # one gather, one set of hooks
        prefetch(units, cfg.fsdp_prefetch, topo.is_main)
        fully_shard(model, **shard_args)  # the root: embeddings, final norm, tied LM head (and the blocks, if one unit)
        for unit in (*(u[0] for u in units), model):  # a unit's modules share one FSDP state
            average_over_gloo(unit, topo.device)
    with fake or contextlib.nullcontext():
        model.to_empty(device=param_device)
        model.tie_weights()
    if fake is None:
        # Same seed (or folder), same weights for any world size: rank 0 alone builds the full model
        # (host memory) and the weights are broadcast one tensor at a time into every rank's shards.
        full_state = agree(lambda: initial_state(cfg, gpt_cfg) if topo.is_main else {})
        set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    if topo.wrap == "ddp":
        # find_unused_parameters keeps DDP's first bucket layout. Otherwise DDP rebuilds its buckets
        # after the first synced step, in the order the gradients arrived: a resumed run's first
        # step would reduce in the old layout where the uninterrupted run used the new one, and at
        # 3+ ranks the ring all-reduce's summation order follows the layout (last bits differ).
        # The price: a walk of the autograd graph per step, and a one-time warning on each rank.
        model = DistributedDataParallel(model, device_ids=[topo.device.index] if topo.device.type == "cuda" else None,
                                        find_unused_parameters=True)
    return model


def prefetch(units: list[list[torch.nn.Module]], depth: int, says: bool) -> None:
    """Explicit prefetch (depth > 0): unit i's forward starts the all-gathers of units i+1 ..
    i+depth, its backward those of i-1 .. i-depth. FSDP2's own order (0) keeps one unit ahead;
    depth 1 gives the same overlap with the gather issued earlier from the host, and each depth
    beyond holds one more gathered unit. A unit's first block stands for it (they share one state).
    A depth past the layout's units (fsdp_blocks_per_unit: auto decides them at start-up) is cut to
    what they allow, said where `says` (rank 0)."""
    most = max(len(units) - 1, 0)
    if depth > most and says:
        print(f"note: fsdp_prefetch={depth} reaches past the {len(units) or 1} FSDP unit{'s' * (len(units) > 1)} of "
              f"this layout: {f'prefetching {most}' if most else 'nothing to prefetch (the whole model one unit)'}",
              flush=True)
    depth = min(depth, most)
    if depth:
        heads = [unit[0] for unit in units]
        for i, head in enumerate(heads):
            head.set_modules_to_forward_prefetch(heads[i + 1:i + 1 + depth])
            head.set_modules_to_backward_prefetch(heads[max(0, i - depth):i][::-1])


def compile_model(model: GPT, mode: str) -> None:
    """Each DecoderBlock compiled alone (FSDP's hooks run between them: one graph a block), and the
    LM head's loss chunk (its soft cap, log-sum-exp and gradient fused into passes over the chunk)."""
    for block in model.blocks:
        block.compile(mode=mode)
    model.head_loss_chunk = torch.compile(model.head_loss_chunk, mode=mode)


def micro_steps(cfg, model: torch.nn.Module):
    """set(model, last): what a micro-step sets before its forward. Gradients are reduced on the
    last micro-step only: one reduction per optimizer step. Where the parameters stay gathered from
    forward through backward (SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD_ZERO2, and any strategy where the
    whole model is one unit, which FSDP2 never reshards after forward), they stay gathered across
    the step's micro-steps too, and are resharded after the last backward: one all-gather per step
    instead of one per micro-step, at no higher peak (the end of each forward holds them all
    gathered anyway)."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]  # the root, blocks (a group's: each), experts
    one_unit = isinstance(model, FSDPModule) and not any(isinstance(b, FSDPModule) for b in model.blocks)
    gathered_through_step = cfg.fsdp and (not STRATEGY_TABLE[cfg.sharding_strategy][1] or one_unit)

    def set_micro_step(model: torch.nn.Module, last: bool) -> None:
        if isinstance(model, DistributedDataParallel):
            model.require_backward_grad_sync = last
        for unit in units:  # each unit itself: FSDP2's own recursion walks every module, 1 ms a step
            unit.set_requires_gradient_sync(last, recurse=False)
            if gathered_through_step:
                unit.set_reshard_after_backward(last, recurse=False)
        # an unwrapped model (one process) has no gradients to reduce
    return set_micro_step


def forward_context(cfg, topo: Topology):
    """The context of every forward: training, val loss and text samples compute in one dtype."""
    dtype = compute_dtype(cfg.dtype, topo.chip)
    fsdp_casts_all = topo.wrap == "fsdp" and not replicates(cfg, dtype)
    return lambda: autocast(dtype, topo.device, fsdp_casts_all)

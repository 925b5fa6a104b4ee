"""The parameters FSDP2 leaves whole on every rank: the one-dimensional ones (norms' weights,
biases, value_mix).

FSDP2's host work at each hook runs for each parameter of a unit (copied into the gather buffer and
out of it, swapped out of its module and back, its gradient copied into the reduce-scatter and made
a DTensor), whatever its size. GPT-2 124M has 148 parameter tensors, 98 of them vectors: 0.1% of
its weights, two thirds of that work. Left out of FSDP2 (`fully_shard(ignored_params=...)`), every rank
holds them whole, in fp32; their gradients are averaged over the ranks in one flat all-reduce a
step (`gradient_reduction`), and autocast casts them for the compute beside FSDP2's
MixedPrecisionPolicy, which casts the matrices it gathers (precision.autocast): each weight is
rounded once to the compute dtype, as in an unwrapped run.

Not under cpu_offload, which is chosen for memory: every parameter then stays on the host, sharded;
nor under fp16 (see replicates). There autocast stays off.
Checkpoints don't depend on it: a plain tensor is written whole by rank 0 (ckpt_format.piece_of) and
read into a shard or a whole tensor alike.
"""
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_gpt.distributed.launch import Topology


def replicates(cfg, dtype: torch.dtype) -> bool:
    """Whether FSDP2 leaves the vectors whole (and autocast casts them): everywhere but cpu_offload
    and fp16, whose GradScaler unscales the gradients in one call that takes DTensors or plain
    tensors, not both."""
    return not cfg.cpu_offload and dtype != torch.float16


def replicated_params(cfg, dtype: torch.dtype, model: torch.nn.Module) -> set[torch.nn.Parameter]:
    """The vectors FSDP2 leaves whole. Not the experts' selection bias, which has no gradient: the loop
    moves it on its shards (optim/expert_balance.py)."""
    if not replicates(cfg, dtype):
        return set()
    return {p for p in model.parameters() if p.dim() < 2 and p.requires_grad}


def gradient_reduction(model: torch.nn.Module, topo: Topology) -> Callable[[], None]:
    """reduce(): average the whole parameters' gradients over every rank, as FSDP2 averages its own
    over the same ranks (its mesh is the world), in one collective: summed, then divided (gloo has no
    average). Called after a step's last backward; nothing to do unwrapped, under DDP (which reduces
    every gradient itself) or in one process."""
    whole = [p for p in model.parameters() if not isinstance(p, DTensor)]
    if topo.wrap != "fsdp" or topo.world_size == 1 or not whole:
        return lambda: None

    def reduce() -> None:
        grads = [p.grad for p in whole if p.grad is not None]  # which have one is the model's, alike on every rank
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= topo.world_size
        torch._foreach_copy_(grads, list(flat.split([g.numel() for g in grads])))
    return reduce

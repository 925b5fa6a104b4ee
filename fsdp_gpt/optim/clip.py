"""Gradient clipping by the global norm, whatever meshes the gradients live on.

Sharded gradients (FSDP2's DTensors, on one mesh or, under expert parallelism, two) are clipped on
their local shards: every rank sums the squares of its own slices, each slice counted by one of the
ranks holding it, and one all-reduce of that number over every rank gives the global norm. torch's
clip_grad_norm_ can't stack the norms of two meshes, would make them whole one mesh dimension at a
time (an all-reduce over efsdp, then one over ep), and even on one mesh dispatches its foreach norm
and scaling through DTensor: 1.5-3 ms a step at 148 parameters on a CPU, FSDP's fixed cost
(docs/sharding.md). Plain gradients (one process, DDP: every rank holds them whole) take torch's own."""
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_gpt.distributed.shards import counted_here, local_part


@torch.no_grad()  # and DTensor's to_local() a plain attribute read, not an autograd function
def clip_gradients(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Scale every gradient so that their global norm is at most max_norm; returns that norm before."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not any(isinstance(g, DTensor) for g in grads):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    mine = [local_part(g) for g in grads if counted_here(g)]
    squares = torch.zeros((), device=local_part(grads[0]).device)
    if mine:
        squares += torch.nn.utils.get_total_norm(mine).square()
    dist.all_reduce(squares)  # every rank, whatever it counted: the one collective of the norm
    total = squares.sqrt()
    torch._foreach_mul_([local_part(g) for g in grads], (max_norm / (total + 1e-6)).clamp(max=1.0))
    return total

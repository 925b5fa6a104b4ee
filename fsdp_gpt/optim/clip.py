"""Gradient clipping by the global norm, whatever meshes the gradients live on. Expert parallelism
leaves two (the experts' and everyone else's), whose DTensors torch's clip_grad_norm_ can't stack,
and whose norms DTensor would make whole one mesh dimension at a time (an all-reduce over efsdp,
then one over ep). There every rank sums the squares of its own slices, each slice counted by one
of the ranks holding it, and one all-reduce of that number over every rank gives the global norm."""
import torch
import torch.distributed as dist

from fsdp_gpt.distributed.shards import counted_here, local_part


def clip_gradients(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Scale every gradient so that their global norm is at most max_norm; returns that norm before."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if len({getattr(g, "device_mesh", None) for g in grads}) < 2:  # one mesh (or plain tensors): torch's own
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    mine = [local_part(g) for g in grads if counted_here(g)]
    squares = torch.zeros((), device=local_part(grads[0]).device)
    if mine:
        squares += torch.nn.utils.get_total_norm(mine).square()
    dist.all_reduce(squares)  # every rank, whatever it counted: the one collective of the norm
    total = squares.sqrt()
    torch._foreach_mul_([local_part(g) for g in grads], (max_norm / (total + 1e-6)).clamp(max=1.0))
    return total

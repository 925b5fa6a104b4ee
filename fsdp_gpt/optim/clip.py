"""Gradient clipping by the global norm, whatever meshes the gradients live on. Expert parallelism
leaves two (the experts' and everyone else's), whose DTensors torch's clip_grad_norm_ can't stack:
there each mesh's norm is made whole (a collective on every rank) and the norms combined."""
import torch
from torch.distributed.tensor import DTensor

from fsdp_gpt.distributed.shards import local_part


def clip_gradients(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Scale every gradient so that their global norm is at most max_norm; returns that norm before."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    # in the model's order, the same on every rank: each mesh's norm is a collective
    meshes = list(dict.fromkeys(getattr(g, "device_mesh", None) for g in grads))
    if len(meshes) < 2:  # one mesh (or plain tensors): torch's own
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    by_mesh = [[g for g in grads if getattr(g, "device_mesh", None) == mesh] for mesh in meshes]
    norms = [torch.nn.utils.get_total_norm(group) for group in by_mesh]
    total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
    torch._foreach_mul_([local_part(g) for g in grads], (max_norm / (total + 1e-6)).clamp(max=1.0))
    return total

"""What differs between the torch versions this trainer runs on, in one place (README: supported
versions). Everything else calls torch's public API as it is in every supported version."""
import torch.distributed as dist


def all_gather_flat(output, tensor, group=None) -> None:
    """Every rank's `tensor` into `output`, concatenated in rank order along dim 0.
    all_gather_single arrives in torch 2.13, which deprecates all_gather_into_tensor."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)

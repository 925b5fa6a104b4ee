"""What differs between the torch versions this trainer runs on, in one place (README: supported
versions). Everything else calls torch's public API as it is in every supported version."""
import torch
import torch.distributed as dist


def torch_version() -> tuple[int, int]:
    """(major, minor) of the running torch: 2.11.0+cu130 -> (2, 11)."""
    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def flight_recorder_buffer_variable() -> str:
    """The variable that sizes NCCL's flight recorder. torch 2.11 warns at every process group made
    while the old name is set (seen on an H200, 2026-11-26); 2.8 reads only the old one (its new
    name then was TORCH_TRACE_BUFFER_SIZE), so before 2.11 the old name stays."""
    return "TORCH_FR_BUFFER_SIZE" if torch_version() >= (2, 11) else "TORCH_NCCL_TRACE_BUFFER_SIZE"


def all_gather_flat(output, tensor, group=None) -> None:
    """Every rank's `tensor` into `output`, concatenated in rank order along dim 0.
    all_gather_single arrives in torch 2.13, which deprecates all_gather_into_tensor."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)

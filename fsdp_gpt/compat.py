"""What differs between the torch versions this trainer runs on (2.8 to 2.13), in one place (README:
supported versions). Everything else calls torch's public API as it is in every supported version.
At the bottom of the package, beside no other module: the model asks it which kernels exist, the
distributed code how to gather and reduce."""
import torch
import torch.distributed as dist


def torch_version() -> tuple[int, int]:
    """(major, minor) of the running torch, (2, 13) for 2.13.0+cpu: read at each call (tests stand another in)."""
    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def all_gather_flat(output, tensor, group=None) -> None:
    """Every rank's `tensor` into `output`, concatenated in rank order along dim 0.
    all_gather_single arrives in torch 2.13, which deprecates all_gather_into_tensor."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def all_gather_autograd(tensor: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `tensor` concatenated along dim 0, its backward the reduce-scatter of the gradient
    (a functional collective). torch 2.13 names it all_gather_single_autograd and deprecates the older
    name, which 2.8 alone has."""
    from torch.distributed import _functional_collectives as collectives
    gather = getattr(collectives, "all_gather_single_autograd", None) or collectives.all_gather_tensor_autograd
    return gather(tensor, 0, group)


def grouped_mm_on_cpu() -> bool:
    """Whether torch._grouped_mm has a CPU kernel: from torch 2.13 (2.8 has none)."""
    return torch_version() >= (2, 13)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """autocast's dtype where it is on for the device, else None. torch.is_autocast_enabled raises
    for a device type without autocast (the meta device, where models are built and counted)."""
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def flash_takes_window() -> bool:
    """Whether CUDA's flash kernel (aten._flash_attention_forward) takes a sliding window
    (window_size_left/right), read from its schema: 2.13's has them; where one lacks them the window
    is computed in bands (attention.banded_attention) instead."""
    return "window_size_left" in str(torch.ops.aten._flash_attention_forward.default._schema)


def float8_training() -> bool:
    """Whether torchao's float8 training (fp8, torchao 0.18) runs on this torch: from 2.11, the
    oldest torchao 0.18 supports (it loads its kernels and registers its FP8 ops from there on)."""
    return torch_version() >= (2, 11)


def average_over_gloo(unit, device: torch.device, reduces: bool = True) -> None:
    """FSDP2 averages gradients with ReduceOp.AVG, which gloo sums without dividing in torch 2.8: on
    gloo (CPU), an FSDP unit sums and divides by the data-parallel size instead (NCCL keeps AVG).
    reduces=False: a group of one, where nothing is reduce-scattered and torch 2.13 divides a forced
    sum twice (in the copy it makes instead, and after it); unforced, the copy divides once."""
    unit.set_force_sum_reduction_for_comms(device.type != "cuda" and reduces)


def unflatten(mesh, dim: int, sizes: tuple[int, ...], names: tuple[str, ...]):
    """A mesh's dimension `dim` seen as `sizes` (DeviceMesh._unflatten, tested on 2.13), or None where
    this torch lacks it."""
    return mesh._unflatten(dim, sizes, names) if hasattr(mesh, "_unflatten") else None


def flight_recorder_buffer_variable() -> str:
    """The variable that sizes NCCL's flight recorder. torch 2.11 warns at every process group made
    while the old name is set (seen on an H200, 2026-11-26); 2.8 reads only the old one (its new
    name then was TORCH_TRACE_BUFFER_SIZE), so before 2.11 the old name stays."""
    return "TORCH_FR_BUFFER_SIZE" if torch_version() >= (2, 11) else "TORCH_NCCL_TRACE_BUFFER_SIZE"

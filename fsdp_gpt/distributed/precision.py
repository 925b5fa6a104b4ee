"""Devices and numerics: which device a process computes on, and the dtype it computes in.

Every forward (training, val loss, text samples, evaluate.py, sample.py) runs under the same
`autocast`, so a run's logged val loss is what evaluate.py reports for its checkpoint.
"""
from dataclasses import dataclass

import torch

from fsdp_gpt.config import UserError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def pick_device(local_rank: int = 0) -> torch.device:
    """GPU local_rank when there is one, else the CPU. On GPUs fp32 matmuls (dtype: fp32, and the
    few fp32 ops under autocast) run on tensor cores as TF32: about 10 bits of mantissa instead
    of 23, several times faster; bf16/fp16 compute is unaffected. On the CPU values below fp32's
    smallest normal (1.2e-38: softmax's far tails, squares of tiny gradients) are flushed to zero,
    as GPU kernels mostly do: x86 computes on them many times slower, which cost a run here about
    5% of its steps (docs/performance.md)."""
    if not torch.cuda.is_available():
        torch.set_flush_denormal(True)
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    torch.set_float32_matmul_precision("high")
    return device


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run on the device's tensor cores (Ampere and newer), not emulated."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)


@dataclass(frozen=True)
class Chip:
    """What start-up decides by about the device a rank computes on (the compute dtype, FP8, the ring's
    kernels, the FSDP units' layout by its peak FLOP/s): its type and, for a GPU, its name as
    torch.cuda.get_device_name reports it (peak_flops' key), its compute capability and whether bf16 is
    native there. Read from the device (Chip.of), or for a dry run the GPU it plans for (observe/plan.py)."""
    type: str  # "cuda" or "cpu"
    name: str = ""
    capability: tuple[int, int] = (0, 0)
    bf16: bool = False

    @classmethod
    def of(cls, device: torch.device) -> "Chip":
        if device.type != "cuda":
            return cls(device.type)
        return cls("cuda", torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device),
                   native_bf16(device))

    def describe(self) -> str:
        return f"{self.name} (sm{self.capability[0]}{self.capability[1]})" if self.type == "cuda" else \
            f"the {self.type.upper()}"


def compute_dtype(dtype: str, chip: Chip) -> torch.dtype:
    """The config's `dtype` resolved for a device: auto is bf16 on GPUs that have it, fp16 (with
    gradient scaling) on older ones, where emulated bf16 is slow (V100, T4), fp32 on CPU."""
    if dtype != "auto":
        return DTYPES[dtype]
    if chip.type == "cuda":
        return torch.bfloat16 if chip.bf16 else torch.float16
    return torch.float32


def check_offload(dtype: torch.dtype, cpu_offload: bool) -> None:
    """fp16 with cpu_offload is refused: GradScaler hands the offloaded (host) gradients its
    inv_scale and found_inf through non_blocking copies from the GPU, and the CPU kernels read
    them without waiting for the copy (torch/amp/grad_scaler.py, _MultiDeviceReplicator.get;
    fused AdamW's found_inf alike): stale scales and missed overflows, silently."""
    if dtype == torch.float16 and cpu_offload:
        raise UserError("dtype fp16 (also what dtype: auto picks on GPUs without bf16) with cpu_offload: true is not "
                        "supported: its loss scaling reads GPU values on the host unsynchronised; use dtype: bf16 or "
                        "fp32, or cpu_offload: false")


def autocast(dtype: torch.dtype, device: torch.device, fsdp_casts_all: bool = False):
    """The context every forward runs in: autocast to `dtype`, unwrapped, under DDP, and under FSDP
    for the vectors FSDP2 leaves whole (replicated.py: FSDP2's MixedPrecisionPolicy casts the
    matrices it gathers, autocast the rest). Off where FSDP2 casts every parameter (cpu_offload, fp16)."""
    return torch.autocast(device.type, dtype=dtype, enabled=not fsdp_casts_all and dtype != torch.float32)

"""The GPUs a dry run plans for (dry_run_gpu): what start-up decides by (precision.Chip: the name peak_flops
knows them by, compute capability, native bf16), the memory a rank may fill and the links its collectives take.

Memory: what torch.cuda reports as the device's total (nvidia-smi's MiB), in GB of 1e9 bytes as every figure
of the plan is; the CUDA context and the caching allocator's slack come out of it. Links, per GPU and
direction, as the vendors' data sheets give them for the SXM boards in 8-GPU nodes: NVLink within a node (H100
and H200: NVLink 4, 900 GB/s both ways; A100: NVLink 3, 600), and one InfiniBand NIC a GPU between nodes (NDR
400 Gb/s beside H100 and H200, HDR 200 Gb/s beside A100). A ring collective moves (n-1)/n of its buffer over
each rank's link, so these bound its time from below: NCCL reaches about 80-90% of them.
"""
from dataclasses import dataclass

from fsdp_gpt.distributed.precision import Chip


@dataclass(frozen=True)
class GPU:
    chip: Chip
    memory_gb: float
    nvlink_gb_s: float  # a node's GPUs to each other
    network_gb_s: float  # to other nodes


PLANNED = {
    "H100": GPU(Chip("cuda", "NVIDIA H100 80GB HBM3", (9, 0), bf16=True), 85.5, 450.0, 50.0),
    "H200": GPU(Chip("cuda", "NVIDIA H200", (9, 0), bf16=True), 150.8, 450.0, 50.0),
    "A100": GPU(Chip("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), bf16=True), 85.9, 300.0, 25.0),
}

"""The peak FLOP/s MFU divides by: a GPU's from its data sheet, a CPU's from its cores.

A CPU has no data sheet entry here, so its peak is the larger of two figures: a timed fp32 matmul
(what the process's threads reach: many short rounds, the fastest taken, so that a passing load
undercuts few of them), and what the cores' vector width and clock allow (fp32 lanes x 2 for the fused
multiply-add x 2 FMA units x clock x threads, where /proc/cpuinfo tells the width and clock: no upper
bound where the cores run above the clock it reports, as a VM's do). MFU on a CPU is an estimate, and
said so.
"""
import os
import re
import time

import torch

# Dense peak FLOP/s, no sparsity, from the vendors' data sheets, by the exact name
# torch.cuda.get_device_name reports ("L40" must not take "L4"'s figure, nor an H100 PCIe an H100
# SXM's): (16-bit: bf16, or fp16 where the GPU has no bf16; 32-bit: TF32 tensor cores, which
# dtype: fp32 uses on Ampere and newer, or plain FP32 on V100 and T4, which have no TF32).
GPU_PEAK_FLOPS = {
    "NVIDIA B200": (2250e12, 1100e12), "NVIDIA GH200 480GB": (989e12, 494e12), "NVIDIA H200": (989e12, 494e12),
    "NVIDIA H200 NVL": (835e12, 418e12), "NVIDIA H100 80GB HBM3": (989e12, 494e12),
    "NVIDIA H100 NVL": (835e12, 418e12), "NVIDIA H100 PCIe": (756e12, 378e12),
    "NVIDIA A100-SXM4-80GB": (312e12, 156e12), "NVIDIA A100-SXM4-40GB": (312e12, 156e12),
    "NVIDIA A100 80GB PCIe": (312e12, 156e12), "NVIDIA A100-PCIE-40GB": (312e12, 156e12),
    "NVIDIA L40S": (362e12, 183e12), "NVIDIA L40": (181e12, 90.5e12), "NVIDIA L4": (121e12, 60e12),
    "NVIDIA A10G": (70e12, 35e12), "NVIDIA A10": (125e12, 62.5e12), "NVIDIA RTX A6000": (155e12, 77.4e12),
    "NVIDIA GeForce RTX 4090": (165e12, 82.6e12), "NVIDIA GeForce RTX 3090": (71e12, 35.6e12),
    "Tesla V100-SXM2-16GB": (125e12, 15.7e12), "Tesla V100-SXM2-32GB": (125e12, 15.7e12),
    "Tesla V100-PCIE-16GB": (112e12, 14e12), "Tesla V100-PCIE-32GB": (112e12, 14e12), "Tesla T4": (65e12, 8.1e12),
}


FMA_UNITS = 2  # FMA pipes per core on x86 server cores since Haswell and Zen 2: an upper bound where there is one
# the timed matmuls: fp32, for at least this long, the fastest round taken. 0.05 s is ~140 rounds of
# a third of a millisecond: 2026-11-29, 15 timings each on one core beside 2 busy processes, 0.05 s
# gave 75-92 GFLOP/s and 0.3 s 76-94 (quiet: 72-75 and 70-92), so the longer timing only cost every
# CPU run (and each of the suite's few hundred) 0.25 s more of start-up
MATMUL_SIZE, MATMUL_SECONDS = 256, 0.05


def gpu_peak_flops(name: str, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of one GPU, by the name torch.cuda.get_device_name reports, computing in `dtype`,
    from the table (None for a GPU it lacks: its MFU is unknown, not a guess)."""
    peaks = GPU_PEAK_FLOPS.get(name)
    return peaks and peaks[dtype == torch.float32]


def timed_matmul_flops() -> float:
    """fp32 FLOP/s of this process's threads as they are: the fastest of MATMUL_SECONDS' rounds of
    one matmul. A round takes a fraction of a millisecond, so a busy machine leaves some of them
    the cores. The thread count is left alone: torch.set_num_threads, even to the count it had,
    sets MKL's thread count for every later call, and MKL's matmuls inside torch's own parallel
    loops (CPU flash attention) then ran a quarter slower for the rest of the run."""
    a, b = torch.randn(MATMUL_SIZE, MATMUL_SIZE), torch.randn(MATMUL_SIZE, MATMUL_SIZE)
    torch.mm(a, b)  # warm up
    best, until = float("inf"), time.perf_counter() + MATMUL_SECONDS
    while time.perf_counter() < until:
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * MATMUL_SIZE ** 3 / best


def vector_peak_flops(threads: int, cpuinfo: str | None = None) -> tuple[float, str] | None:
    """(fp32 FLOP/s, how) that `threads` cores' vector units allow at their clock, or None where
    /proc/cpuinfo names no vector width or clock (then only the timed matmul counts)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    flags = set(" ".join(re.findall(r"^(?:flags|Features)\s*:(.*)$", cpuinfo, re.M)).split())
    lanes, isa = next(((n, name) for flag, n, name in (("avx512f", 16, "AVX-512"), ("avx2", 8, "AVX2"),
                                                     ("sse2", 4, "SSE2"), ("asimd", 4, "NEON")) if flag in flags),
                      (None, None))
    mhz = [float(m) for m in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", cpuinfo, re.M)]
    try:  # the highest clock the cores may run at, where the kernel tells (not inside most VMs)
        with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") as f:
            mhz.append(int(f.read()) / 1e3)
    except (OSError, ValueError):
        pass
    if lanes is None or not mhz:
        return None
    ghz = max(mhz) / 1e3
    return (threads * lanes * 2 * FMA_UNITS * ghz * 1e9,
            f"{threads} thread{'s' * (threads > 1)} x {isa} {lanes} fp32 lanes x 2 x {FMA_UNITS} FMA units x {ghz:.2f} GHz")


def cpu_peak_flops() -> tuple[float, str]:
    """(FLOP/s, how it was reached) of this process's CPU threads: the larger of the timed matmul
    and the vector units' bound."""
    threads = min(torch.get_num_threads(), os.cpu_count() or 1)
    measured, bound = timed_matmul_flops(), vector_peak_flops(threads)
    how = f"a timed fp32 matmul reached {measured / 1e9:.0f} GFLOP/s"
    if bound is None:
        return measured, f"{how} (no vector width or clock known: a busy machine may still undercut it)"
    return max(measured, bound[0]), f"{how}; {bound[1]} allow {bound[0] / 1e9:.0f}"

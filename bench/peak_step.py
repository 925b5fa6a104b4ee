"""A step's peak memory and time, each case in a process of its own (bench/doc_mask.py, bench/window.py).

In a fresh process, after one untimed step (first-call costs): on CPU the process's peak RSS during
the timed steps minus its RSS before them, on CUDA the peak allocated minus the allocated before; the
median time of the timed steps. glibc returns large blocks on free (MALLOC_MMAP_THRESHOLD_), so a
case's peak is its own.
"""
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def peak_and_time(step, steps: int, cuda: bool) -> str:
    """'peak_mb step_s' of `steps` calls of step() after an untimed one."""
    import torch
    step()
    if cuda:
        before = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    else:
        before = rss_mb("VmRSS:")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak (VmHWM) to the current RSS
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else rss_mb("VmHWM:")
    return f"{peak - before:.1f} {statistics.median(times):.4f}"


def in_own_process(script: str, *case: str) -> tuple[float, float]:
    """(peak MB, step s) of `script --case ...` run with the bench's own arguments, in a fresh process."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, script, *sys.argv[1:], "--case", *case], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    return float(out[0]), float(out[1])

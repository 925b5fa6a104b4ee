"""Context parallelism, both modes: the memory per rank of one long row split over cp_size ranks, its
speed, and how evenly the ranks work.

    python bench/context.py [--block_size 4096] [--steps 6]

One row of block_size tokens a step on cp_size = 1, 2 and 4 ranks in each cp_mode (the world is the
context group: no data parallelism), a small GPT (4 layers, 128 wide, 4 heads, byte tokens, fp32).
Activations: each rank's peak RSS minus that of the same launch at block_size 64 (the weights and
optimizer state are the same in both); goal about 1/cp_size of cp_size 1's. Speed: tokens/s per
rank, the median of the log lines after the first two (on a 2-core machine, 4 ranks share 2 cores:
per-rank speed falls with cp_size for want of cores, not of work). Balance: the busiest rank's own
compute time per step over the idlest's (StepTimes: the main thread's CPU time, not its waits), the
median over the logged steps; under a ring with contiguous slices instead of zigzag chunks the rank
holding the row's end would do 2 x cp_size - 1 times the attention of the first.
"""
import argparse
import os
import re
import statistics
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from fsdp_gpt.observe.figures_file import read_figures  # noqa: E402

DEMO = os.path.join(ROOT, "config", "demo_cpu.yaml")
MODEL = ["--n_layer=4", "--n_head=4", "--n_embd=128", "--dtype=fp32", "--sample_tokens=0", "--eval_iters=1",
         "--eval_interval=1000", "--save_interval=1000", "--checkpoint_type=sharded"]


def launch(nproc: int, args: list[str], workdir: str) -> str:
    for folder in ("ckpt_ctx", "tb_ctx"):  # each launch's own checkpoints and TensorBoard events
        shutil.rmtree(os.path.join(workdir, folder), ignore_errors=True)
    cmd = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                               f"--nproc_per_node={nproc}"]
    # glibc hands freed blocks back to the OS only above this size: else peak RSS counts memory given back
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(max(1, os.cpu_count() // nproc)))
    cmd += [os.path.join(ROOT, "train_fsdp.py"), DEMO] + MODEL + args + [
        f"--data_path={os.path.join(ROOT, 'data', 'stdlib_bytes')}", "--checkpoint_dir=ckpt_ctx", "--tensorboard_dir=tb_ctx"]
    result = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{result.stderr[-2000:]}")
    return result.stdout


def peak_per_rank(out: str) -> float:
    """The largest rank's peak GB over the run (the trainer's last memory line)."""
    return max(map(float, re.search(r"memory per rank, GB: peak ([\d. ]+) \|", out).group(1).split()))


def busiest_over_idlest(tb: str) -> float:
    """The ranks' compute time per step, busiest over idlest: the median over the logged steps."""
    busiest, idlest = (read_figures(tb, f"time/compute_ms/{end}") for end in ("max", "min"))
    return statistics.median(busiest[s] / idlest[s] for s in busiest)


def table(block_size: int, steps: int, workdir: str) -> None:
    print(f"one row of {block_size} tokens a step; activations: a rank's peak RSS above the same launch at "
          f"block_size 64, GB")
    print("| cp_mode | cp_size | tokens per rank | activations per rank, GB | of cp_size 1's | tok/s per rank | "
          "compute, busiest rank over idlest |\n| --- | --- | --- | --- | --- | --- | --- |")
    for mode in ("ulysses", "ring"):
        first = None
        for cp in (1, 2, 4):
            args = ["--train_batch=1", "--micro_batch=1", f"--cp_size={cp}", f"--cp_mode={mode}"]
            small = peak_per_rank(launch(cp, args + ["--block_size=64", "--max_iters=2"], workdir))
            out = launch(cp, args + [f"--block_size={block_size}", f"--max_iters={steps}", "--log_interval=1"], workdir)
            rows = peak_per_rank(out) - small
            first = first or rows
            rates = list(read_figures(os.path.join(workdir, "tb_ctx"), "perf/tokens_per_sec").values())[2:]  # after warm-up
            balance = busiest_over_idlest(os.path.join(workdir, "tb_ctx"))
            print(f"| {mode} | {cp} | {block_size // cp} | {rows:.3f} | {rows / first:.2f} | "
                  f"{statistics.median(rates) / cp:,.0f} | {balance:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block_size", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    workdir = os.path.join(ROOT, "bench", "runs")
    os.makedirs(workdir, exist_ok=True)
    print(f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores")
    table(args.block_size, args.steps, workdir)


if __name__ == "__main__":
    main()

"""Context parallelism: the memory per rank of one long row split over cp_size ranks, and its speed.

    python bench/context.py [--block_size 4096] [--steps 6]

memory: one row of block_size tokens a step on cp_size = 1, 2 and 4 ranks (the world is the
context group: no data parallelism), a small GPT (4 layers, 128 wide, byte tokens, fp32). Each
rank's peak RSS minus that of the same launch at block_size 64: what the row's activations cost a
rank (the weights and optimizer state are the same in both). Goal: about 1/cp_size of cp_size 1's.

speed: tokens/s per rank with 2 ranks at equal tokens per rank, block_size tokens each: cp_size 1
(2 rows, one per rank) against cp_size 2 (one row of twice the length, half on each rank). The
second also pays for attention over a row twice as long (its quadratic part) and the all-to-alls.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from fsdp_gpt.model import GPT, GPTConfig  # noqa: E402

DEMO = os.path.join(ROOT, "config", "demo_cpu.yaml")
MODEL = ["--n_layer=4", "--n_head=4", "--n_embd=128", "--dtype=fp32", "--sample_tokens=0", "--eval_iters=1",
         "--eval_interval=1000", "--save_interval=1000", "--checkpoint_type=sharded"]


def launch(nproc: int, args: list[str], workdir: str) -> str:
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


def memory(block_size: int, workdir: str) -> None:
    print(f"one row of {block_size} tokens a step; a rank's peak RSS above the same launch at block_size 64, GB")
    print("| cp_size | ranks | tokens per rank | activations per rank, GB | of cp_size 1's |\n| --- | --- | --- | --- | --- |")
    first = None
    for cp in (1, 2, 4):
        runs = {T: peak_per_rank(launch(cp, [f"--block_size={T}", "--train_batch=1", "--micro_batch=1",
                                             "--max_iters=2", f"--cp_size={cp}"], workdir)) for T in (64, block_size)}
        rows = runs[block_size] - runs[64]
        first = first or rows
        print(f"| {cp} | {cp} | {block_size // cp} | {rows:.3f} | {rows / first:.2f} |", flush=True)


def rate(args: list[str], steps: int, workdir: str) -> float:
    out = launch(2, args + [f"--max_iters={steps}", "--log_interval=1"], workdir)
    rates = [float(r.replace(",", "")) for r in re.findall(r"\| ([\d,]+) tok/s", out)][2:]  # after warm-up
    return statistics.median(rates) / 2  # per rank


def flops_per_token(block_size: int) -> int:
    """The trainer's count (model.GPT.flops_per_token) for MODEL at this row length."""
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=256, n_layer=4, n_head=4, n_embd=128, block_size=block_size)).flops_per_token()


def speed(block_size: int, steps: int, workdir: str) -> None:
    cp1 = rate([f"--block_size={block_size}", "--train_batch=2", "--micro_batch=1"], steps, workdir)
    cp2 = rate([f"--block_size={2 * block_size}", "--train_batch=1", "--micro_batch=1", "--cp_size=2"], steps, workdir)
    work = flops_per_token(2 * block_size) / flops_per_token(block_size)
    print(f"2 ranks, {block_size} tokens per rank a step: cp_size 1 (rows of {block_size}) {cp1:,.0f} tok/s per rank, "
          f"cp_size 2 (rows of {2 * block_size}) {cp2:,.0f} tok/s per rank: {cp2 / cp1:.2f}x; a token of the longer "
          f"row costs {work:.2f}x the FLOPs (attention), so FLOP/s per rank: {cp2 * work / cp1:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block_size", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    workdir = os.path.join(ROOT, "bench", "runs")
    os.makedirs(workdir, exist_ok=True)
    print(f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores")
    memory(args.block_size, workdir)
    speed(args.block_size, args.steps, workdir)


if __name__ == "__main__":
    main()

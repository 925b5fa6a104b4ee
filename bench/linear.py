"""Linear layers (Gated DeltaNet) against full attention of the same width: tokens/s and activation
memory of one row a step at rows of 1k to 32k tokens, and a rank's activation memory with the row
split over context-parallel ranks.

    python bench/linear.py rows [--rows 1024 2048 4096 8192 16384 32768] [--mixers linear full]
    python bench/linear.py context [--block_size 16384] [--cp 1 2 4] [--modes ulysses ring]

A small model (2 layers 128 wide, 4 heads; its linear layers 4 key and value heads of 32, chunks of
64; byte tokens, fp32), trained on one row of block_size tokens a step. Activations: the peak RSS of
the launch's largest rank minus that of the same launch at block_size 64 (the weights, optimizer
state, libraries alike in both), as bench/context.py measures them. Tokens/s: the median of the log
lines after the first (warm-up). `rows` runs every layer linear, then every layer full; `context` a
model of a linear layer then a full one (attn_pattern [linear, full]) at each cp_size, in each
cp_mode, and prints each rank's activations over cp_size 1's. Each row of a table is one launch pair:
the commands can run a few rows at a time (the figures do not depend on which ran together).
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from fsdp_gpt.observe.figures_file import read_figures  # noqa: E402

DEMO = os.path.join(ROOT, "config", "demo_cpu.yaml")
MODEL = ["--arch=llama", "--n_layer=2", "--n_head=4", "--n_embd=128", "--dtype=fp32",
         "--sample_tokens=0", "--eval_iters=1", "--eval_interval=1000", "--save_interval=1000",
         "--train_batch=1", "--micro_batch=1", "--log_interval=1", "--warmup_iters=1"]
PATTERNS = {"linear": "[linear]", "full": "[full]", "hybrid": "[linear,full]"}


def launch(nproc: int, args: list[str], workdir: str) -> tuple[str, str]:
    """(stdout, TensorBoard folder) of one training launch."""
    for folder in ("ckpt_linear", "tb_linear"):
        shutil.rmtree(os.path.join(workdir, folder), ignore_errors=True)
    cmd = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                               f"--nproc_per_node={nproc}"]
    # glibc hands freed blocks back to the OS only above this size: else peak RSS counts memory given back
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    cmd += [os.path.join(ROOT, "train_fsdp.py"), DEMO] + MODEL + args + [
        f"--data_path={os.path.join(ROOT, 'data', 'stdlib_bytes')}", "--checkpoint_dir=ckpt_linear",
        "--tensorboard_dir=tb_linear"]
    result = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=3600)
    if result.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{result.stderr[-2000:]}")
    return result.stdout, os.path.join(workdir, "tb_linear")


def peak_per_rank(out: str) -> float:
    """The largest rank's peak GB over the run (the trainer's last memory line)."""
    return max(map(float, re.search(r"memory per rank, GB: peak ([\d. ]+) \|", out).group(1).split()))


def measured(nproc: int, args: list[str], block_size: int, steps: int, workdir: str) -> tuple[float, float]:
    """(activations GB of the largest rank, tokens/s of the whole group) of a launch at block_size."""
    small = peak_per_rank(launch(nproc, args + ["--block_size=64", "--max_iters=2"], workdir)[0])
    out, tb = launch(nproc, args + [f"--block_size={block_size}", f"--max_iters={steps}"], workdir)
    rates = list(read_figures(tb, "perf/tokens_per_sec").values())[1:]  # after warm-up
    return peak_per_rank(out) - small, statistics.median(rates)


def rows_table(rows: list[int], mixers: list[str], steps: int, workdir: str) -> None:
    print("| layers | row, tokens | tok/s | activations, GB | of the row half as long's |\n| --- | --- | --- | --- | --- |")
    for mixer in mixers:
        previous = {}
        for T in rows:
            memory, rate = measured(1, [f"--attn_pattern={PATTERNS[mixer]}"], T, steps, workdir)
            ratio = f"{memory / previous[T // 2]:.2f}" if T // 2 in previous else ""
            previous[T] = memory
            print(f"| {mixer} | {T:,} | {rate:,.0f} | {memory:.3f} | {ratio} |", flush=True)


def context_table(block_size: int, cps: list[int], modes: list[str], steps: int, workdir: str) -> None:
    print(f"attn_pattern [linear, full], one row of {block_size:,} tokens a step\n"
          "| cp_mode | cp_size | tokens per rank | activations per rank, GB | of cp_size 1's | tok/s (all ranks) |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for mode in modes:
        first = None
        for cp in cps:
            memory, rate = measured(cp, [f"--attn_pattern={PATTERNS['hybrid']}", f"--cp_size={cp}",
                                         f"--cp_mode={mode}"], block_size, steps, workdir)
            first = first or memory
            print(f"| {mode} | {cp} | {block_size // cp:,} | {memory:.3f} | {memory / first:.2f} | {rate:,.0f} |",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", choices=("rows", "context"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--mixers", nargs="+", choices=("linear", "full"), default=["linear", "full"])
    parser.add_argument("--block_size", type=int, default=16384)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", choices=("ulysses", "ring"), default=["ulysses", "ring"])
    parser.add_argument("--steps", type=int, default=3)
    # one thread a rank by default: on a machine shared with other work, two threads' barriers stall
    # (a 4k row ran 20x slower at two threads than at one beside two niced processes)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each rank")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    workdir = os.path.join(ROOT, "bench", "runs", f"linear_{args.table}")  # the two tables may run at once
    os.makedirs(workdir, exist_ok=True)
    print(f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, {args.threads} thread(s) a rank")
    if args.table == "rows":
        rows_table(args.rows, args.mixers, args.steps, workdir)
    else:
        context_table(args.block_size, args.cp, args.modes, args.steps, workdir)


if __name__ == "__main__":
    main()

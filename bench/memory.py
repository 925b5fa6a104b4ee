"""Memory per rank: the largest rank's peak for 1, 2 and 4 ranks under each strategy, with and
without activation checkpointing and CPU offload, as a markdown table.

    python bench/memory.py [--n_layer=8 --n_embd=512 ...]   # any trainer override

Peak = the trainer's own report (peak RSS on CPU, max allocated on GPU) over the whole run
(start-up, steps, eval, sharded checkpoint), minus the same run of a tiny model: what the
model costs, not the interpreter and libraries. State = parameters, gradients and optimizer
state held by the largest rank.
"""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "config", "demo_cpu.yaml")
MODEL = ["--n_layer=8", "--n_head=8", "--n_embd=512"]  # 25.2M parameters with byte tokens
TINY = ["--n_layer=2", "--n_head=2", "--n_embd=64"]
COMMON = ["--block_size=256", "--train_batch=8", "--micro_batch=2", "--max_iters=2", "--eval_iters=1",
          "--dtype=fp32", "--checkpoint_type=sharded", "--log_interval=1", "--sample_tokens=0"]
ROWS = {
    "FULL_SHARD": ["--sharding_strategy=FULL_SHARD"],
    "SHARD_GRAD_OP": ["--sharding_strategy=SHARD_GRAD_OP"],
    "NO_SHARD": ["--sharding_strategy=NO_SHARD"],
    "HYBRID_SHARD (fsdp_size 2)": ["--sharding_strategy=HYBRID_SHARD"],
    "HYBRID_SHARD_ZERO2 (fsdp_size 2)": ["--sharding_strategy=HYBRID_SHARD_ZERO2"],
    "FULL_SHARD + activation checkpointing": ["--sharding_strategy=FULL_SHARD", "--activation_checkpointing=true"],
    "FULL_SHARD + cpu_offload": ["--sharding_strategy=FULL_SHARD", "--cpu_offload=true"],
}


def largest_rank(nproc: int, args: list[str], workdir: str) -> tuple[float, float]:
    """(peak GB, state GB) of the largest rank, from the trainer's last line about memory."""
    launch = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    # glibc hands freed blocks back to the OS only above this size: else peak RSS counts memory given back
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = launch + [os.path.join(ROOT, "train_fsdp.py"), DEMO] + COMMON + args + [
        f"--fsdp_size={min(2, nproc)}", f"--data_path={os.path.join(ROOT, 'data', 'stdlib_bytes')}",
        "--checkpoint_dir=ckpt", "--tensorboard_dir=tb"]
    result = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=1200)
    if result.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{result.stderr[-2000:]}")
    peaks, states = re.search(r"memory per rank, GB: peak ([\d. ]+) \| parameters \+ optimizer state "
                              r"([\d. ]+)", result.stdout).groups()
    return max(map(float, peaks.split())), max(map(float, states.split()))


def main(overrides: list[str]) -> None:
    workdir = os.path.join(ROOT, "bench", "runs")
    os.makedirs(workdir, exist_ok=True)
    sizes = (1, 2, 4)
    baseline = {n: largest_rank(n, TINY + ["--sharding_strategy=FULL_SHARD"], workdir)[0] for n in sizes}
    print("largest rank's peak above a tiny model's, GB (state: parameters + optimizer state)")
    print("| strategy | " + " | ".join(f"{n} rank{'s' * (n > 1)}" for n in sizes) + " |")
    print("| --- |" + " --- |" * len(sizes))
    for row, args in ROWS.items():
        cells = []
        for n in sizes:
            peak, state = largest_rank(n, MODEL + args + overrides, workdir)
            cells.append(f"{peak - baseline[n]:.3f} (state {state:.3f})")
        print(f"| {row} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    sys.exit(print(__doc__) if {"-h", "--help"} & set(sys.argv) else main(sys.argv[1:]))

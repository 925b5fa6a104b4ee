"""What seeing inside a run costs a step: per-rank timing, loss-spike detection (with the loss's
all_reduce every step it needs), and profiling outside its window, each against the demo's step
time at 2 ranks, measured in the same run.

    python bench/observe_cost.py [--steps 2000]

The demo (config/demo_cpu.yaml, 2 ranks, 60 steps) gives the step time; then 2 ranks repeat each
piece of per-step work `steps` times, as the loop does it (the spike test on the reduced loss,
StepTimes around one micro-batch, Profiling's checks with a window elsewhere), and report the mean
cost per step. A log step's work (the gather, the host reads) happens once per log_interval steps
and is not included: it was there before (memory) and its one collective gained 3 numbers.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from fsdp_gpt.observe.figures_file import read_figures  # noqa: E402
from fsdp_gpt.observe.profiling import Profiling  # noqa: E402
from fsdp_gpt.observe.spikes import SpikeDetector  # noqa: E402
from fsdp_gpt.observe.step_times import StepTimes  # noqa: E402

DEMO = os.path.join(ROOT, "config", "demo_cpu.yaml")


def torchrun(args: list[str], workdir: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] + args
    result = subprocess.run(cmd, cwd=workdir, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                            text=True, timeout=1200)
    if result.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{result.stderr[-2000:]}")
    return result.stdout


def demo_step_seconds(workdir: str) -> float:
    torchrun([os.path.join(ROOT, "train_fsdp.py"), DEMO, "--max_iters=60", "--log_interval=10",
                    "--eval_interval=1000", "--save_interval=1000", "--sample_tokens=0", "--checkpoint_dir=ckpt_oc",
                    "--tensorboard_dir=tb_oc"], workdir)
    rates = list(read_figures(os.path.join(workdir, "tb_oc"), "perf/tokens_per_sec").values())[1:]
    return 32 * 128 / statistics.median(rates)  # the demo's train_batch x block_size tokens a step


def per_step(fn, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for step in range(1, steps + 1):
        fn(step)
    return (time.perf_counter() - start) / steps


def pieces(steps: int) -> None:
    """Under torchrun: each piece's seconds per step, printed by rank 0."""
    dist.init_process_group("gloo")
    device = torch.device("cpu")
    spikes, times = SpikeDetector(device, 6.0, 100), StepTimes(device)
    profiling = Profiling(SimpleNamespace(profile_steps=[10 ** 9, 10 ** 9], memory_snapshot_steps=None,
                                          tensorboard_dir="tb_oc"), dist.get_rank(), device, print)
    batch = [(torch.zeros(1), torch.zeros(1))]

    def spike_test(step):
        loss = torch.full((), 3.0 + 0.01 * (step % 7))
        dist.all_reduce(loss)
        spikes.check(step, loss / 2)
        if step % 10 == 0:
            spikes.since_last_log()

    def timing(step):
        times.begin()
        for _ in times.batches(batch):
            pass
        times.end()
        if step % 10 == 0:
            times.row()

    def profiling_outside(step):
        profiling.begin(step)
        profiling.end(step)

    costs = {name: per_step(fn, steps) for name, fn in [("per-rank timing", timing), ("spike test + loss all_reduce",
             spike_test), ("profiling outside its window", profiling_outside)]}
    if dist.get_rank() == 0:
        for name, seconds in costs.items():
            print(f"{name}={seconds}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--_pieces", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._pieces:
        return pieces(args.steps)
    workdir = os.path.join(ROOT, "bench", "runs")
    os.makedirs(workdir, exist_ok=True)
    step = demo_step_seconds(workdir)
    out = torchrun([os.path.abspath(__file__), "--_pieces", f"--steps={args.steps}"], workdir)
    print(f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {os.cpu_count()} CPU cores: the demo at 2 ranks "
          f"takes {1e3 * step:.1f} ms a step")
    print("| per step | cost | of the demo's step |\n| --- | --- | --- |")
    for line in out.strip().splitlines():
        name, seconds = line.rsplit("=", 1)
        print(f"| {name} | {1e6 * float(seconds):.0f} us | {float(seconds) / step:.2%} |")


if __name__ == "__main__":
    main()

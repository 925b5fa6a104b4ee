"""Val loss of runs that differ in one config key, at equal steps (same data, batch, schedule, seed).

    python bench/compare_runs.py config/demo_cpu.yaml --optimizer=adamw,muon [--key=value ...] [--nproc N]

The comma-separated key is the one varied; every other --key=value applies to all runs. Prints
each run's val/loss at every eval step, its final value, and the first eval step at which each
run reaches the first run's final val loss. Runs one after another, in bench/runs/compare/.
"""
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from config import UserError, exit_code  # noqa: E402
from conftest import scalars  # noqa: E402


def parse(argv: list[str]) -> tuple[str, str, list[str], list[str], int]:
    """(config, varied key, its values, the other overrides, ranks)"""
    usage = "usage: python bench/compare_runs.py CONFIG --key=A,B [--key=value ...] [--nproc N]"
    if not argv or argv[0].startswith("--"):
        raise UserError(usage)
    config, varied, others, nproc = argv[0], None, [], 1
    for arg in argv[1:]:
        key, _, value = arg[2:].partition("=")
        if key == "nproc":
            nproc = int(value)
        elif "," in value and varied is None:
            varied = (key, value.split(","))
        else:
            others.append(arg)
    if varied is None:
        raise UserError(f"no key to vary: give one as --key=A,B. {usage}")
    return config, varied[0], varied[1], others, nproc


def train(config: str, overrides: list[str], nproc: int, run_dir: str) -> dict[int, float]:
    launch = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = launch + [os.path.join(ROOT, "train_fsdp.py"), os.path.abspath(config)] + overrides + [
        f"--tensorboard_dir={run_dir}/tb", f"--checkpoint_dir={run_dir}/ckpt", "--save_interval=1000000000"]
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if result.returncode:
        raise UserError(f"run failed: {' '.join(cmd)}\n{result.stderr[-2000:]}")
    print(f"  {' '.join(overrides[:1])}: {time.perf_counter() - start:.0f} s", flush=True)
    return scalars(os.path.join(run_dir, "tb"), "val/loss")


def first_step_reaching(losses: dict[int, float], target: float) -> str:
    return next((str(step) for step in sorted(losses) if losses[step] <= target), "not reached")


def main(argv: list[str]) -> None:
    config, key, values, others, nproc = parse(argv)
    print(f"{time.strftime('%Y-%m-%d')}: {config} {' '.join(others)}, {nproc} rank(s), {key} in {values}", flush=True)
    runs = {}
    for value in values:
        run_dir = os.path.join(ROOT, "bench", "runs", "compare", f"{key}={value}")
        subprocess.run(["rm", "-rf", run_dir], check=True)  # a fresh log: no events of an older run
        runs[value] = train(config, [f"--{key}={value}"] + others, nproc, run_dir)
    print(f"| step | " + " | ".join(f"{key}={v}" for v in values) + " |")
    print("| --- |" + " --- |" * len(values))
    for step in sorted(runs[values[0]]):
        print(f"| {step} | " + " | ".join(f"{runs[v].get(step, float('nan')):.4f}" for v in values) + " |")
    target = runs[values[0]][max(runs[values[0]])]
    for value in values:
        print(f"{key}={value}: final val loss {runs[value][max(runs[value])]:.4f}, first eval step at or below "
              f"{target:.4f} ({key}={values[0]}'s final): {first_step_reaching(runs[value], target)}")


if __name__ == "__main__":
    sys.exit(exit_code(lambda: main(sys.argv[1:])))

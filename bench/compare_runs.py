"""Val loss of runs that differ in some config keys, at equal steps (same data, batch, schedule, seed).

    python bench/compare_runs.py config/demo_cpu.yaml --optimizer=adamw,muon [--key=value ...] [--nproc N]
    python bench/compare_runs.py config/demo_cpu.yaml --arch=gpt2,llama --ffn_hidden=512,344

Keys given comma-separated values vary together (run i takes the i-th value of each); every
other --key=value applies to all runs. Prints each run's parameter count, its val/loss at every
eval step, and the first eval step at which each run reaches the first run's final val loss (and a
mixture of experts' busiest expert at the last step, the worst layer's, over the mean load).
Runs one after another, in bench/runs/compare/.
"""
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from fsdp_gpt.config import UserError, exit_code  # noqa: E402
from fsdp_gpt.observe.metrics import read_scalars  # noqa: E402


def parse(argv: list[str]) -> tuple[str, list[list[str]], list[str], int]:
    """(config, each run's own overrides, the shared overrides, ranks)"""
    usage = "usage: python bench/compare_runs.py CONFIG --key=A,B [--key=value ...] [--nproc N]"
    if not argv or argv[0].startswith("--"):
        raise UserError(usage)
    config, varied, shared, nproc = argv[0], {}, [], 1
    for arg in argv[1:]:
        key, _, value = arg[2:].partition("=")
        if key == "nproc":
            nproc = int(value)
        elif "," in value:
            varied[key] = value.split(",")
        else:
            shared.append(arg)
    if not varied:
        raise UserError(f"no key to vary: give one as --key=A,B. {usage}")
    counts = {len(values) for values in varied.values()}
    if len(counts) > 1:
        raise UserError(f"the varied keys need as many values each: {varied}")
    runs = [[f"--{key}={values[i]}" for key, values in varied.items()] for i in range(counts.pop())]
    return config, runs, shared, nproc


def train(config: str, overrides: list[str], nproc: int, run_dir: str) -> tuple[dict[int, float], str, str]:
    """(val/loss by step, the parameter count the trainer printed, the last busiest expert's load or "")"""
    launch = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = launch + [os.path.join(ROOT, "train_fsdp.py"), os.path.abspath(config)] + overrides + [
        f"--tensorboard_dir={run_dir}/tb", f"--checkpoint_dir={run_dir}/ckpt", "--save_interval=1000000000"]
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if result.returncode:
        raise UserError(f"run failed: {' '.join(cmd)}\n{result.stderr[-2000:]}")
    print(f"  {' '.join(overrides)}: {time.perf_counter() - start:.0f} s", flush=True)
    params = re.search(r"^parameters: ([\d,]+)(?:.*, ([\d,]+) active)?", result.stdout, re.MULTILINE)
    busiest = read_scalars(os.path.join(run_dir, "tb"), "moe/busiest")
    load = f", busiest expert {busiest[max(busiest)]:.2f}x the mean at step {max(busiest)}" if busiest else ""
    count = params.group(1) + (f", {params.group(2)} active" if params.group(2) else "")
    return read_scalars(os.path.join(run_dir, "tb"), "val/loss"), count, load


def first_step_reaching(losses: dict[int, float], target: float) -> str:
    return next((str(step) for step in sorted(losses) if losses[step] <= target), "not reached")


def main(argv: list[str]) -> None:
    config, variants, shared, nproc = parse(argv)
    names = [" ".join(v).replace("--", "") for v in variants]
    print(f"{time.strftime('%Y-%m-%d')}: {config} {' '.join(shared)}, {nproc} rank(s)", flush=True)
    runs, params, loads = {}, {}, {}
    for name, overrides in zip(names, variants):
        run_dir = os.path.join(ROOT, "bench", "runs", "compare", name.replace(" ", "_"))
        subprocess.run(["rm", "-rf", run_dir], check=True)  # a fresh log: no events of an older run
        runs[name], params[name], loads[name] = train(config, overrides + shared, nproc, run_dir)
    print("| step | " + " | ".join(f"{name} ({params[name]} parameters)" for name in names) + " |")
    print("| --- |" + " --- |" * len(names))
    for step in sorted(runs[names[0]]):
        print(f"| {step} | " + " | ".join(f"{runs[n].get(step, float('nan')):.4f}" for n in names) + " |")
    target = runs[names[0]][max(runs[names[0]])]
    for name in names:
        print(f"{name}: final val loss {runs[name][max(runs[name])]:.4f}, first eval step at or below "
              f"{target:.4f} ({names[0]}'s final): {first_step_reaching(runs[name], target)}{loads[name]}")


if __name__ == "__main__":
    sys.exit(exit_code(lambda: main(sys.argv[1:])))

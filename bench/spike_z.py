"""How far a normal run's loss strays, and how far a real spike stands out: every step's z against
the steps before it, under the detector's rule (spikes.z_score: the median of the last 10 losses,
the spread of the step-to-step changes) and under the rule it replaced (the mean and standard
deviation of the window), for the demo's 200 steps on two seeds and for a 90-step demo run whose
step 80 is a batch of random tokens (what a new user's run showed: a 2.8x jump the old rule missed).

    python bench/spike_z.py [--seeds 1337 1338] [--window 100]

Prints, per run and rule, the largest z of the normal steps, how many pass 3, 4, 5 and 6, and the
injected step's z: the margin spike_zscore's default (6) keeps on both sides.
"""
import argparse
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from fsdp_gpt.observe.metrics import read_scalars  # noqa: E402
from fsdp_gpt.observe.spikes import z_score  # noqa: E402

SPIKE_STEP, SPIKE_RUN_STEPS = 80, 90


def mean_std_z(history: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """The rule before round five: against the mean and standard deviation of the whole window."""
    std, mean = torch.std_mean(history)
    return (loss - mean) / std


RULES = {"median level, spread of changes (now)": z_score, "mean and std of the window (before)": mean_std_z}


def losses_of(seed: int, window: int, steps: int | None = None, spike_step: int = 0) -> list[float]:
    """train/loss at every step of a demo run (random tokens at `spike_step`, when given)."""
    script = os.path.join(ROOT, "tests", "observe_probe.py") if spike_step else os.path.join(ROOT, "train_fsdp.py")
    with tempfile.TemporaryDirectory() as run:
        extra = [f"--max_iters={steps}"] if steps else []  # the demo's schedule, stopped early (the user's run)
        subprocess.run([sys.executable, script, os.path.join(ROOT, "config", "demo_cpu.yaml"), f"--seed={seed}",
                        "--log_interval=1", "--sample_tokens=0", f"--checkpoint_dir={run}/ckpt",
                        f"--tensorboard_dir={run}/tb", f"--spike_window={window}", *extra],
                       cwd=ROOT, check=True, capture_output=True, env=dict(os.environ, SPIKE_STEP=str(spike_step)))
        loss = read_scalars(f"{run}/tb", "train/loss")
    return [loss[step] for step in sorted(loss)]


def z_scores(losses: list[float], window: int, rule) -> dict[int, float]:
    """{step: z} from half a window on, each step against the window before it (as SpikeDetector judges)."""
    return {i + 1: float(rule(torch.tensor(losses[max(0, i - window):i]), torch.tensor(losses[i])))
            for i in range(max(window // 2, 3), len(losses))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338])
    parser.add_argument("--window", type=int, default=100)
    args = parser.parse_args()
    runs = {f"demo, seed {seed}": (losses_of(seed, args.window), None) for seed in args.seeds}
    runs[f"random tokens at step {SPIKE_STEP}"] = (
        losses_of(args.seeds[0], args.window, SPIKE_RUN_STEPS, SPIKE_STEP), SPIKE_STEP)
    print("| run | rule | steps judged | largest normal z | normal steps with z > 3 / 4 / 5 / 6 | injected step's z |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for run, (losses, spike) in runs.items():
        for rule_name, rule in RULES.items():
            zs = z_scores(losses, args.window, rule)
            normal = [z for step, z in zs.items() if spike is None or step < spike]  # after it: the run recovering
            counts = " / ".join(str(sum(z > bound for z in normal)) for bound in (3, 4, 5, 6))
            injected = f"{zs[spike]:.1f} (loss {losses[spike - 2]:.2f} -> {losses[spike - 1]:.2f})" if spike else ""
            print(f"| {run} | {rule_name} | {len(zs)} | {max(normal):.2f} | {counts} | {injected} |", flush=True)


if __name__ == "__main__":
    main()

"""How far a normal run's loss strays: the z-score of every step's loss against the previous
spike_window steps (what spikes.py tests), over the demo's steps, for two seeds.

    python bench/spike_z.py [--seeds 1337 1338] [--window 100]

Prints the largest z of each run and how many steps pass 3, 4, 5 and 6: the margin spike_zscore's
default keeps over a run that has no spike.
"""
import argparse
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from metrics import read_scalars  # noqa: E402


def z_scores(losses: list[float], window: int) -> list[float]:
    """Each step's z against the window before it, from half a window on (spikes.SpikeDetector's rule)."""
    zs = []
    for i in range(window // 2, len(losses)):
        std, mean = torch.std_mean(torch.tensor(losses[max(0, i - window):i]))
        zs.append(float((losses[i] - mean) / std))
    return zs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338])
    parser.add_argument("--window", type=int, default=100)
    args = parser.parse_args()
    print("| seed | steps judged | largest z | steps with z > 3 / 4 / 5 / 6 |\n| --- | --- | --- | --- |")
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as run:
            subprocess.run([sys.executable, os.path.join(ROOT, "train_fsdp.py"), os.path.join(ROOT, "config", "demo_cpu.yaml"),
                            f"--seed={seed}", "--log_interval=1", "--sample_tokens=0", f"--checkpoint_dir={run}/ckpt",
                            f"--tensorboard_dir={run}/tb", f"--spike_window={args.window}"],
                           cwd=ROOT, check=True, capture_output=True)
            loss = read_scalars(f"{run}/tb", "train/loss")
        zs = z_scores([loss[step] for step in sorted(loss)], args.window)
        counts = " / ".join(str(sum(z > bound for z in zs)) for bound in (3, 4, 5, 6))
        print(f"| {seed} | {len(zs)} | {max(zs):.2f} | {counts} |", flush=True)


if __name__ == "__main__":
    main()

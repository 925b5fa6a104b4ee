"""One markdown table from trainer logs (bench/gpu_check.sh writes them): a row per run.

    python bench/gpu_table.py LOG [LOG ...]

tok/s and MFU: the median over the log lines after the first (the first interval holds start-up
and compilation); peak memory: the largest rank's, over the run (the closing "memory per rank"
line: allocated on GPUs, resident on CPU); loss: the train loss at the last step.
"""
import os
import re
import statistics
import sys

LINE = re.compile(r"^step (\d+)/\d+ \| loss ([\d.]+) \| lr \S+ \| ([\d,]+) tok/s \| MFU ([\d.]+%|n/a) \|", re.M)
PEAK = re.compile(r"^memory per rank, GB: peak ([\d. ]+) \|", re.M)


def row(path: str) -> str:
    with open(path) as f:
        text = f.read()
    lines = LINE.findall(text)
    if not lines:
        return f"| {os.path.basename(path)[:-4]} | failed: see {path} | | | |"
    timed = lines[1:] or lines
    tokens = statistics.median(float(t.replace(",", "")) for _, _, t, _ in timed)
    mfus = [float(m[:-1]) for _, _, _, m in timed if m != "n/a"]
    mfu = f"{statistics.median(mfus):.1f}%" if mfus else "n/a"
    peak = PEAK.search(text)
    peak = f"{max(float(gb) for gb in peak.group(1).split()):.2f}" if peak else "?"
    step, loss = lines[-1][:2]
    return f"| {os.path.basename(path)[:-4]} | {tokens:,.0f} | {mfu} | {peak} | {loss} (step {step}) |"


def main(paths: list[str]) -> None:
    print("| run | tok/s | MFU | peak memory, GB | train loss, last step |")
    print("| --- | --- | --- | --- | --- |")
    for path in paths:
        print(row(path))


if __name__ == "__main__":
    main(sys.argv[1:])

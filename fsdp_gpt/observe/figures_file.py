"""A run's figures as JSON lines, for programs to read: {tensorboard_dir}/metrics.jsonl.

One record a log step ("kind": "train") and one an eval ("kind": "val"), each a JSON object on its
own line: "step", "time" (seconds since the epoch, when rank 0 wrote it), "kind", then every figure
TensorBoard gets at that step, by its TensorBoard name ("train/loss", "perf/tokens_per_sec", ...);
a non-finite value is null. The console line is for people and may change; tests and benches read
this file (docs/logging.md).

A resumed run keeps the records up to the step it resumed from and appends after them: what an
abandoned stretch of the run wrote past that step goes, as TensorBoard's purge_step hides it, so
each step is in the file once, with the resumed run's values. A fresh run starts the file anew, an
earlier run's moved to metrics.jsonl.earlier (as TensorBoard's view of it is hidden: metrics.py).
"""
import json
import math
import os
import time

FILE = "metrics.jsonl"
EARLIER = FILE + ".earlier"  # where a fresh run moves an earlier run's file


def figures_path(tb_dir: str) -> str:
    return os.path.join(tb_dir, FILE)


def _number(value):
    """A figure as JSON takes it: ints stay ints, everything else a float, non-finite null."""
    if isinstance(value, (bool, int)):
        return int(value)
    value = float(value)
    return value if math.isfinite(value) else None


def _line(record: dict) -> str:
    return json.dumps(record, allow_nan=False) + "\n"


class FiguresFile:
    """Rank 0's writer: a line a record, flushed as written (a killed run keeps its lines)."""

    def __init__(self, tb_dir: str, resumed_at: int = 0):
        self.path = figures_path(tb_dir)
        if not resumed_at and os.path.isfile(self.path):
            os.replace(self.path, os.path.join(tb_dir, EARLIER))
        kept = [r for r in read_records(tb_dir) if r["step"] <= resumed_at] if resumed_at else []
        with open(f"{self.path}.tmp", "w") as f:  # also drops a line a killed run cut short
            f.writelines(map(_line, kept))
        os.replace(f"{self.path}.tmp", self.path)
        self.file = open(self.path, "a")

    def write(self, kind: str, step: int, figures: dict) -> None:
        record = {"step": step, "time": round(time.time(), 3), "kind": kind}
        self.file.write(_line(record | {tag: _number(value) for tag, value in figures.items()}))
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_records(tb_dir: str) -> list[dict]:
    """Every record of a run's file in order ([] where there is none)."""
    path = figures_path(tb_dir)
    if not os.path.isfile(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # the last line of a run killed while writing it
                continue
    return records


def read_figures(tb_dir: str, tag: str, kind: str | None = None) -> dict[int, float]:
    """{step: value} of one figure (of one kind of record, or any)."""
    return {r["step"]: r[tag] for r in read_records(tb_dir) if tag in r and kind in (None, r["kind"])}

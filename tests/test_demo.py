"""The README's first command: the CPU demo trains offline on a fresh folder."""
import os
import subprocess
import sys

import pytest

from conftest import DEMO, ROOT, counted_parameters, figures, records, scalars, texts, written_tags
from fsdp_gpt import doc_tables

pytestmark = [pytest.mark.slow, pytest.mark.compat]


def test_demo_trains_and_val_loss_falls(tmp_path):
    # nothing cached to lean on; one thread: the suite's other worker holds the other core, and two
    # threads each on one core double the demo's time
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(tmp_path / "no-cache"), OMP_NUM_THREADS="1")
    # run where a fresh clone would: relative data, checkpoint and log folders land in tmp_path. The
    # timeout guards against a hang; the demo's speed is measured, not asserted (README: 50 s on one
    # machine, 120 s on another with cores 2.4x slower, where one thread in a loaded suite passed 240 s)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "train_fsdp.py"), DEMO], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "preparing data/stdlib_bytes" in result.stdout  # prepared here, not found ready
    # the byte data's vocabulary, which the trainer takes from it; test_param_counts.py counts the larger configs so
    count = counted_parameters(DEMO, "--vocab_size=256")
    assert f"\nparameters: {count:,} ({count / 1e6:.1f}M)\n" in result.stdout
    tb = str(tmp_path / "tensorboard" / "demo_cpu")
    val = scalars(tb, "val/loss")
    first, last = val[0], val[max(val)]
    assert max(val) == 200
    assert last <= 0.6 * first, (first, last)
    assert os.path.isfile(tmp_path / "checkpoints" / "fsdp_cpt200.pth")
    # a text sample at each eval, in TensorBoard's TEXT tab
    samples = texts(tb, "val/sample")
    assert sorted(samples) == sorted(val)
    assert len(samples[200].strip()) > 20 and samples[200] != samples[0]
    # progress as programs read it (metrics.jsonl beside the TensorBoard events, not the console line):
    # a record per log interval (25 steps), each with an MFU and a finite ETA that shrinks to zero,
    # and a console line for each; the val records are TensorBoard's figures
    progress = {r["step"]: r for r in records(tb) if r["kind"] == "train"}
    assert list(progress) == list(range(25, 201, 25))
    assert all(f"\nstep {step}/200 | " in result.stdout for step in progress)
    assert all(0 < r["perf/mfu"] <= 1 for r in progress.values())
    eta = [r["perf/eta_s"] for r in progress.values()]
    assert eta[0] > eta[len(eta) // 2] > eta[-1] == 0, eta
    assert figures(tb, "val/loss") == pytest.approx(val, rel=1e-6)
    assert not doc_tables.undeclared(written_tags(tb))  # every tag is in docs/logging.md's table
    assert result.stdout.count("note: MFU on the CPU is an estimate") == 1  # said once, at start-up
    assert result.stdout.rstrip().endswith("done: last checkpoint checkpoints/fsdp_cpt200.pth, TensorBoard logs in tensorboard/demo_cpu/")

"""The README's first command: the CPU demo trains offline on a fresh folder within 4 minutes."""
import os
import subprocess
import sys

import pytest

from conftest import DEMO, ROOT, scalars

pytestmark = pytest.mark.slow


def test_demo_trains_and_val_loss_falls(tmp_path):
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(tmp_path / "no-cache"))  # nothing cached to lean on
    # run where a fresh clone would: relative data, checkpoint and log folders land in tmp_path
    result = subprocess.run([sys.executable, os.path.join(ROOT, "train_fsdp.py"), DEMO], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=240)  # the acceptance bound: 4 minutes
    assert result.returncode == 0, result.stderr[-3000:]
    assert "preparing data/stdlib_bytes" in result.stdout  # prepared here, not found ready
    val = scalars(str(tmp_path / "tensorboard" / "demo_cpu"), "val/loss")
    first, last = val[0], val[max(val)]
    assert max(val) == 200
    assert last <= 0.6 * first, (first, last)
    assert os.path.isfile(tmp_path / "checkpoints" / "fsdp_cpt200.pth")

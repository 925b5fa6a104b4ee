"""The 90M and 300M configs hold what their names say, as the trainer prints it at start."""
import os
import re
import subprocess

import pytest

from conftest import ROOT, overrides, trainer_cmd


@pytest.mark.slow
@pytest.mark.parametrize("name, target", [("train90M_fsdp.yaml", 90e6), ("train300M_fsdp.yaml", 300e6)])
def test_printed_parameter_count(name, target, corpus, tmp_path):
    # the gpt2 tokenizer's file can't be fetched offline: borrow the tiny corpus; the vocabulary
    # size, fixed at 50304 in both configs, is what counts
    cmd = trainer_cmd(1) + [os.path.join(ROOT, "config", name)] + overrides(
        tokenizer="bytes", compile=False, checkpoint_dir=str(tmp_path / "ck"), tensorboard_dir=str(tmp_path / "tb"),
        **corpus)
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if m := re.match(r"parameters: ([\d,]+)", line):
                count = int(m.group(1).replace(",", ""))
                break
        else:
            pytest.fail("the trainer never printed its parameter count")
    finally:
        proc.kill()
        proc.wait()
    assert abs(count - target) <= 0.1 * target, count

"""fp16 with gradient scaling under FSDP2: an overflow on one rank skips the step on every rank."""
import json
import os

import pytest

from conftest import ROOT, run_trainer

pytestmark = pytest.mark.slow


def test_overflow_on_one_rank_skips_the_step_everywhere(corpus, tmp_path):
    result = run_trainer(str(tmp_path), nproc=2, script=os.path.join(ROOT, "tests", "fp16_probe.py"), vocab_size=256,
                         **corpus)
    reports = sorted((json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"rank"')),
                     key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1]
    for r in reports:
        overflow, clean = r["steps"]
        assert not overflow["stepped"] and clean["stepped"], r  # skipped with the inf, stepped without
        assert clean["scale"] == overflow["scale"] < 65536.0, r  # the scale backed off once, on both

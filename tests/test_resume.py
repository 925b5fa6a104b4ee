"""A resume at the same world size and strategy reproduces the uninterrupted run bitwise."""
import os

import pytest

from conftest import run_trainer, scalars

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("checkpoint_type, async_save", [("full", False), ("sharded", True)])
def test_resume_is_bitwise(checkpoint_type, async_save, corpus, tmp_path):
    whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
    os.makedirs(whole), os.makedirs(resumed)
    # the checkpoint resumed from is written while training goes on when async_save is set
    run_trainer(whole, nproc=2, save_interval=4, checkpoint_type=checkpoint_type, async_save=async_save, **corpus)
    name = "fsdp_cpt4.pth" if checkpoint_type == "full" else "fsdp_sharded_cpt4_rank1.pth"
    result = run_trainer(resumed, nproc=2, save_interval=4, checkpoint_type=checkpoint_type,
                         resume_from=os.path.join(whole, "ckpt", name), **corpus)
    assert f"resumed from {os.path.join(whole, 'ckpt', name)} at step 4" in result.stdout
    expected = scalars(os.path.join(whole, "tb"), "train/loss")
    got = scalars(os.path.join(resumed, "tb"), "train/loss")
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == expected[step], step  # bitwise, not approximately

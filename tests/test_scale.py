"""Fitting more: memory per rank falls with ranks under FULL_SHARD; activation checkpointing
saves memory; activation checkpointing, CPU offload and compile leave the losses unchanged."""
import os
import re

import pytest

from conftest import RUN, checkpoint_of, run_trainer, scalars

pytestmark = pytest.mark.slow
# glibc returns freed large blocks to the OS only above this size: without it peak RSS
# counts memory the process already gave back (NOTES.md)
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
MODEL_25M = dict(n_layer=8, n_head=8, n_embd=512)  # 25.2M parameters with byte tokens


def largest_peak_gb(run_dir, nproc, corpus, **settings) -> float:
    """The largest rank's peak memory over the whole run (start-up, steps, eval, checkpoint)."""
    run_dir.mkdir()
    result = run_trainer(str(run_dir), nproc=nproc, env=MEMORY_ENV, checkpoint_type="sharded", eval_iters=1,
                         sample_tokens=0, **corpus, **settings)
    peaks = re.search(r"memory per rank, GB: peak ([\d. ]+) \|", result.stdout).group(1).split()
    assert len(peaks) == nproc
    return max(map(float, peaks))


def test_full_shard_memory_per_rank_falls_with_ranks(corpus, tmp_path):
    above_baseline = {}
    for nproc in (1, 2, 4):
        # micro_batch 1 of 64 tokens: activations are small next to parameters and optimizer state. One
        # step: AdamW makes its state in it, so the peak is reached (0.597, 0.301, 0.153 GB above the tiny
        # model at 1, 2, 4 ranks; with a second step 0.597, 0.307, 0.153)
        common = dict(block_size=64, train_batch=4, micro_batch=1, max_iters=1, sharding_strategy="FULL_SHARD")
        tiny = largest_peak_gb(tmp_path / f"tiny{nproc}", nproc, corpus, **common)
        big = largest_peak_gb(tmp_path / f"big{nproc}", nproc, corpus, **common, **MODEL_25M)
        above_baseline[nproc] = big - tiny
    assert above_baseline[1] > 0.3  # 25M fp32 parameters, gradients and AdamW state: ~0.4 GB
    assert above_baseline[2] <= 0.7 * above_baseline[1], above_baseline
    assert above_baseline[4] <= 0.45 * above_baseline[1], above_baseline


def test_activation_checkpointing_lowers_peak_memory_at_long_blocks(corpus, tmp_path):
    # 4 rows of 512 tokens: 0.124 GB of activations without, 0.024 with (at 1,024 tokens 0.241 and 0.018, twice the time)
    common = dict(block_size=512, train_batch=4, micro_batch=4, max_iters=1)
    baseline = largest_peak_gb(tmp_path / "tiny", 1, corpus, **common)  # TINY: 2 layers, 64 wide
    model = dict(n_layer=8, n_head=4, n_embd=128)
    without = largest_peak_gb(tmp_path / "without", 1, corpus, **common, **model) - baseline
    with_ac = largest_peak_gb(tmp_path / "with", 1, corpus, **common, **model, activation_checkpointing=True) - baseline
    assert without > 0.06  # 8 blocks' activations of 4 x 512 tokens: 0.124 GB, above the peaks' ~0.01 GB of noise
    assert with_ac < 0.6 * without, (with_ac, without)


@pytest.mark.parametrize("feature", ["activation_checkpointing", "cpu_offload", "compile"])
def test_feature_leaves_losses_unchanged(feature, two_rank_runs, corpus, tmp_path):
    """Against the 2-rank FULL_SHARD run without it (two_rank_runs: steps 1-6, same settings)."""
    run_trainer(str(tmp_path), nproc=2, timeout=600, **(RUN | dict(max_iters=4, save_interval=1000)),
                **{feature: True}, **corpus)
    got = scalars(str(tmp_path / "tb"), "train/loss")
    expected = scalars(os.path.join(two_rank_runs["full"], "tb"), "train/loss")
    assert sorted(got) == [1, 2, 3, 4]
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-4), (feature, step)
    assert os.path.isfile(checkpoint_of(str(tmp_path), "full", 4))

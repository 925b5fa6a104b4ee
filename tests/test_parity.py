"""Distributed correctness by parity: 4 ranks under each strategy train the same run as one process."""
import os

import pytest

from conftest import run_trainer, scalars

pytestmark = pytest.mark.slow
STEPS = 8


@pytest.fixture(scope="module")
def single_process(corpus, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("ref"))
    result = run_trainer(run_dir, nproc=1, max_iters=STEPS, **corpus)
    assert "gradient accumulation 4" in result.stdout  # one process needs 4 micro-steps
    return {tag: scalars(os.path.join(run_dir, "tb"), tag) for tag in ("train/loss", "val/loss")}


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "DDP"])
def test_four_ranks_match_one_process(strategy, single_process, corpus, tmp_path):
    mode = dict(fsdp=False) if strategy == "DDP" else dict(sharding_strategy=strategy)
    result = run_trainer(str(tmp_path), nproc=4, max_iters=STEPS, fsdp_size=2 if strategy == "HYBRID_SHARD" else None,
                         **mode, **corpus)
    assert "gradient accumulation 1" in result.stdout  # four ranks need none
    for tag, reference in single_process.items():
        losses = scalars(str(tmp_path / "tb"), tag)
        assert sorted(losses) == sorted(reference)
        for step, value in reference.items():
            assert losses[step] == pytest.approx(value, rel=1e-4), (tag, step)
    assert len(single_process["train/loss"]) == STEPS
    # training moved the weights: the parity is not that of a model standing still
    assert single_process["train/loss"][STEPS] < single_process["train/loss"][1]

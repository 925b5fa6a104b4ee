"""Distributed correctness by parity: 4 ranks under each strategy train the same run as one process."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_trainer, scalars

pytestmark = pytest.mark.slow
STEPS = 8


@pytest.fixture(scope="module")
def single_process(corpus, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("ref"))
    result = run_trainer(run_dir, nproc=1, max_iters=STEPS, **corpus)
    assert "gradient accumulation 4" in result.stdout  # one process needs 4 micro-steps
    return {tag: scalars(os.path.join(run_dir, "tb"), tag) for tag in ("train/loss", "val/loss")}


@pytest.fixture(scope="module")
def four_ranks(corpus, tmp_path_factory):
    """strategy -> the folder of its 4-rank run (each run once per module)."""
    runs = {}

    def run(strategy: str) -> str:
        if strategy not in runs:
            run_dir = str(tmp_path_factory.mktemp(strategy))
            mode = dict(fsdp=False) if strategy == "DDP" else dict(sharding_strategy=strategy)
            result = run_trainer(run_dir, nproc=4, max_iters=STEPS, **mode, **corpus,
                                 fsdp_size=2 if strategy == "HYBRID_SHARD" else None)
            assert "gradient accumulation 1" in result.stdout  # four ranks need none
            runs[strategy] = run_dir
        return runs[strategy]
    return run


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "DDP"])
def test_four_ranks_match_one_process(strategy, single_process, four_ranks):
    run_dir = four_ranks(strategy)
    for tag, reference in single_process.items():
        losses = scalars(os.path.join(run_dir, "tb"), tag)
        assert sorted(losses) == sorted(reference)
        for step, value in reference.items():
            assert losses[step] == pytest.approx(value, rel=1e-4), (tag, step)
    assert len(single_process["train/loss"]) == STEPS
    # training moved the weights: the parity is not that of a model standing still
    assert single_process["train/loss"][STEPS] < single_process["train/loss"][1]


def test_standalone_evaluation_matches_the_four_rank_log(four_ranks):
    run_dir = four_ranks("FULL_SHARD")
    logged = scalars(os.path.join(run_dir, "tb"), "val/loss")[STEPS]
    result = subprocess.run([sys.executable, os.path.join(ROOT, "evaluate.py"),
                             os.path.join(run_dir, "ckpt", f"fsdp_cpt{STEPS}.pth")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    standalone = float(result.stdout.split("val loss ")[1].split()[0])
    assert standalone == pytest.approx(logged, rel=1e-5)

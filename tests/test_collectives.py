"""What a step costs in communication: one gradient reduction per optimizer step, not per micro-batch;
no host sync in steps that only train."""
import json
import os

import pytest

from conftest import ROOT, TINY, run_trainer

pytestmark = pytest.mark.slow
STEPS = 3


@pytest.mark.parametrize("strategy, collective", [("FULL_SHARD", "reduce_scatter"), ("NO_SHARD", "all_reduce")])
def test_one_gradient_reduction_per_unit_per_step(strategy, collective, corpus, tmp_path):
    # 2 ranks x micro_batch 2 x 4 micro-steps = 16 sequences a step
    result = run_trainer(str(tmp_path), nproc=2, script=os.path.join(ROOT, "tests", "collective_probe.py"), train_batch=16, micro_batch=2, max_iters=STEPS,
                         sharding_strategy=strategy, **corpus)
    assert "gradient accumulation 4" in result.stdout
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    units = TINY["n_layer"] + 1  # each DecoderBlock, and the root
    # each gradient collective once per unit per step (4x that if every micro-batch reduced); torch
    # 2.8 also runs NO_SHARD's reduce-scatter within its shard groups of one, once per step too
    assert any(name.startswith(collective) for name in counts), counts
    assert all(n == STEPS * units for n in counts.values()), counts


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_no_host_sync_in_steps_that_do_not_log_eval_or_save(optimizer, corpus, tmp_path):
    result = run_trainer(str(tmp_path), nproc=2, script=os.path.join(ROOT, "tests", "sync_probe.py"), max_iters=8, log_interval=4, eval_interval=4,
                         save_interval=4, optimizer=optimizer, **corpus)
    syncs = {int(step): n for step, n in json.loads(result.stdout.strip().splitlines()[-1]).items()}
    assert all(syncs[step] > 0 for step in (4, 8)), syncs  # the counter sees the log's .item()
    assert all(syncs[step] == 0 for step in (1, 2, 3, 5, 6, 7)), syncs

"""What a step costs in communication: one gradient reduction per optimizer step, not per micro-batch;
no host sync in steps that only train (doc_mask and a mixture of experts at ep_size 1 included;
expert parallelism's all-to-all needs the routed counts on the host, one read per MoE layer, and
context parallelism under doc_mask reads its gathered documents back once a forward)."""
import json
import os

import pytest

from conftest import ROOT, TINY, run_trainer
from test_doc_mask import short_corpus  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow
STEPS = 3


@pytest.mark.parametrize("strategy, units, collective", [
    ("FULL_SHARD", 1, "reduce_scatter"), ("FULL_SHARD", "auto", "reduce_scatter"), ("NO_SHARD", "auto", "all_reduce")])
def test_one_gradient_reduction_per_unit_per_step(strategy, units, collective, corpus, tmp_path):
    # 2 ranks x micro_batch 2 x 4 micro-steps = 16 sequences a step
    result = run_trainer(str(tmp_path), nproc=2, script=os.path.join(ROOT, "tests", "collective_probe.py"), train_batch=16, micro_batch=2, max_iters=STEPS,
                         sharding_strategy=strategy, fsdp_blocks_per_unit=units, **corpus)
    assert "gradient accumulation 4" in result.stdout
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    # a unit a block: each DecoderBlock, and the root; auto at this size: the whole model one unit
    expected_units = TINY["n_layer"] + 1 if units == 1 else 1
    assert ("FSDP units: the whole model one unit" in result.stdout) == (expected_units == 1)
    # each gradient collective once per unit per step (4x that if every micro-batch reduced); torch
    # 2.8 also runs NO_SHARD's reduce-scatter within its shard groups of one, once per step too
    assert any(name.startswith(collective) for name in counts), counts
    assert all(n == STEPS * expected_units for n in counts.values()), counts


SYNC_CASES = {"adamw": {}, "muon": dict(optimizer="muon"),
              # the documents' openings come from the loader's host copy of the rows
              "doc_mask": dict(doc_mask=True),
              # tokens per expert counted on the device; the grouped matmul takes device offsets
              "experts": dict(arch="llama", moe_experts=4, moe_top_k=2, moe_bias_rate=0.01)}


@pytest.mark.parametrize("case", SYNC_CASES)
def test_no_host_sync_in_steps_that_do_not_log_eval_or_save(case, corpus, short_corpus, tmp_path):
    data = short_corpus if case == "doc_mask" else corpus
    result = run_trainer(str(tmp_path), nproc=2, script=os.path.join(ROOT, "tests", "sync_probe.py"), max_iters=8,
                         log_interval=4, eval_interval=4, save_interval=4, **SYNC_CASES[case], **data)
    syncs = {int(step): n for step, n in json.loads(result.stdout.strip().splitlines()[-1]).items()}
    assert all(syncs[step] > 0 for step in (4, 8)), syncs  # the counter sees the log's .item()
    assert all(syncs[step] == 0 for step in (1, 2, 3, 5, 6, 7)), syncs

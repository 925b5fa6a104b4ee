"""Compiled blocks that stay compiled: over 10 steps and an eval, dynamo's own counts of graph breaks
and recompiles (tests/compile_probe.py), FP8's emulated linears under FSDP2's float8 all-gather
among them. The one recompile allowed is the eval's (no_grad is a new
global state for every compiled frame); doc_mask's one graph break is document_attention's eager
region (documented in docs/performance.md: its documents' bookkeeping on the host)."""
import json
import os

import pytest

from conftest import ROOT, run_trainer
from test_doc_mask import short_corpus  # noqa: F401 - the fixture
from test_fp8 import float8

pytestmark = pytest.mark.slow
LLAMA = dict(arch="llama", n_kv_head=1)
CASES = {"gpt2": {}, "llama": LLAMA, "experts": LLAMA | dict(moe_experts=4, moe_top_k=2, moe_bias_rate=0.01),
         "doc_mask": dict(doc_mask=True),
         "fp8": dict(fp8="tensorwise", fp8_emulate=True, fp8_layers="all", force_fsdp=True)}


def compiled_run(tmp_path, data: dict, settings: dict) -> dict:
    result = run_trainer(str(tmp_path), script=os.path.join(ROOT, "tests", "compile_probe.py"), compile=True,
                         max_iters=10, eval_interval=10, log_interval=5, **data, **settings)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_compiled_runs_have_no_graph_break_and_recompile_only_for_the_eval(case, corpus, short_corpus, tmp_path):
    if case == "fp8":
        float8()  # or skipped, saying why
    report = compiled_run(tmp_path, short_corpus if case == "doc_mask" else corpus, CASES[case])
    breaks = report["graph_breaks"]
    if case == "doc_mask":
        assert list(breaks) and all("compiler.disable" in reason for reason in breaks), breaks
    else:
        assert breaks == {}, breaks
    # every recompile is the eval's grad mode: one per compiled frame (doc_mask's break makes three
    # frames of a block, each recompiled once)
    assert report["recompiles"] and all("grad_mode" in r for r in report["recompiles"]), report["recompiles"]
    frames = {r.split(" triggered")[0] for r in report["recompiles"]}
    assert len(frames) == len(report["recompiles"]), report["recompiles"]

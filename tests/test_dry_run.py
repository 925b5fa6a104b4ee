"""The dry run (--dry_run=NODESxGPUS, observe/plan.py) against what real runs measure (tests/plan_probe.py: the
trainer's own step, its resident memory and its collectives over gloo), at a cluster's size, and what it
refuses as the launch does."""
import json
import os

import pytest

from conftest import DEMO, ROOT, TINY, TRAINER, launch, overrides, run_trainer, scalars

pytestmark = pytest.mark.slow

PROBE = os.path.join(ROOT, "tests", "plan_probe.py")
# narrow and long: the step's activations (~180 MB a rank) outweigh what a process holds besides its tensors
NARROW = dict(TINY, n_layer=4, n_embd=64, n_head=2, block_size=256, vocab_size=256, micro_batch=32, max_iters=2,
              eval_interval=100, fsdp_blocks_per_unit=1)
LLAMA_1B = os.path.join(ROOT, "config", "llama_1B.yaml")


def dry_run(tmp_path, world: str, config: str = DEMO, **settings):
    """The dry run's exit, what it printed, and its plan (None unless it exits 0)."""
    out = os.path.join(tmp_path, "plan.json")
    result = launch([TRAINER, config, f"--dry_run={world}", f"--dry_run_out={out}", *overrides(**settings)], tmp_path)
    plan = None
    if result.returncode == 0:
        with open(out) as f:
            plan = json.load(f)
    return result, plan


def calls(rows: list[dict], kind: str) -> int:
    return sum(row["calls"] for row in rows if row["kind"] == kind)


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_plan_matches_a_real_run(nproc, corpus, tmp_path):
    """The trainer at nproc ranks, fp32, two micro-steps a step (the first's gradients kept unreduced through the
    second): its second step against the dry run of 1 x nproc. The state as mem/state_gb logs it, each all-gather
    and reduce-scatter (calls and bytes), and the step's peak above the resident memory the rank held before its
    model was built (the rest of that, ~35 MB of a process's own, is what the plan leaves out)."""
    settings = NARROW | dict(train_batch=64 * nproc, **corpus)
    real = tmp_path / "real"
    real.mkdir()
    run_trainer(str(real), nproc=nproc, script=PROBE, env={"MALLOC_MMAP_THRESHOLD_": "65536"}, **settings)
    with open(real / "probe_rank0.json") as f:
        measured = json.load(f)
    _, plan = dry_run(tmp_path, f"1x{nproc}", **settings)
    assert plan["world_size"] == nproc and plan["mesh"] == {"shard": nproc}
    assert plan["per_rank"]["state_gb"] == pytest.approx(scalars(str(real / "tb"), "mem/rank0/state_gb")[2], rel=0.02)
    for kind in ("all_gather", "reduce_scatter"):
        assert plan["per_step"]["collective_gb"][kind] == pytest.approx(measured["collective_gb"][kind], rel=0.01), kind
        assert calls(plan["per_step"]["collectives"], kind) == measured["calls"][kind], kind
    peak = (measured["peak_kb"] - measured["baseline_kb"]) / 1e6
    assert plan["per_rank"]["peak_gb"] == pytest.approx(peak, rel=0.2), (plan["per_rank"]["peak_gb"], peak)

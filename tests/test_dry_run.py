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
    """The dry run's exit, what it printed, and its plan (None unless it exits 0): written to tmp_path unless
    settings say where (dry_run_out, or the checkpoint folder)."""
    settings = dict(dry_run_out=os.path.join(tmp_path, "plan.json")) | settings
    result = launch([TRAINER, config, f"--dry_run={world}", *overrides(**settings)], tmp_path)
    plan = None
    if result.returncode == 0:
        with open(settings["dry_run_out"] or os.path.join(settings["checkpoint_dir"], "plan.json")) as f:
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


def test_llama_1b_planned_at_256_ranks(tmp_path):
    """config/llama_1B.yaml on 32 nodes of 8 under HYBRID_SHARD, written where a run keeps its checkpoints: the
    mesh, the units' layout and why, the state a rank holds against the arithmetic (4 bytes a weight and 8 of
    AdamW's moments, over the shard group of 8), the GPUs it fits, the step-time floor; in one CPU process of
    less than 4 GB."""
    result, plan = dry_run(tmp_path, "32x8", LLAMA_1B, sharding_strategy="HYBRID_SHARD", micro_batch=2,
                           checkpoint_dir=str(tmp_path / "ckpt"), dry_run_out=None)
    assert result.returncode == 0 and os.path.isfile(tmp_path / "ckpt" / "plan.json"), result.stderr[-3000:]
    assert plan["world_size"] == 256 and plan["mesh"] == {"replicate": 32, "shard": 8}
    assert plan["params"] == 1_235_814_400
    assert plan["layout"].startswith("FSDP units: 5 of 4, 3, 3, 3 and 3 blocks") and "auto: a block computes" in plan["layout"]
    per_rank = plan["per_rank"]
    assert per_rank["state_gb"] == pytest.approx(12 * plan["params"] / 8 / 1e9, rel=0.05)
    assert per_rank["state_gb"] == pytest.approx(per_rank["params_gb"] + per_rank["optimizer_gb"])
    peaks = per_rank["peak_gb_by_activation_checkpointing"]
    assert peaks["true"] < peaks["false"] == per_rank["peak_gb"] < 80  # activation_checkpointing: false, as configured
    assert plan["fits"]["H100"]["activation_checkpointing_false"]
    rows = {(row["kind"], row["group"]): row for row in plan["per_step"]["collectives"]}
    assert rows[("all_gather", "shard")]["link"] == "nvlink" and rows[("all_reduce", "replicate")]["link"] == "network"
    assert set(plan["per_step"]["collective_gb"]) >= {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"}
    floor = plan["step_floor"]
    assert floor["overlapped_s"] == max(floor["compute_s"], floor["collectives_s"])
    assert floor["tokens_per_s"] == pytest.approx(512 * 2048 / floor["overlapped_s"])
    assert plan["checkpoint"] == {"type": "sharded", "files_per_rank": 1, "bytes_per_rank": pytest.approx(
        per_rank["state_gb"] * 1e9, rel=1e-3), "whole_bytes": pytest.approx(12 * plan["params"], rel=1e-3)}
    assert plan["dry_run"]["host_peak_gb"] < 4
    printed = result.stdout
    assert "plan: 256 ranks (32 x 8 H100), rank 0's figures, 1,235,814,400 parameters" in printed
    assert "H100 (85.5 GB): fits without, fits with" in printed and "step-time floor: compute" in printed


def error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def test_a_mesh_that_does_not_fit_is_refused_as_the_launch_refuses_it(corpus, tmp_path):
    """The same check, the same line: 3 ranks launched with shard groups of 2, and the dry run of 1 x 3."""
    settings = dict(TINY, sharding_strategy="HYBRID_SHARD", fsdp_size=2, **corpus)
    (tmp_path / "real").mkdir()
    launched = run_trainer(str(tmp_path / "real"), nproc=3, check=False, **settings)
    result, plan = dry_run(tmp_path, "1x3", **settings)
    assert result.returncode == 2 and plan is None
    assert error_line(result.stderr) == error_line(launched.stderr) == (
        "error: fsdp_size=2 must divide the world size 3 for HYBRID_SHARD: launch a multiple of 2 ranks or set "
        "--fsdp_size to a divisor of 3")


QWEN3_30B_A3B = dict(arch="llama", n_layer=48, n_embd=2048, n_head=32, n_kv_head=4, head_dim=128, qk_norm=True,
                     tie_embeddings=False, vocab_size=151936, moe_experts=128, moe_top_k=8, moe_hidden=768,
                     block_size=4096, micro_batch=8, train_batch=512)


@pytest.mark.parametrize("world, settings, line", [
    ("3x8", dict(sharding_strategy="HYBRID_SHARD", fsdp_size=16),
     "fsdp_size=16 must divide the world size 24 for HYBRID_SHARD: launch a multiple of 16 ranks or set --fsdp_size "
     "to a divisor of 24"),
    ("8x8", QWEN3_30B_A3B | dict(ep_size=3),
     "ep_size=3 must divide moe_experts=128: each rank of an expert group holds moe_experts / ep_size experts"),
    ("8x8", QWEN3_30B_A3B | dict(ep_size=16, sharding_strategy="HYBRID_SHARD"),
     "ep_size=16 must divide the shard group's 8 ranks (fsdp_size) 8: each expert group shares one shard group"),
    ("8x8", dict(cp_size=3, cp_mode="ring"),
     "cp_mode: ring needs 2 x cp_size = 6 to divide block_size=2048: each rank holds two of the row's 2 x cp_size "
     "chunks"),
    ("6x8", dict(),
     "train_batch=512 must be a multiple of micro_batch=8 x 48 ranks = 384"),
])
def test_what_cannot_run_at_that_size_says_so_in_one_line(world, settings, line, tmp_path):
    """Refused as the launch would refuse it: by the same check (the config's, the mesh's, the batch's), in
    one line, exit 2, before any model is built."""
    result, plan = dry_run(tmp_path, world, LLAMA_1B, **settings)
    assert result.returncode == 2 and plan is None
    assert error_line(result.stderr) == f"error: {line}"
    assert "parameters:" not in result.stdout


SMALL_LLAMA = dict(arch="llama", n_layer=2, n_embd=64, n_head=4, n_kv_head=2, vocab_size=256, micro_batch=4,
                   dtype="fp32")


@pytest.mark.parametrize("settings, expected", [
    # Ulysses over 2 of 4 ranks: each layer's q, k and v in one all-to-all and its output back, forward and
    # backward, half of each leaving the rank: 4 rows x 128 tokens x (4 + 2 x 2 heads, then 4) x 16 x 4 bytes
    (dict(block_size=256, train_batch=8, cp_size=2), 2 * 2 * 4 * 128 * (8 + 4) * 16 * 4 // 2),
    # experts over 2 ranks: each MoE layer's 512 routed copies of 64-wide rows out and back, forward and backward,
    # half leaving the rank (routing taken as balanced), and the 4 experts' counts (int64) in forward
    (dict(block_size=64, train_batch=16, moe_experts=4, moe_top_k=2, moe_hidden=32, ep_size=2),
     2 * (4 * 512 * 64 * 4 // 2 + 4 * 8 // 2)),
])
def test_the_all_to_alls_of_context_and_expert_parallelism(settings, expected, tmp_path):
    result, plan = dry_run(tmp_path, "1x4", **SMALL_LLAMA, **settings)
    assert result.returncode == 0, result.stderr[-3000:]
    assert plan["per_step"]["collective_gb"]["all_to_all"] * 1e9 == pytest.approx(expected, rel=1e-9)


def test_fp8_at_a_world_that_does_not_divide_its_rows(tmp_path):
    """FP8 at 3 ranks: the weights whose rows 3 doesn't divide gather in high precision (torchao's float8
    all-gather would hang on them), said by name; the others in FP8, a byte a weight."""
    result, plan = dry_run(tmp_path, "1x3", **(SMALL_LLAMA | dict(n_embd=96, block_size=64, train_batch=12,
                                                                  fp8="tensorwise", fp8_layers="all")))
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in plan["start_up"] if line.startswith("fp8"))
    assert line.startswith("fp8 tensorwise (float8 all-gather, scales computed after each step; 2 weights all-gathered "
                           "in high precision, then cast: their rows don't divide by the shard group's 3 ranks "
                           "(mlp.c_fc x2);"), line

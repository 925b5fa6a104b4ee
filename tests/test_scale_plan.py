"""bench/scale_plan.py's figures against what real runs hold: the per-rank state the trainer
logs, the checkpoint's bytes, and the index the checkpoint manager wrote."""
import os
import sys

import pytest
import torch

from fsdp_gpt.checkpoint import ckpt_format
from fsdp_gpt.config import TrainConfig, exit_code
from conftest import ROOT, checkpoint_of, scalars

sys.path.insert(0, os.path.join(ROOT, "bench"))
from scale_plan import Plan, main  # noqa: E402

pytestmark = pytest.mark.slow


def saved_config(shard_file: str) -> TrainConfig:
    return TrainConfig(**torch.load(shard_file, weights_only=True)["config"])


def test_plan_matches_a_two_rank_run(two_rank_runs):
    run_dir = two_rank_runs["sharded"]  # 2 ranks, FULL_SHARD
    directory = os.path.join(run_dir, "ckpt")
    plan = Plan(saved_config(checkpoint_of(run_dir, "sharded", 6, rank=0)), gpus=2, shard=2)
    for rank in range(2):
        logged = scalars(os.path.join(run_dir, "tb"), f"mem/rank{rank}/state_gb")[6]
        planned = plan.state_bytes(rank)
        # logged after the step, its gradients freed: parameters and AdamW moments
        assert logged == pytest.approx((planned["parameters"] + planned["optimizer"]) / 1e9, rel=1e-6), rank
    files = ckpt_format.read_sharded(directory, 6)
    written = sum(piece["data"].nbytes for f in files for piece in f["model"].values())
    written += sum(v["data"].nbytes for f in files for saved in f["optimizer"].values() for v in saved.values()
                   if isinstance(v, dict))
    assert written == plan.numel * 4 * 3
    index = ckpt_format.read_marker(directory, 6)["index"]
    planned = plan.index()
    assert sorted(index) == sorted(planned)
    assert all(index[key][0] == planned[key][0] and torch.equal(index[key][1], planned[key][1]) for key in index)


def test_plan_prints_a_table_and_refuses_a_batch_that_does_not_split(capsys):
    config = os.path.join(ROOT, "config", "train300M_fsdp.yaml")
    assert main([config, "--gpus", "64", "--gpus_per_node", "8", "--train_batch=1024"]) == 0
    out = capsys.readouterr().out
    assert "| shard group x replicas | 64 x 1 | 8 x 8 |" in out
    assert "| rank files a rank opens on resume | 1 | 1 |" in out
    assert exit_code(lambda: main([config, "--gpus", "128"])) == 2
    assert "error: train_batch=512 must be a multiple of micro_batch=8 x 128 GPUs" in capsys.readouterr().err


LLAMA_8B = [os.path.join(ROOT, "config", "llama_124M.yaml"), "--gpus", "64", "--arch=llama", "--n_layer=32",
            "--n_embd=4096", "--n_head=32", "--n_kv_head=8", "--ffn_hidden=14336", "--vocab_size=128256",
            "--micro_batch=1", "--train_batch=64", "--dtype=bf16"]


def sent(out: str, label: str) -> str:
    return out.split(f"| {label} | ")[1].split(" |")[0]


def test_plan_counts_both_context_modes_traffic(capsys):
    """8B Llama on 64 GPUs. At 32k, each row over 8 ranks: Ulysses sends each layer's q, k, v and
    output slices, (cp-1)/cp of each, in forward and backward (and a recomputed forward); the ring
    passes each layer's key/value block on cp-1 times a forward, cp-1 times in backward beside its
    fp32 gradient cp times. At 128k over 32 ranks Ulysses can't split 8 key/value heads; the ring can."""
    for recompute, forwards in (("false", 1), ("true", 2)):
        assert main(LLAMA_8B + ["--block_size=32768", "--cp_size=8", f"--activation_checkpointing={recompute}"]) == 0
        out = capsys.readouterr().out
        assert "8 micro-steps of 1 x 4096 tokens per rank per step" in out
        assert "| tokens of a row a rank computes (cp_size ranks a row) | 4,096 of 32,768 (8) |" in out
        # (2 x 32 + 2 x 8 heads) x 4096 tokens x 128 x 2 bytes x 7/8, per pass
        ulysses = (forwards + 1) * 80 * 4096 * 128 * 2 * 7 / 8
        assert float(sent(out, "Ulysses all-to-all MB sent per rank per layer (a micro-step)")) == pytest.approx(
            ulysses / 1e6, abs=0.01)
        assert float(sent(out, "Ulysses all-to-all GB sent per rank per step")) == pytest.approx(
            8 * 32 * ulysses / 1e9, abs=1e-3)
        block = 2 * 4096 * 8 * 128  # k and v: 4096 tokens x 8 key/value heads x 128
        ring = block * ((forwards + 1) * 7 * 2 + 8 * 4)
        assert float(sent(out, "ring MB sent per rank per layer (a micro-step)")) == pytest.approx(ring / 1e6, abs=0.01)
        assert float(sent(out, "ring GB sent per rank per step")) == pytest.approx(8 * 32 * ring / 1e9, abs=1e-3)
    assert main(LLAMA_8B + ["--block_size=131072", "--cp_size=32", "--cp_mode=ring", "--activation_checkpointing=true"]) == 0
    out = capsys.readouterr().out
    assert "32 micro-steps of 1 x 4096 tokens per rank per step" in out
    assert sent(out, "Ulysses all-to-all GB sent per rank per step") == "not possible: cp_size 32 must divide n_kv_head 8"
    ring = 2 * 4096 * 8 * 128 * (3 * 31 * 2 + 32 * 4)
    assert float(sent(out, "ring GB sent per rank per step")) == pytest.approx(32 * 32 * ring / 1e9, abs=1e-3)


QWEN3_30B_A3B = ["--arch=llama", "--n_layer=48", "--n_embd=2048", "--n_head=32", "--n_kv_head=4", "--head_dim=128",
                 "--qk_norm=true", "--tie_embeddings=false", "--vocab_size=151936", "--moe_experts=128", "--moe_top_k=8",
                 "--moe_hidden=768", "--block_size=4096", "--micro_batch=1", "--train_batch=512", "--dtype=bf16"]


def test_plan_of_qwen3_30b_a3b_with_expert_parallelism(capsys):
    """Qwen3-30B-A3B on 64 GPUs, experts over 8: 30.5B parameters, 1/64 of them per rank under
    FULL_SHARD whatever ep_size; each MoE layer sends every token's 8 copies out and back, 7/8 of
    them off the rank, in forward and backward."""
    assert main([os.path.join(ROOT, "config", "llama_124M.yaml"), "--gpus", "64", *QWEN3_30B_A3B, "--ep_size=8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("30,532,128,768 parameters stored")
    table = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in out.splitlines() if line.startswith("| ")}
    assert float(table["parameters GB per rank (fp32)"][0]) == pytest.approx(30_532_128_768 * 4 / 64 / 1e9, abs=1e-3)
    assert table["experts of each MoE layer a rank computes (ep_size)"][0] == "16 of 128 (8)"
    # 8 micro-steps x 2 passes x 48 layers x (out and back) x 4096 x 8 copies x 2048 wide x 2 bytes x 7/8
    expected = 8 * 2 * 48 * 2 * 4096 * 8 * 2048 * 2 * 7 / 8 / 1e9
    assert float(table["expert all-to-all GB sent per rank per step"][0]) == pytest.approx(expected, abs=1e-3)
    # the experts gather 1/8 of themselves in groups of 8 instead of all of themselves over 64
    assert main([os.path.join(ROOT, "config", "llama_124M.yaml"), "--gpus", "64", *QWEN3_30B_A3B]) == 0
    plain = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in capsys.readouterr().out.splitlines()
             if line.startswith("| ")}
    assert float(table["all-gather GB sent per rank per step"][0]) < float(plain["all-gather GB sent per rank per step"][0]) / 5

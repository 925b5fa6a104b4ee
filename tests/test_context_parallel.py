"""Context parallelism (cp_size): each row split over ranks trains the same run as one process, for
both layouts and both optimizers, beside data parallelism; its checkpoints do not depend on cp_size."""
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import DEMO, RUN, checkpoint_of, figures, run_trainer, scalars
from fsdp_gpt.config import UserError
from fsdp_gpt.families import FAMILIES
from fsdp_gpt.config_parse import parse_args
from fsdp_gpt.distributed import context_parallel

TAGS = ("train/loss", "train/grad_norm", "val/loss")


def logged(run_dir) -> dict[str, dict[int, float]]:
    return {tag: scalars(os.path.join(run_dir, "tb"), tag) for tag in TAGS}


def assert_parity(reference: dict, got: dict, rel: float = 1e-4) -> None:
    for tag, values in reference.items():
        assert sorted(got[tag]) == sorted(values), tag
        for step, value in values.items():
            assert got[tag][step] == pytest.approx(value, rel=rel), (tag, step)


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param("cp2", marks=pytest.mark.compat), "cp2_dp2", "cp2_hybrid", "cp2_ddp"])
def test_rows_split_over_ranks_train_as_one_process(name, run_of):
    run_dir = run_of(name)
    with open(os.path.join(run_dir, "stdout.txt")) as f:
        out = f.read()
    dp = 2 if name in ("cp2_dp2", "cp2_hybrid") else 1
    assert f"context parallel 2 (ulysses, each row over 2 ranks), gradient accumulation {24 // (2 * dp)}," in out
    assert_parity(logged(run_of("one")), logged(run_dir))


def test_ulysses_gives_each_rank_its_heads_of_the_whole_rows_and_back(monkeypatch):
    """q, k and v in one all-to-all (one dtype: the model gives them c_attn's), at cp_size 2, 4 and 8 with
    grouped key/value heads: rank c gets heads c of every token, and the output its tokens of every head.
    The ranks are threads, their all-to-all a stand-in that hands row j of each rank's input to rank j."""
    B, heads, kv_heads, T, D = 3, 16, 8, 16, 4
    for cp in (2, 4, 8):
        given, barrier = {}, threading.Barrier(cp)

        def all_to_all(pieces, output_split_sizes, input_split_sizes, rank):  # the group: the rank itself
            given[rank] = pieces
            barrier.wait()
            received = torch.stack([given[j][rank] for j in range(cp)])
            barrier.wait()  # every rank read before any sends again
            return received
        monkeypatch.setattr(context_parallel, "all_to_all_single_autograd", all_to_all)
        q, k, y = torch.randn(B, heads, T, D), torch.randn(B, kv_heads, T, D), torch.randn(B, heads, T, D)
        v = torch.randn(B, kv_heads, T, D)

        def rank(c):
            mine = slice(c * T // cp, (c + 1) * T // cp)
            exchanged = context_parallel._to_heads((q[:, :, mine], k[:, :, mine], v[:, :, mine]), c, cp)
            back = context_parallel._to_tokens(y[:, c * heads // cp:(c + 1) * heads // cp], c, cp)
            return exchanged, back, mine
        with ThreadPoolExecutor(cp) as pool:
            for c, ((q_c, k_c, v_c), back, mine) in enumerate(pool.map(rank, range(cp))):
                assert torch.equal(q_c, q[:, c * heads // cp:(c + 1) * heads // cp]), (cp, c)
                assert torch.equal(k_c, k[:, c * kv_heads // cp:(c + 1) * kv_heads // cp]), (cp, c)
                assert torch.equal(v_c, v[:, c * kv_heads // cp:(c + 1) * kv_heads // cp]), (cp, c)
                assert torch.equal(back, y[:, :, mine]), (cp, c)


# the Llama layout with grouped-query attention (4 heads, 2 key/value heads: each rank attends with
# 2 and 1), and Muon; the GPT-2 layout with Muon, and Llama with AdamW (GPT-2 with AdamW: above); each
# at 2 ranks and beside 2-way data parallelism at 4 (FULL_SHARD; HYBRID_SHARD for one)
LAYOUTS = {"llama_muon": dict(arch="llama", n_head=4, n_kv_head=2, optimizer="muon"),
           "gpt2_muon": dict(optimizer="muon"), "llama_adamw": dict(arch="llama", n_head=4, n_kv_head=2)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_both_layouts_and_optimizers_match_one_process(layout, corpus, tmp_path):
    # 8 rows a step: whole micro-batches at 1 and 2 data-parallel ranks
    settings = dict(RUN, train_batch=8, **LAYOUTS[layout], **corpus)
    runs = {"one": (1, {}), "cp2": (2, dict(cp_size=2)), "cp2_dp2": (4, dict(cp_size=2))}
    if layout == "llama_muon":
        runs["cp2_hybrid"] = (4, dict(cp_size=2, sharding_strategy="HYBRID_SHARD", fsdp_size=2))
    for name, (nproc, extra) in runs.items():
        os.makedirs(tmp_path / name)
        run_trainer(str(tmp_path / name), nproc=nproc, **settings, **extra)
    for name in runs:
        assert_parity(logged(tmp_path / "one"), logged(tmp_path / name))


def resumed(tmp_path, checkpoint: str, nproc: int, **settings) -> dict[int, float]:
    os.makedirs(tmp_path)
    result = run_trainer(str(tmp_path), nproc=nproc, resume_from=checkpoint, checkpoint_type="sharded", **(RUN | settings))
    assert f"resumed from {checkpoint} at step 3" in result.stdout
    return scalars(str(tmp_path / "tb"), "train/loss")


@pytest.mark.slow
def test_checkpoints_do_not_depend_on_cp_size(run_of, corpus, tmp_path):
    cp2, cp1 = (scalars(os.path.join(run_of(name), "tb"), "train/loss") for name in ("cp2", "sharded2"))
    same = resumed(tmp_path / "same", checkpoint_of(run_of("cp2"), "sharded", 3), 2, cp_size=2, **corpus)
    assert sorted(same) == [4, 5, 6] and all(same[s] == cp2[s] for s in same)  # bitwise at the same cp_size
    for checkpoint_run, cp_size, expected in (("cp2", 1, cp2), ("sharded2", 2, cp1)):  # 2 -> 1 and 1 -> 2
        got = resumed(tmp_path / f"to{cp_size}", checkpoint_of(run_of(checkpoint_run), "sharded", 3), 2,
                      cp_size=cp_size, **corpus)
        assert sorted(got) == [4, 5, 6]
        assert all(got[s] == pytest.approx(expected[s], rel=1e-4) for s in got), (checkpoint_run, got, expected)


@pytest.mark.parametrize("overrides, message", [
    (["--cp_size=3"], "cp_size=3 must divide n_head=4"),
    (["--cp_size=4", "--arch=llama", "--n_kv_head=2"], "cp_size=4 must divide n_kv_head=2"),
    (["--cp_size=2", "--block_size=127"], "cp_size=2 must divide block_size=127"),
    (["--cp_size=0"], "cp_size must be 1 or more, got 0"),
])
def test_cp_size_that_does_not_divide_the_model_is_refused(overrides, message):
    with pytest.raises(UserError, match=re.escape(message)):
        parse_args([DEMO] + overrides)  # the demo: 4 heads, block_size 128


def test_cp_size_that_does_not_divide_the_world_is_refused(corpus, tmp_path):
    result = run_trainer(str(tmp_path), cp_size=2, check=False, **corpus)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "error: cp_size=2 must divide the world size 1: launch a multiple of 2 ranks"


@pytest.mark.slow
def test_a_llama_run_lengthens_its_context_on_resume_and_gpt2_is_told_why_not(run_of, corpus, tmp_path):
    # 4 rows a step: 2 ranks of 2 rows in the short run; the long ones split each row over every rank
    llama = dict(RUN, train_batch=4, arch="llama", n_head=4, n_kv_head=2, checkpoint_type="sharded", **corpus)
    os.makedirs(tmp_path / "short")
    run_trainer(str(tmp_path / "short"), nproc=2, **llama | dict(max_iters=3))
    os.makedirs(tmp_path / "long")
    result = run_trainer(str(tmp_path / "long"), nproc=2, resume_from=checkpoint_of(tmp_path / "short", "sharded", 3),
                         **llama | dict(block_size=64, rope_theta=50000.0, cp_size=2, micro_batch=1))
    assert ("note: the context changes on resume: block_size 32 -> 64, rope_theta 10000.0 -> 50000.0; the weights are "
            "the checkpoint's, the data continues after its step") in result.stdout
    assert "context parallel 2 (ulysses, each row over 2 ranks)" in result.stdout
    assert sorted(scalars(str(tmp_path / "long" / "tb"), "train/loss")) == [4, 5, 6]
    # the long-context phase as docs/long_runs.md runs it: doc_mask, the ring over more ranks than the
    # short run had
    os.makedirs(tmp_path / "ring")
    result = run_trainer(str(tmp_path / "ring"), nproc=4, resume_from=checkpoint_of(tmp_path / "short", "sharded", 3),
                         **llama | dict(block_size=64, rope_theta=50000.0, cp_size=4, cp_mode="ring", doc_mask=True,
                                        micro_batch=1))
    assert "context parallel 4 (ring, each row over 4 ranks)" in result.stdout
    assert sorted(scalars(str(tmp_path / "ring" / "tb"), "val/loss")) == [6]
    # the tokens seen go on from the checkpoint's count (3 steps of 32-token rows), resharded from 2 ranks to 4
    assert figures(str(tmp_path / "ring" / "tb"), "data/tokens") == {s: 4 * (3 * 32 + (s - 3) * 64) for s in (4, 5, 6)}

    os.makedirs(tmp_path / "gpt2")
    # every rank exits 2, which torchrun reports as 1
    refused = run_trainer(str(tmp_path / "gpt2"), nproc=2, check=False, block_size=64, resume_from=checkpoint_of(
        run_of("cp2"), "sharded", 3), **RUN | corpus)
    resumable = ", ".join(family.name for family in FAMILIES if "block_size" in family.resumable)  # the table's
    assert refused.returncode == 1 and "but the config has block_size=64: set --block_size=32 to resume it (only " \
        f"{resumable} may change block_size on resume)" in refused.stderr and "Llama" in resumable


def test_a_mixture_keeps_its_block_size_on_resume(corpus, tmp_path):
    """A mixture's checkpoint counts each source's rows of the old length: a longer row is refused."""
    mix = dict(RUN, arch="llama", n_head=4, n_kv_head=2, max_iters=3, data_source=None,
               data_mix=f"{{a: {corpus['data_path']}, b: {corpus['data_path']}}}")
    os.makedirs(tmp_path / "short")
    run_trainer(str(tmp_path / "short"), **mix)
    os.makedirs(tmp_path / "long")
    result = run_trainer(str(tmp_path / "long"), check=False, block_size=64, resume_from=str(
        tmp_path / "short" / "ckpt" / "fsdp_cpt3.pth"), **mix | dict(max_iters=4))
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].endswith(
        "a mixture's run can't change block_size on resume (its checkpoint counts each source's rows of 32 tokens): "
        "keep block_size=32")

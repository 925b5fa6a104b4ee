"""What a checkpoint keeps beside the weights (train_state): every owner of such state (RunState, the
one list of them) offers state() and load(), and the checkpoint manager gathers them
(CheckpointManager.keep). A checkpoint written before that (issue 50; main at fb8488c gathered them in
train_fsdp.py's run_state() and resolved tie_embeddings into model_config) resumes as the run that
wrote it went on, its tokens seen taken from its step (it counted none).

The fixture (tests/data/checkpoint_before_issue50/) is a full checkpoint of step 3 of a 6-step run
with every owner of state beside the weights at work: a Llama-layout mixture of experts with qk_norm
and a balancing bias (moe), a two-source mixture (data), a spike window (spikes). Made by fb8488c's
trainer in a folder holding the fixture's data/:

    ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE OMP_NUM_THREADS=1 python train_fsdp.py config/demo_cpu.yaml \
        (conftest's TINY and SETTINGS below as --key=value) --data_path=data/a \
        --data_mix="{a: data/a, b: data/b}" --checkpoint_dir=ckpt --tensorboard_dir=tb

with torch 2.13.0 (CPU build: MKL 2024.2 as its BLAS) on an AMD EPYC with AVX2 (the checkpoint's
`config` holds every key the run took); after_step3.json holds, under "2.13.0", what that
uninterrupted run logged after step 3. Made again, the files come out byte for byte the same.

The figures are torch's as well as the trainer's: under "2.8.0" (CI's oldest torch) are what fb8488c's
own trainer logs resumed from fsdp_cpt3.pth on torch 2.8.0 under the same pins (run with
launcher=[python] from a worktree of fb8488c; on torch 2.13.0 that resume logs the "2.13.0" figures).
They differ in val/loss alone, by an ulp (some kernel of the evaluation's forward, not traced further). A
torch without figures of its own is skipped, saying so; its figures are made the same way.

Unpinned, the figures are the CPU's: ATen's own kernels (norms, sums, softmax, the optimizer) run
at the widest vector the CPU has, and AVX-512's 16 lanes sum in another order than AVX2's 8; MKL's
matmuls take the branch MKL picks for the CPU. The first fixture, made unpinned on another x86
machine (very likely with AVX-512), failed on an AVX2 one by an ulp (grad_norm at step 5, val/loss
at step 6). PINNED_ISA fixes both, for the fixture's making and for the resumed run: ATen's AVX2
kernels (ATEN_CPU_CAPABILITY is read before the CPU is asked: every CPU with AVX2 and FMA runs the
same code; one without stops at an illegal instruction) and MKL's COMPATIBLE branch (one SSE2 code
path without the approximate rcpps/rsqrtps, the only fixed branch MKL runs on non-Intel CPUs: its
AVX2 branch is Intel's alone, AMD gets the AUTO one). oneDNN is not called by these fp32 runs. The
other resume tests compare two runs on one machine and need no pins."""
import json
import os
import shutil

import pytest
import torch

from conftest import DEMO, ROOT, checkpoint_of, run_trainer, scalars
from fsdp_gpt.checkpoint.ckpt_inspect import describe, inspect
from fsdp_gpt.checkpoint.fsdp_ckpt import CheckpointManager
from fsdp_gpt.checkpoint.run_state import RunState, resumed_train_state
from fsdp_gpt.config_parse import parse_args
from fsdp_gpt.data.loader import BatchLoader
from fsdp_gpt.data.mixture import Segment
from fsdp_gpt.distributed.launch import Topology
from fsdp_gpt.files import read_json
from fsdp_gpt.model import GPT, GPTConfig

FIXTURE = os.path.join(ROOT, "tests", "data", "checkpoint_before_issue50")
SETTINGS = dict(arch="llama", n_layer=2, n_head=2, n_kv_head=1, n_embd=16, qk_norm=True, ffn_hidden=32,
                moe_experts=2, moe_top_k=1, moe_bias_rate=0.01, moe_aux_loss=0.01, block_size=16, train_batch=4,
                micro_batch=2, max_iters=6, warmup_iters=2, lr_decay_iters=6, save_interval=3, eval_interval=3,
                seed=50, spike_window=4, checkpoint_type="full", data_source=None, data_weights="{a: 2, b: 1}")
PINNED_ISA = dict(ATEN_CPU_CAPABILITY="avx2", MKL_CBWR="COMPATIBLE")


def test_a_checkpoint_written_before_issue_50_resumes_bitwise(tmp_path):
    with open(os.path.join(FIXTURE, "after_step3.json")) as f:
        figures = json.load(f)
    release = torch.__version__.split("+")[0]
    if release not in figures:
        pytest.skip(f"the fixture has figures for torch {', '.join(figures)}, not {release}: see the module's docstring")
    expected = figures[release]
    data = tmp_path / "data"
    shutil.copytree(os.path.join(FIXTURE, "data"), data)
    resumed = os.path.join(FIXTURE, "fsdp_cpt3.pth")
    result = run_trainer(str(tmp_path), resume_from=resumed, data_path=str(data / "a"), env=PINNED_ISA,
                         data_mix=f"{{a: {data / 'a'}, b: {data / 'b'}}}", **SETTINGS)
    for tag, values in expected.items():
        assert scalars(str(tmp_path / "tb"), tag) == {int(step): value for step, value in values.items()}, tag
    # what the owners kept went on from the checkpoint's: the spike window (a ring of 4) holds the
    # saved loss of step 3 beside steps 4 to 6's, the mixture's segment is the saved one (in today's form: its
    # rows numbered from its start step by its train_batch) and its sources supplied 3 more steps' rows
    before = torch.load(resumed, weights_only=True)["train_state"]
    after = torch.load(checkpoint_of(str(tmp_path), "full", 6), weights_only=True)["train_state"]
    loss = expected["train/loss"]
    assert after["spikes"]["losses"] == [loss["5"], loss["6"], before["spikes"]["losses"][2], loss["4"]]
    assert after["spikes"]["seen"] == 6
    saved_segment = before["data"]["mixture"]["segment"]
    assert saved_segment["start_row"] == 0 and after["data"]["mixture"]["segment"] == {
        "start_step": 0, "train_batch": 4, "weights": saved_segment["weights"], "base": saved_segment["base"]}
    assert after["data"]["mixture"]["supplied"] == {"a": 16, "b": 8}
    assert len(after["moe"]["load"]) == 2 and after["wandb_run_id"] is None
    # it counted no tokens: taken as its 3 steps' (4 rows of 16 tokens each), and counted on from there
    assert "note: the checkpoint predates its count of tokens seen: taken as 3 steps x train_batch 4 x block_size " \
        "16 = 192" in result.stdout
    assert after["data"]["tokens"] == 6 * 4 * 16


def fixture_loader(step: int = 0, block_size: int = 16) -> BatchLoader:
    """The fixture's mixture at 4 rows a step, for a run that continues after `step`."""
    sources = {name: (os.path.join(FIXTURE, "data", name), read_json(os.path.join(FIXTURE, "data", name, "meta.json"),
                                                                      "")) for name in "ab"}
    return BatchLoader(sources, block_size, 4, 2, 0, 1, 50, torch.device("cpu"),
                       Segment(0, 4, {"a": 2.0, "b": 1.0}, {"a": 0, "b": 0}), step=step)


def owners(cfg, model, step: int = 0, block_size: int = 16) -> dict:
    """The trainer's owners of state beside the weights (RunState, as train_fsdp.py makes them), fresh,
    for a run that continues after `step`."""
    return vars(RunState.of(cfg, fixture_loader(step, block_size), model, torch.device("cpu")))


def test_every_owner_gets_back_what_it_kept(one_process_group, tmp_path):
    """Each owner's state() is saved under its name, and load() gives a fresh owner the same state."""
    argv = [DEMO] + [f"--{k}={v}" for k, v in (SETTINGS | dict(data_mix="{a: a, b: b}", wandb_project="p")).items()]
    cfg = parse_args(argv + [f"--checkpoint_dir={tmp_path / 'first'}", "--vocab_size=256"])
    model = GPT(GPTConfig.of(cfg))
    optimizer = torch.optim.AdamW(model.parameters())
    one = Topology(0, 1, 0, 1, torch.device("cpu"), "none", None)
    saving, kept = CheckpointManager(cfg, one), owners(cfg, model)
    saving.keep(**kept)
    for step in (1, 2, 3):
        list(kept["data"].micro_batches(step))
        kept["spikes"].check(step, torch.tensor(5.0 - 0.1 * step))
        model(torch.randint(0, 256, (2, 16)))  # the experts' figures of a forward
        kept["moe"].step()
    saving.save(3, model, optimizer)
    cfg.checkpoint_dir = str(tmp_path / "second")
    resuming, resumed = CheckpointManager(cfg, one), owners(cfg, model, step=3)
    assert resuming.resume(str(tmp_path / "first" / "fsdp_cpt3.pth"), model, optimizer) == 3
    resuming.keep(**resumed)
    for name, owner in kept.items():
        assert owner.state() and resumed[name].state() == owner.state(), name
    assert kept["data"].state()["tokens"] == 3 * 4 * 16
    # the count goes on from the checkpoint's where the rows grow on resume (a longer context)
    longer = owners(cfg, model, step=3, block_size=32)["data"]
    longer.load(kept["data"].state())
    assert longer.tokens(5) == 3 * 4 * 16 + 2 * 4 * 32


def test_the_tokens_seen_before_their_count_are_taken_with_the_checkpoints_own_batch(tmp_path):
    """A checkpoint of 2 steps of 6 rows of 64 tokens that predates the count, resumed at 4 rows of 16: 768
    seen, as its own config says, not 2 x 4 x 16."""
    ckpt = {"step": 2, "config": {"train_batch": 6, "block_size": 64}, "train_state": {"data": {}, "seed": 50},
            "model_config": {"vocab_size": 256, "n_layer": 1, "n_head": 1, "n_embd": 8, "block_size": 8}}
    data = fixture_loader(step=2)
    note = data.load(resumed_train_state(ckpt)["data"])
    assert note == "the checkpoint predates its count of tokens seen: taken as 2 steps x train_batch 6 x block_size 64 = 768"
    assert data.tokens(3) == 768 + 4 * 16
    assert "tokens_taken_as" not in data.state()
    counted = dict(ckpt, train_state={"data": {"tokens": 500}})
    assert resumed_train_state(counted) == counted["train_state"] and describe(counted, "full")[1] == "  tokens seen  500"
    assert describe(ckpt, "full")[1] == (
        "  tokens seen  768 (taken as 2 steps x train_batch 6 x block_size 64: the checkpoint predates its count)")


def test_the_inspector_reads_a_checkpoint_written_before_issue_50():
    """python fsdp_ckpt.py on the fixture: its tokens seen taken from its step (it counted none), its
    world size not recorded, the rest as for any checkpoint."""
    ckpt = torch.load(os.path.join(FIXTURE, "fsdp_cpt3.pth"), weights_only=True)
    with torch.device("meta"):
        gpt = GPT(GPTConfig(**ckpt["model_config"]))
    report, complete = inspect(os.path.join(FIXTURE, "fsdp_cpt3.pth"), verify=True)
    assert complete and report.endswith("\n  complete     yes: one file under its final name, its checksum matches")
    for line in ["  tokens seen  192 (taken as 3 steps x train_batch 4 x block_size 16: the checkpoint predates its count)",
                 "  written by   ranks not recorded (the checkpoint predates it), FULL_SHARD; full format",
                 "  model        Qwen3-MoE, 2 layers x 16 wide, 2 heads (1 key/value), 2 experts (top 1), context 16, "
                 f"vocabulary 256: {gpt.num_params():,} parameters ({gpt.num_params() - gpt.idle_expert_params():,} "
                 "active a token)",
                 "  data         mixture a: data/a, b: data/b, seed 50: step 4's batch next; rows supplied: a 8, b 4; "
                 "weights a 2, b 1 from row 0"]:
        assert f"\n{line}\n" in report, report

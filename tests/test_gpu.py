"""The paths only a GPU has: bf16 autocast, FSDP mixed precision with pinned-memory offload, the
side-stream loader, fused AdamW state on CUDA across a resume, compile, the ring's and doc_mask's
attention kernels, and NCCL collectives on 2+ GPUs. Each test starts its processes with the GPUs visible (the rest of the suite hides them) and
skips, saying why, where there are too few. bench/gpu_check.sh runs them on a GPU machine.

Tolerances: GPU kernels are not bitwise deterministic run to run (the attention backward
accumulates with atomics), and fp32 matmuls run as TF32, so a resumed or compiled run matches its
reference to rel 1e-3 rather than exactly; two ranks against one process compare forward-only
figures and losses at the CPU parity tests' rel 1e-4.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, evaluated, run_trainer, scalars

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def losses(run_dir, tag="train/loss") -> dict:
    return scalars(os.path.join(run_dir, "tb"), tag)


def test_bf16_autocast_trains_and_evaluate_reports_the_logged_val_loss(gpu_env, corpus, tmp_path):
    env = gpu_env(1)
    result = run_trainer(str(tmp_path), env=env, dtype="auto", max_iters=8, save_interval=8, **corpus)
    assert "model not wrapped" in result.stdout and "compute dtype torch.bfloat16" in result.stdout
    val = losses(str(tmp_path), "val/loss")
    assert val[8] < val[0] - 0.2
    assert evaluated(tmp_path / "ckpt" / "fsdp_cpt8.pth", env=env) == pytest.approx(val[8], rel=1e-5)


def test_fsdp_mixed_precision_with_pinned_offload_resumes(gpu_env, corpus, tmp_path):
    """cpu_offload wraps one process in FSDP2 (pinned host memory, the GPU-only policy); its
    sharded checkpoint resumes."""
    env = gpu_env(1)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    for d in (whole, resumed):
        d.mkdir()
    settings = dict(dtype="bf16", cpu_offload=True, checkpoint_type="sharded", save_interval=4, **corpus)
    result = run_trainer(str(whole), env=env, **settings)
    assert "mesh (shard=1)" in result.stdout and "compute dtype torch.bfloat16" in result.stdout
    assert losses(str(whole))[8] < losses(str(whole))[1] - 0.2
    run_trainer(str(resumed), env=env, resume_from=str(whole / "ckpt" / "fsdp_sharded_cpt4_rank0.pth"), **settings)
    for step in (5, 6, 7, 8):
        assert losses(str(resumed))[step] == pytest.approx(losses(str(whole))[step], rel=1e-3), step


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_fused_adamw_state_on_the_gpu_resumes(kind, gpu_env, corpus, tmp_path):
    """Fused AdamW keeps `step` on the GPU and refuses it elsewhere: a resume places it back there."""
    env = gpu_env(1)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    for d in (whole, resumed):
        d.mkdir()
    settings = dict(dtype="bf16", checkpoint_type=kind, save_interval=4, **corpus)
    run_trainer(str(whole), env=env, **settings)
    name = "fsdp_cpt4.pth" if kind == "full" else "fsdp_sharded_cpt4_rank0.pth"
    run_trainer(str(resumed), env=env, resume_from=str(whole / "ckpt" / name), **settings)
    for step in (5, 6, 7, 8):
        assert losses(str(resumed))[step] == pytest.approx(losses(str(whole))[step], rel=1e-3), step


def test_compiled_blocks_train_as_eager_ones(gpu_env, corpus, tmp_path):
    env = gpu_env(1)
    runs = {}
    for compiled in (False, True):
        runs[compiled] = tmp_path / f"compile_{compiled}"
        runs[compiled].mkdir()
        run_trainer(str(runs[compiled]), env=env, timeout=900, dtype="fp32", compile=compiled, **corpus)
    for step, loss in losses(str(runs[False])).items():
        assert losses(str(runs[True]))[step] == pytest.approx(loss, rel=1e-3), step


LOADER_CHECK = """
import sys, torch
sys.path.insert(0, {root!r})
from fsdp_gpt.data.prepare import prepare_data
from fsdp_gpt.data.loader import BatchLoader
meta = prepare_data({path!r}, None, "bytes")
gpu, cpu = (BatchLoader({{"data": ({path!r}, meta)}}, 32, 8, 2, 0, 1, 7, torch.device(d)) for d in ("cuda", "cpu"))
assert gpu.one_ahead
for step in (1, 2, 3, 7, 8):  # 7: a jump, as after a resume
    pairs = list(zip(gpu.micro_batches(step), cpu.micro_batches(step), strict=True))
    assert len(pairs) == 4
    for (gx, gy, _), (cx, cy, _) in pairs:
        assert gx.is_cuda and torch.equal(gx.cpu(), cx) and torch.equal(gy.cpu(), cy)
print("same batches")
"""


def test_side_stream_loader_yields_the_cpu_loaders_batches(gpu_env, corpus, tmp_path):
    env = gpu_env(1)
    run_trainer(str(tmp_path), max_iters=0, **corpus)  # prepares the corpus (on the CPU)
    code = LOADER_CHECK.format(root=ROOT, path=corpus["data_path"])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ) | env)
    assert result.returncode == 0 and "same batches" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_two_gpus_over_nccl_match_one(optimizer, gpu_env, corpus, tmp_path):
    """FSDP's all-gathers and reduce-scatters (and Muon's all-to-alls) on NCCL, in fp32."""
    env = gpu_env(2)
    runs = {}
    for nproc in (1, 2):
        runs[nproc] = tmp_path / f"ranks{nproc}"
        runs[nproc].mkdir()
        result = run_trainer(str(runs[nproc]), nproc=nproc, env=env, dtype="fp32", optimizer=optimizer, **corpus)
    assert "gradient accumulation 2" in result.stdout
    for tag in ("train/loss", "val/loss"):
        for step, value in losses(str(runs[1]), tag).items():
            assert losses(str(runs[2]), tag)[step] == pytest.approx(value, rel=1e-4), (tag, step)
    assert TINY["max_iters"] in losses(str(runs[2]))


def test_ring_kernels_and_per_document_calls_on_cuda(gpu_env):
    """tests/attention_check.py on the GPU in bf16: the flash kernel's forward with its log-sum-exp
    and its backward given the merged one (the ring's), and doc_mask's per-document calls and its
    varlen call (what doc_mask runs on CUDA); a sliding window through the flash kernel's own (rows
    and documents, by varlen) and the ring's windowed tiles; each with gpt-oss's attention sinks (flash's
    forward and varlen call, the sink applied on their log-sum-exp)."""
    env = gpu_env(1)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "attention_check.py"), "cuda", "bfloat16"],
                            capture_output=True, text=True, timeout=300, env=dict(os.environ) | env)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(figures) == 16 and max(figures.values()) < 3e-2, figures

"""What the first GPU run would hit, checked on CPU: where checkpoint tensors go, the backend for
offloaded collectives, the compute dtype, MFU's GPU table, and launches without torchrun."""
import os
import subprocess

import pytest
import torch

import metrics
import train_fsdp
from torch.utils._pytree import tree_leaves

from config import parse_args
from conftest import DEMO, trainer_cmd
from fsdp_ckpt import _placed, sharded_state
from launch import backend_for, wrapping
from model import GPT, GPTConfig


def test_every_tensor_written_is_a_host_copy():
    """What a sharded save hands its writer: on the host, owning its bytes (a GPU fused
    optimizer's 0-dim `step` lives on the GPU)."""
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16))
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randint(0, 64, (2, 8))
    model(x, x)[1].backward()
    optimizer.step()
    live = {t.untyped_storage().data_ptr() for t in [*model.parameters()] + [
        v for s in optimizer.state.values() for v in s.values()]}
    written = [t for t in tree_leaves(sharded_state(model, optimizer, rank=0)) if isinstance(t, torch.Tensor)]
    assert len(written) == len(live)  # every parameter, moment and step
    for t in written:
        assert t.device.type == "cpu"
        assert t.untyped_storage().data_ptr() not in live


@pytest.mark.parametrize("group, step_device", [({"fused": True}, "meta"), ({"capturable": True}, "meta"),
                                                ({"fused": False}, "cpu"), ({}, "cpu")])
def test_loaded_optimizer_values_land_where_the_optimizer_keeps_them(group, step_device):
    """`step` goes to the parameter's device only for fused/capturable optimizers (torch's rule);
    the meta device stands in for a GPU."""
    param = torch.empty(4, device="meta")
    assert _placed(torch.tensor(3.0), "step", param, group).device.type == step_device
    assert _placed(torch.tensor(3.0), "other", param, group).device.type == "meta"


def test_collectives_on_host_tensors_get_gloo_beside_nccl():
    assert backend_for("cuda", cpu_offload=True) == "cuda:nccl,cpu:gloo"
    assert backend_for("cuda", cpu_offload=False) == "nccl"
    assert backend_for("cpu", cpu_offload=True) == backend_for("cpu", cpu_offload=False) == "gloo"


def test_auto_dtype_skips_emulated_bf16(monkeypatch):
    cfg = parse_args([DEMO, "--dtype=auto"])
    # a V100: bf16 only through emulation
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert train_fsdp.compute_dtype(cfg, torch.device("cuda", 0)) == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # an A100
    assert train_fsdp.compute_dtype(cfg, torch.device("cuda", 0)) == torch.bfloat16
    assert train_fsdp.compute_dtype(cfg, torch.device("cpu")) == torch.float32


@pytest.mark.parametrize("fsdp, world, offload, wrap, expected", [
    (False, 2, False, "ddp", torch.bfloat16), (True, 2, False, "fsdp", torch.float32),
    (True, 1, False, "none", torch.bfloat16), (False, 1, False, "none", torch.bfloat16),
    (True, 1, True, "fsdp", torch.float32)])
def test_wrapping_and_who_casts_the_compute(fsdp, world, offload, wrap, expected):
    """One process runs the model unwrapped unless offloading; under DDP and unwrapped, autocast
    casts the compute; under FSDP the MixedPrecisionPolicy does (no autocast)."""
    cfg = parse_args([DEMO, "--dtype=bf16", f"--fsdp={str(fsdp).lower()}", f"--cpu_offload={str(offload).lower()}"])
    assert wrapping(cfg, world) == wrap
    with train_fsdp.autocast(cfg, torch.device("cpu"), wrap):
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == expected


@pytest.mark.parametrize("name, flops", [("NVIDIA L40", 181e12), ("NVIDIA L4", 121e12), ("NVIDIA H100 PCIe", 756e12),
                                         ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA Future GPU", None)])
def test_mfu_table_matches_gpu_names_exactly(name, flops, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert metrics.device_peak_flops(torch.device("cuda", 0)) == flops


def test_srun_without_torchrun_is_refused(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")} | {"SLURM_NTASKS": "8",
                                                                                    "SLURM_PROCID": "3"}
    result = subprocess.run(trainer_cmd(1) + [DEMO], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: started as 8 SLURM tasks without torchrun: start one task per node that runs torchrun "
        "(the README's SLURM script)"]

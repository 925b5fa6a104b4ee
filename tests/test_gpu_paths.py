"""What the first GPU run would hit, checked on CPU: where checkpoint tensors go, the backend for
offloaded collectives, the compute dtype of every forward in every wrapping, the RoPE tables'
dtype under FSDP, grouped-query attention without the math kernel, MFU's GPU table, and launches
without torchrun."""
import os
import subprocess
import tarfile
import types

import pytest
import torch
import yaml
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_gpt.distributed import launch
from fsdp_gpt.distributed import peak_flops
from fsdp_gpt import model as model_module
from fsdp_gpt import rope as rope_module
from fsdp_gpt.optim import muon
from fsdp_gpt.distributed import precision
import train_fsdp
from fsdp_gpt.config_parse import parse_args
import conftest
from conftest import DEMO, ROOT, TRAINER, zygote_python
from fsdp_gpt.data.prepare import prepare_data
from fsdp_gpt.evaluation.val_loss import val_loss_sums
from fsdp_gpt.checkpoint.ckpt_restore import _placed
from fsdp_gpt.checkpoint.fsdp_ckpt import sharded_state
from fsdp_gpt.distributed.launch import Topology, backend_for, wrapping
from fsdp_gpt.data.loader import BatchLoader
from fsdp_gpt.evaluation.mc_eval import Item, mc_sums
from fsdp_gpt.model import GPT, GPTConfig
from fsdp_gpt.resilience.watchdog import nccl_failure_settings


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
    # a V100: bf16 only through emulation
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert not precision.native_bf16(torch.device("cuda", 0))
    assert precision.compute_dtype("auto", precision.Chip("cuda", "Tesla V100-SXM2-16GB", (7, 0))) == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # an A100
    assert precision.native_bf16(torch.device("cuda", 0))
    a100 = precision.Chip("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), bf16=True)
    assert precision.compute_dtype("auto", a100) == torch.bfloat16
    assert precision.compute_dtype("auto", precision.Chip.of(torch.device("cpu"))) == torch.float32


@pytest.mark.parametrize("fsdp, world, offload, wrap, expected", [
    (False, 2, False, "ddp", torch.bfloat16), (True, 2, False, "fsdp", torch.bfloat16),
    (True, 1, False, "none", torch.bfloat16), (False, 1, False, "none", torch.bfloat16),
    (True, 1, True, "fsdp", torch.float32)])
def test_wrapping_and_who_casts_the_compute(fsdp, world, offload, wrap, expected):
    """One process runs the model unwrapped unless offloading. Autocast casts the compute unwrapped,
    under DDP, and under FSDP for the vectors FSDP2 leaves whole (replicated.py); under cpu_offload
    FSDP2 shards every parameter and its MixedPrecisionPolicy casts them all (no autocast)."""
    cfg = parse_args([DEMO, "--dtype=bf16", f"--fsdp={str(fsdp).lower()}", f"--cpu_offload={str(offload).lower()}"])
    assert wrapping(cfg, world) == wrap
    with train_fsdp.forward_context(cfg, Topology(0, world, 0, world, torch.device("cpu"), wrap, None))():
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == expected


def built(wrap: str, *overrides: str):
    """A bf16 llama model of one process as build_model wraps it ("none", "ddp" or "fsdp"), its
    config and topology (needs one_process_group)."""
    cfg = parse_args([DEMO, "--arch=llama", "--n_layer=2", "--n_head=4", "--n_kv_head=2", "--n_embd=32",
                      "--block_size=16", "--vocab_size=256", "--dtype=bf16", f"--fsdp={str(wrap != 'ddp').lower()}",
                      "--eval_iters=1", "--train_batch=4", "--micro_batch=2", *overrides])
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",)) if wrap == "fsdp" else None
    topo = Topology(0, 1, 0, 1, torch.device("cpu"), wrap, mesh)
    return train_fsdp.build_model(cfg, GPTConfig(**cfg.model_config), topo), cfg, topo


def test_rope_tables_reach_every_block_in_fp32_under_fsdp(one_process_group):
    """FSDP2 casts a unit's floating-point inputs to param_dtype unless told not to: the cos/sin
    tables the root hands each block would arrive in bf16 (fp32 unwrapped and under DDP)."""
    model, _, _ = built("fsdp")
    seen = []
    for block in model.blocks:  # registered after FSDP's own hook: sees what the block receives
        block.register_forward_pre_hook(lambda module, args: seen.append((args[0].dtype, args[1][0].dtype)))
    model(torch.randint(0, 256, (2, 16)))
    assert seen == [(torch.bfloat16, torch.float32)] * 2  # x in the compute dtype, the tables in fp32


def test_fsdp_shards_the_matrices_and_leaves_the_vectors_whole(one_process_group):
    """FSDP2 shards the matrices and embeddings; the vectors (norms' weights, biases) stay whole, in
    fp32, outside its per-parameter work (replicated.py), and autocast casts them for the compute
    (a linear's fp32 bias beside FSDP2's bf16 weight fails without it). Under cpu_offload every
    parameter is sharded."""
    shape = ("--arch=gpt2", "--n_kv_head=null", "--bias=true")
    models = {wrap: built(wrap, *shape) for wrap in ("none", "fsdp")}
    sharded = {name: isinstance(p, DTensor) for name, p in models["fsdp"][0].named_parameters()}
    assert sharded == {name: p.dim() >= 2 for name, p in models["none"][0].named_parameters()}
    assert sum(sharded.values()) < len(sharded) / 2  # GPT-2: most of its tensors are vectors
    assert len(models["fsdp"][0]._get_fsdp_state()._fsdp_param_group.fsdp_params) == sum(sharded.values())
    x, losses = torch.randint(0, 256, (2, 16)), {}
    for wrap, (model, cfg, topo) in models.items():
        with train_fsdp.forward_context(cfg, topo)():
            losses[wrap] = model(x, x)[1]
        losses[wrap].backward()
    assert losses["fsdp"].item() == pytest.approx(losses["none"].item(), rel=1e-4)
    vectors = [p for p in models["fsdp"][0].parameters() if not isinstance(p, DTensor)]
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in vectors)
    offloaded, _, _ = built("fsdp", "--cpu_offload=true")
    assert all(isinstance(p, DTensor) for p in offloaded.parameters())


@pytest.mark.parametrize("wrap", ["none", "ddp", "fsdp"])
def test_val_loss_and_samples_compute_in_the_training_dtype(wrap, one_process_group, corpus):
    """Evaluation and text samples run in the context training's forwards run in: bf16 matmuls in
    every wrapping (unwrapped and DDP ran them in fp32 before)."""
    from fsdp_gpt.data.tokenizer import ByteTokenizer
    model, cfg, topo = built(wrap, "--sample_tokens=4")
    gpt = getattr(model, "module", model)
    seen = []
    gpt.blocks[0].attn.c_attn.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    meta = prepare_data(corpus["data_path"], yaml.safe_load(corpus["data_source"]), "bytes")
    loader = BatchLoader({"data": (corpus["data_path"], meta)}, cfg.block_size, cfg.train_batch, cfg.micro_batch, 0, 1,
                         cfg.seed, topo.device)
    train_fsdp.evaluate(model, gpt, loader, cfg, ByteTokenizer(), {}, train_fsdp.forward_context(cfg, topo))
    assert seen and set(seen) == {torch.bfloat16}, seen
    assert len(seen) == 2 + 4  # two val micro-batches, four sampled tokens


def test_grouped_query_attention_avoids_the_math_kernel(monkeypatch):
    """On CUDA, SDPA takes enable_gqa on the flash kernel alone; where flash can't run the key/value
    heads are repeated instead (the memory-efficient kernel runs), with the same result."""
    def q(device, dtype, head_dim=64):
        return types.SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(2, 4, 16, head_dim))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    assert model_module.sdpa_takes_gqa(q("cuda", torch.bfloat16))
    assert not model_module.sdpa_takes_gqa(q("cuda", torch.float32))
    assert not model_module.sdpa_takes_gqa(q("cuda", torch.bfloat16, head_dim=12))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))  # a V100
    assert not model_module.sdpa_takes_gqa(q("cuda", torch.float16))
    assert model_module.sdpa_takes_gqa(q("cpu", torch.float32))
    torch.manual_seed(0)
    attention = model_module.CausalSelfAttention(GPTConfig(arch="llama", n_head=4, n_kv_head=2, n_embd=32), layer=0)
    x, rope = torch.randn(2, 16, 32), rope_module.rotary(GPTConfig(arch="llama", n_head=4, n_embd=32), torch.arange(16),
                                                          10000.0, None)
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda q, k, v, **kw: (
        calls.append((k.shape[1], kw["enable_gqa"])), sdpa(q, k, v, **kw))[1])
    grouped = attention(x, rope)
    monkeypatch.setattr(model_module, "sdpa_takes_gqa", lambda q: False)
    torch.testing.assert_close(attention(x, rope), grouped)
    assert calls == [(2, True), (4, False)]  # 2 key/value heads grouped natively, then repeated to 4


@pytest.mark.parametrize("name, bf16, fp32", [
    ("NVIDIA L40", 181e12, 90.5e12), ("NVIDIA L4", 121e12, 60e12), ("NVIDIA H100 PCIe", 756e12, 378e12),
    ("NVIDIA H100 80GB HBM3", 989e12, 494e12), ("NVIDIA H200", 989e12, 494e12), ("NVIDIA GH200 480GB", 989e12, 494e12),
    ("NVIDIA B200", 2250e12, 1100e12), ("Tesla V100-SXM2-16GB", 125e12, 15.7e12), ("NVIDIA Future GPU", None, None)])
def test_mfu_peak_by_exact_gpu_name_and_compute_dtype(name, bf16, fp32):
    """dtype: fp32 is measured against the TF32 peak (plain FP32 on V100 and T4), not bf16's."""
    assert peak_flops.gpu_peak_flops(name, torch.bfloat16) == peak_flops.gpu_peak_flops(name, torch.float16) == bf16
    assert peak_flops.gpu_peak_flops(name, torch.float32) == fp32


@pytest.mark.parametrize("version, variable", [("2.8.0", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
                                               ("2.11.0+cu130", "TORCH_FR_BUFFER_SIZE"), ("2.13.0", "TORCH_FR_BUFFER_SIZE")])
def test_flight_recorder_sized_by_the_name_its_torch_reads(version, variable, monkeypatch):
    """torch 2.11 warned at every process group of the H200 run while the old name was set; 2.8
    knows only the old one. Exactly one of the two is set."""
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion(version))
    settings = nccl_failure_settings("run")
    assert settings[variable] == "2000"
    assert {"TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"} & set(settings) == {variable}


def test_nccl_is_bound_to_its_gpu_unless_gloo_shares_the_group():
    """cpu_offload's cuda:nccl,cpu:gloo group stays unbound: DeviceMesh then makes sub-groups with
    new_group, not with split_group (which asserted on a two-backend parent in torch 2.8)."""
    gpu = torch.device("cuda", 1)
    assert launch.bound_device(gpu, launch.backend_for("cuda", cpu_offload=False)) == gpu
    assert launch.bound_device(gpu, launch.backend_for("cuda", cpu_offload=True)) is None
    assert launch.bound_device(torch.device("cpu"), "gloo") is None


def test_newton_schulz_in_bf16_only_where_bf16_is_native(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)  # V100
    assert not precision.native_bf16(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # A100
    assert precision.native_bf16(torch.device("cuda", 0)) and not precision.native_bf16(torch.device("cpu"))
    g = torch.randn(32, 48, generator=torch.Generator().manual_seed(0))
    fp32 = muon.orthogonalise(g.clone())
    monkeypatch.setattr(muon, "native_bf16", lambda device: True)  # as on an A100: the iteration runs in bf16
    bf16 = muon.orthogonalise(g.clone())
    assert not torch.equal(bf16, fp32)
    torch.testing.assert_close(bf16, fp32, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("wrap", ["none", "fsdp"])
def test_soft_cap_runs_in_fp32_under_bf16(wrap, one_process_group):
    """Under autocast (unwrapped) and FSDP's bf16 parameters alike, the LM head's bf16 logits are
    capped in fp32."""
    model, cfg, topo = built(wrap, "--logit_softcap=15")
    gpt = getattr(model, "module", model)
    head = []
    gpt.lm_head.register_forward_hook(lambda module, args, out: head.append(out))
    with train_fsdp.forward_context(cfg, topo)():
        logits, _ = model(torch.randint(0, 256, (2, 16)))
    assert head[0].dtype == torch.bfloat16 and logits.dtype == torch.float32
    torch.testing.assert_close(logits, 15 * torch.tanh(head[0].float() / 15), rtol=0, atol=0)


class HostToDevice(TorchDispatchMode):
    """Counts the copies of host tensors to another device (the meta device stands in for a GPU)."""

    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sources = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if isinstance(out, torch.Tensor) and out.device.type == "meta" and any(t.device.type == "cpu" for t in sources):
            self.copies += 1
        return out


def test_evaluation_copies_from_the_host_once_per_forward(corpus):
    """Val loss: the rows of each micro-batch (the padding weights are made on the device);
    multiple-choice: each forward's tokens, targets and mask in one copy."""
    meta_device = torch.device("meta")
    with meta_device:
        gpt = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=16))
    meta = prepare_data(corpus["data_path"], yaml.safe_load(corpus["data_source"]), "bytes")
    loader = BatchLoader({"data": (corpus["data_path"], meta)}, 32, 8, 2, 0, 1, 7, meta_device)
    items = [Item(context=list(range(1, 4 + i)), choices=[[5, 6], [7] * (1 + i % 3)], label=i % 2) for i in range(6)]
    with torch.no_grad(), HostToDevice() as counter:
        val_loss_sums(gpt, loader, 8)
        assert counter.copies == 4  # 8 windows in micro-batches of 2
        mc_sums(gpt, items, 32, 2, 0, 1, meta_device)
        assert counter.copies == 4 + 3  # 6 items, 2 a forward


def test_multiple_choice_forwards_run_eager_under_compiled_blocks():
    """Each new row width would compile a graph of its own (8 entries before torch gives up)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=16))
    for block in gpt.blocks:
        block.compile(backend="eager")  # dynamo's capture without inductor: what is counted here
    items = [Item(context=list(range(1, 3 + i)), choices=[[5, 6], [7] * (1 + i)], label=0) for i in range(4)]
    graphs = torch._dynamo.utils.counters["stats"]
    with torch.no_grad():
        mc_sums(gpt, items, 32, 1, 0, 1, torch.device("cpu"))
        assert graphs["unique_graphs"] == 0
        gpt(torch.randint(0, 64, (1, 8)))  # outside the multiple-choice eval the blocks compile
    assert graphs["unique_graphs"] > 0
    torch._dynamo.reset()


def test_srun_without_torchrun_is_refused(tmp_path):
    env = {"RANK": None, "WORLD_SIZE": None, "SLURM_NTASKS": "8", "SLURM_PROCID": "3"}
    result = conftest.launch([TRAINER, DEMO], tmp_path, env=env, timeout=120)  # not the launch module imported above
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: started as 8 SLURM tasks without torchrun: start one task per node that runs torchrun "
        "(the README's SLURM script)"]


@pytest.mark.slow
def test_gpu_check_runs_as_is_and_writes_one_table(corpus, tmp_path):
    """bench/gpu_check.sh end to end at tiny size on the CPU (compile off: the plumbing, not the
    compiler, is what is checked here): every one-device row passes (the resume's first step
    bitwise), the 2-GPU rows say why they did not run, the machine line ends the table; the table and
    the logs are copied where a lent machine's call brings files back from (GPU_CHECK_KEEP)."""
    # the byte vocabulary, not the rows' 50,304: its head in bf16 on a CPU took 1 s a step, most of a row's time
    tiny = [f"--{k}={v}" for k, v in dict(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=256,
                                           train_batch=8, micro_batch=4, max_iters=4, warmup_iters=1, lr_decay_iters=4,
                                           log_interval=1, eval_interval=4, eval_iters=1, save_interval=2,
                                           compile="false", **corpus).items()]
    result = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_check.sh"), *tiny], capture_output=True,
                            text=True, timeout=600, env=dict(os.environ, GPU_CHECK_DIR=str(tmp_path),
                                                             GPU_CHECK_KEEP=str(tmp_path / "back"), **zygote_python()))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = (tmp_path / "table.md").read_text().splitlines()
    assert table[:2] == ["| run | what it runs | tok/s | MFU | peak memory, GB | result |",
                         "| --- | --- | --- | --- | --- | --- |"]
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in table[2:] if line.startswith("| ")}
    for name in ("fsdp_bf16", "fsdp_resume", "fsdp_compile", "recipe_muon", "moe", "demo", "doc_mask", "ring_1gpu"):
        assert rows[name][-1] == "pass |" and rows[name][2], rows[name]
    for name in ("one_gpu_fp32", "2gpu_fp32", "2gpu_hybrid", "2gpu_no_shard", "2gpu_offload", "2gpu_ep", "2gpu_ring"):
        assert rows[name][-1] == "not run: needs 2 GPUs, found 0 |"
    assert "mesh (shard=1)" in (tmp_path / "fsdp_bf16.log").read_text()  # wrapped in FSDP2 at one process
    assert "resumed from" in (tmp_path / "fsdp_resume.log").read_text()
    assert table[-1].endswith(f"no GPU, 0 GPU(s), torch {torch.__version__}, CUDA {torch.version.cuda}. GPU tests: "
                              f"not run: torch sees no GPU")
    assert sorted(os.listdir(tmp_path / "back")) == ["logs.tar.gz", "table.md"]
    with tarfile.open(tmp_path / "back" / "logs.tar.gz") as logs:
        assert {"fsdp_bf16.log", "fsdp_resume.log", "ring_1gpu.log"} <= set(logs.getnames())

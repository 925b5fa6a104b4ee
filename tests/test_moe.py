"""Mixture-of-experts MLPs: the layer against a token-by-token reference, the grouped matmul against a
matmul per expert, routing that leaves experts (or all but one) without tokens, the balancing loss and
bias; then trained runs: 2 and 3 ranks against one process, the bitwise and the resharded resume, and
the tools on an MoE checkpoint."""
import json
import os

import pytest
import torch

import fsdp_gpt.moe as moe_module
from conftest import (ROOT, assert_quiet, checkpoint_of, evaluated, hf_val_loss, launch, launcher_once, run_trainer,
                      scalars, stderr_of, tool)
from test_bad_input import assert_one_line_error
from fsdp_gpt import doc_tables
from fsdp_gpt.compat import torch_version
from fsdp_gpt.config import UserError
from fsdp_gpt.hf_format import hf_config, hf_model_keys, to_hf
from fsdp_gpt.model import GPT, GPTConfig
from fsdp_gpt.optim.expert_balance import ExpertBalance

SMALL = dict(arch="llama", vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def moe_model(**options) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**(SMALL | dict(moe_experts=4, moe_top_k=2) | options)))


def reference(moe, x: torch.Tensor) -> torch.Tensor:
    """Each token on its own: the weighted sum of its top-k experts, plus the shared experts."""
    chosen, weights, _ = moe.route(x)
    w1, w2 = moe.experts.c_fc, moe.experts.c_proj
    rows = []
    for token, experts, gates in zip(x, chosen, weights):
        out = sum(g * (w2[e] @ moe.experts.activation(w1[e] @ token)) for e, g in zip(experts.tolist(), gates))
        rows.append(out + (moe.shared(token) if moe.shared is not None else 0))
    return torch.stack(rows)


@pytest.mark.parametrize("options", [dict(), dict(moe_shared=1, moe_score="sigmoid"), dict(moe_norm_top_k=False)])
def test_the_layer_is_each_tokens_weighted_experts(options):
    moe = moe_model(**options).blocks[0].mlp
    x = torch.randn(3, 5, 32)
    assert torch.allclose(moe(x).view(15, 32), reference(moe, x.view(15, 32)), atol=1e-5)


def test_every_token_to_two_experts_and_the_grouped_matmul_equals_one_per_expert(monkeypatch):
    """A bias that sends every token to experts 0 and 1 leaves 2 and 3 without a row; forward and
    gradients alike through torch._grouped_mm (torch 2.13 on CPU) and through a matmul per expert."""
    moe = moe_model().blocks[0].mlp
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))  # selection only: the weights stay the scores'
    x = torch.randn(2, 8, 32)
    assert moe_module.grouped_mm_runs(x, moe.experts.c_fc) == (torch_version() >= (2, 13))
    results = []
    for per_expert in (False, True):
        if per_expert:
            monkeypatch.setattr(moe_module, "grouped_mm_runs", lambda *args: False)
        moe.zero_grad()
        inputs = x.clone().requires_grad_()
        y = moe(inputs)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append((y.detach(), inputs.grad, moe.experts.c_fc.grad.clone(), moe.router.weight.grad.clone()))
    for got, expected in zip(*results):
        assert torch.allclose(got, expected, atol=1e-6)
    assert results[0][2][2:].abs().sum() == 0 and results[0][2][:2].abs().sum() > 0  # experts 2, 3 got no token
    assert moe.pending[:4].tolist() == [32.0, 32.0, 0.0, 0.0]  # each forward counted its 16 tokens per expert


def test_under_autocast_the_experts_compute_in_its_dtype():
    """torch._grouped_mm is no autocast op: fp32 rows (a norm's output) and fp32 weights are cast to
    autocast's dtype, else a GPU ran the experts as fp32 matmuls, one per expert, after a host sync."""
    x, w = torch.randn(6, 32), torch.randn(4, 16, 32)
    counts = torch.tensor([1, 2, 0, 3])
    with torch.autocast("cpu", torch.bfloat16):
        out = moe_module.expert_matmul(x, w, counts)
    assert out.dtype == torch.bfloat16
    assert moe_module.expert_matmul(x, w, counts).dtype == torch.float32  # no autocast: as given


def test_the_balancing_loss_changes_the_gradient_not_the_loss():
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    results = {}
    for coefficient in (0.0, 0.5):
        model = moe_model(moe_aux_loss=coefficient)
        loss = model(x, y)[1]
        loss.backward()
        results[coefficient] = loss.item(), model.blocks[0].mlp.router.weight.grad
    assert results[0.0][0] == results[0.5][0]
    assert not torch.allclose(results[0.0][1], results[0.5][1])
    uniform = moe_model()  # a router of zeros scores every expert alike: the loss is top_k at any split
    with torch.no_grad():
        for moe in uniform.moe_layers():
            moe.router.weight.zero_()
    uniform(x, y)
    assert [m.aux_loss.item() for m in uniform.moe_layers()] == pytest.approx([2.0, 2.0])


def test_the_bias_moves_towards_the_mean_load_and_checkpointing_keeps_the_shares():
    model = moe_model(moe_dense_layers=1)
    balance = ExpertBalance(model, bias_rate=0.01, device=torch.device("cpu"))
    x = torch.randint(0, 64, (4, 16))
    model(x)
    model(x)
    balance.step()
    once = balance.shares.clone()
    assert once.sum().item() == pytest.approx(1.0) and list(balance.layers) == [1]
    bias = model.blocks[1].mlp.expert_bias
    assert torch.equal(bias, 0.01 * torch.sign(0.25 - once[0]))  # under the mean load: up; over it: down
    model.activation_checkpointing = True  # each forward may run twice: the counts double, the shares hold
    with torch.no_grad():
        bias.zero_()
    for _ in range(2):
        model(x, x)[1].backward()
    balance.step()
    assert torch.equal(balance.shares, once)
    figures = balance.scalars()
    assert not doc_tables.undeclared(figures, [ExpertBalance]) and not doc_tables.unwritten(figures, ExpertBalance)
    assert figures["moe/layer1/busiest"] == pytest.approx(4 * once.max().item())
    assert figures["moe/layer1/bias_range"] == pytest.approx((bias.max() - bias.min()).item())
    assert figures["moe/layer1/bias_range"] > 0


@pytest.mark.parametrize("options, refusal", [
    (dict(qk_norm=True, moe_shared=1), "moe_shared: 1: Qwen3MoeForCausalLM has no shared experts"),
    (dict(qk_norm=True, moe_score="sigmoid"), "moe_score: sigmoid: Qwen3MoeForCausalLM scores experts by"),
    (dict(qk_norm=True), "moe_bias_rate trained a selection bias"),
])
def test_what_qwen3_moe_cannot_express_is_refused(options, refusal):
    model = moe_model(**options)
    with torch.no_grad():
        model.blocks[1].mlp.expert_bias[0] = 0.01
    with pytest.raises(UserError, match=refusal):
        hf_config(model.config, eot=0) and to_hf(model.state_dict(), model.config)  # export_hf.py's order


def test_a_qwen3_moe_folder_with_dense_layers_between_its_experts_is_refused(tmp_path):
    keys = hf_config(GPTConfig(**(SMALL | dict(n_layer=4, qk_norm=True, moe_experts=4))), eot=0)
    keys |= dict(architectures=["Qwen3MoeForCausalLM"], decoder_sparse_step=2)
    (tmp_path / "config.json").write_text(json.dumps(keys))
    with pytest.raises(UserError, match=r"has dense MLPs between its MoE layers \(decoder_sparse_step=2"):
        hf_model_keys(str(tmp_path))


def test_muon_orthogonalises_each_expert_on_its_own():
    from fsdp_gpt.optim.muon import is_muon_matrix, neuron_normalised, orthogonalise
    stacked = torch.randn(3, 8, 20)
    assert torch.allclose(orthogonalise(stacked), torch.stack([orthogonalise(m) for m in stacked]), atol=1e-6)
    with_moments = torch.cat([stacked, torch.rand(3, 8, 1)], dim=-1)  # NorMuon's row moments as a last column
    assert torch.allclose(neuron_normalised(with_moments, "quintic", 0.95),
                          torch.stack([neuron_normalised(m, "quintic", 0.95) for m in with_moments]), atol=1e-6)
    names = {name for name, p in moe_model().named_parameters() if is_muon_matrix(name, p.shape)}
    assert "blocks.0.mlp.experts.c_fc" in names and "blocks.0.mlp.router.weight" not in names


def test_the_gradient_norm_over_the_experts_mesh_and_the_others_takes_one_all_reduce(one_process_group):
    """Expert parallelism leaves gradients on two meshes (HYBRID_SHARD's replicas on both): their global
    norm in one collective, each rank's slice counted once, and every gradient scaled by max_norm / norm."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode
    from fsdp_gpt.optim.clip import clip_gradients
    meshes = (init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")),
              init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("replicate", "efsdp", "ep")))
    placements = ([Replicate(), Shard(0)], [Replicate(), Shard(0), Shard(0)])
    grads = (torch.randn(3, 4), torch.randn(2, 4, 4))
    model = torch.nn.ParameterList([torch.nn.Parameter(DTensor.from_local(torch.zeros_like(g), mesh, where))
                                    for g, mesh, where in zip(grads, meshes, placements)])
    for p, g, mesh, where in zip(model, grads, meshes, placements):
        p.grad = DTensor.from_local(g.clone(), mesh, where)
    with CommDebugMode() as comms:
        norm = clip_gradients(model, max_norm=1.0)
    assert comms.get_total_counts() == 1
    expected = torch.cat([g.flatten() for g in grads]).norm()
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6) and expected > 1
    for p, g in zip(model, grads):
        assert torch.allclose(p.grad.to_local(), g / expected, rtol=1e-5)


def test_active_parameters_and_flops_count_the_top_k_experts():
    model = moe_model(moe_shared=1)
    expert = 3 * 32 * model.config.moe_hidden  # gate, up and down of one expert
    assert model.idle_expert_params() == 2 * expert * 2  # 2 layers x (4 - 2) experts idle per token
    dense = GPT(GPTConfig(**(SMALL | dict(ffn_hidden=2 * model.config.moe_hidden))))
    # the same active MLP width as the dense model's, plus a router and a shared expert per layer
    extra = 2 * (32 * 4 + expert)
    assert model.flops_per_token() == dense.flops_per_token() + 6 * extra


# --- trained runs -------------------------------------------------------------------------------

MOE = dict(arch="llama", n_head=4, n_kv_head=2, moe_experts=4, moe_top_k=2, moe_shared=1, moe_dense_layers=1,
           moe_aux_loss=0.01, moe_bias_rate=0.001, n_layer=3, train_batch=24, max_iters=6, save_interval=3,
           eval_interval=3)
LAYOUTS = {  # name: (ranks, settings)
    "one": (1, dict(checkpoint_type="full")),
    # 4 experts over 3 ranks: 2, 2 and none of each MoE layer's
    "three": (3, dict(checkpoint_type="sharded")),
    "muon_one": (1, dict(optimizer="muon", normuon=True)),
    "muon_three": (3, dict(optimizer="muon", normuon=True)),
    # expert parallelism: 2 experts a rank, none shared (FSDP's group of one per expert group); 2
    # experts an expert group, 1 a rank after FSDP's sharding, replicated over HYBRID_SHARD's 2
    # shard groups; one expert a rank; beside context parallelism (which takes no auxiliary loss)
    "ep2": (2, dict(ep_size=2, checkpoint_type="sharded")),
    "ep2_hybrid": (4, dict(ep_size=2, sharding_strategy="HYBRID_SHARD", fsdp_size=2)),
    "ep4_muon": (4, dict(ep_size=4, optimizer="muon", normuon=True, checkpoint_type="full")),
    "no_aux_one": (1, dict(moe_aux_loss=0.0)),
    "ep2_cp2": (4, dict(ep_size=2, cp_size=2, moe_aux_loss=0.0)),
    "ep2_cp2_ring": (4, dict(ep_size=2, cp_size=2, cp_mode="ring", moe_aux_loss=0.0)),
}


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    launch = launcher_once(tmp_path_factory, "moe", **(MOE | corpus))
    return lambda name: launch(name, LAYOUTS[name][0], **LAYOUTS[name][1])


def logged(run_dir: str, tag: str) -> dict:
    return scalars(os.path.join(run_dir, "tb"), tag)


def logged_val(run_dir: str) -> float:
    return logged(run_dir, "val/loss")[0]


AUX = "moe/layer1/aux_loss"  # the logged balancing loss: each rank's own tokens', so a row split by cp_size differs


@pytest.mark.slow
@pytest.mark.parametrize("reference, layout", [("one", "three"), ("muon_one", "muon_three"), ("one", "ep2"),
                                               ("one", "ep2_hybrid"), ("muon_one", "ep4_muon"), ("no_aux_one", "ep2_cp2"),
                                               ("no_aux_one", "ep2_cp2_ring")])
def test_n_ranks_train_the_run_of_one_process(reference, layout, runs):
    """The gradient norm too: Adam's update hardly changes if an expert's gradient is off by a factor
    (expert parallelism's first gradients were ep_size times too small at FSDP groups of one)."""
    reference, got = runs(reference), runs(layout)
    for tag in ("train/loss", "train/grad_norm", "val/loss", "moe/layer2/bias_range", *[AUX] * ("cp2" not in layout)):
        assert sorted(logged(got, tag)) == sorted(logged(reference, tag)), tag
        for step, value in logged(reference, tag).items():
            assert logged(got, tag)[step] == pytest.approx(value, rel=1e-4, abs=1e-7), (tag, step)
    # the loads are counts of the same tokens routed alike: equal
    assert logged(got, "moe/layer1/busiest") == logged(reference, "moe/layer1/busiest")
    assert logged(reference, "train/loss")[6] < logged(reference, "train/loss")[1] - 0.3  # it trains
    assert logged(reference, "moe/layer2/bias_range")[6] > 0  # the balancing moved the bias
    with open(os.path.join(reference, "stdout.txt")) as f:
        printed = f.read()
    assert "active per token" in printed and "experts busiest" in printed
    assert_quiet(stderr_of(got))  # no torch warning: the gradient norm over two meshes takes one all-reduce


@pytest.mark.slow
def test_the_resume_is_bitwise_and_resharding_keeps_the_run(runs, corpus, tmp_path):
    """The 3-rank sharded set at step 3: resumed on 3 ranks, bit for bit; on 2, within 1e-4."""
    original = runs("three")
    path = checkpoint_of(original, "sharded", 3, rank=0)
    # resharded onto 2 ranks with activation checkpointing (each forward twice) and compile
    for nproc, folder, switches in ((3, tmp_path / "same", {}),
                                    (2, tmp_path / "resharded", dict(activation_checkpointing=True, compile=True))):
        folder.mkdir()
        result = run_trainer(str(folder), nproc=nproc, resume_from=path, **(MOE | corpus | LAYOUTS["three"][1] | switches))
        assert "recompile_limit" not in result.stderr  # a matmul per expert (fp32 here) runs eager inside the blocks
        got, expected = logged(str(folder), "train/loss"), logged(original, "train/loss")
        assert sorted(got) == [4, 5, 6]
        for step in got:
            assert (got[step] == expected[step]) if nproc == 3 else got[step] == pytest.approx(expected[step], rel=1e-4)
        bias = logged(str(folder), "moe/layer2/bias_range")
        assert bias == pytest.approx({s: v for s, v in logged(original, "moe/layer2/bias_range").items() if s > 3})


@pytest.mark.slow
def test_expert_parallel_checkpoints_resume_on_any_layout(runs, corpus, tmp_path):
    """ep_size 2's sharded set at step 3: on its own layout bit for bit, and with activation
    checkpointing and compile (the dispatch recomputed, eager inside the compiled blocks) within 1e-4;
    on 4 ranks with ep_size 4 and on one process within 1e-4. ep_size 4's full checkpoint: read by
    a plain process."""
    original = runs("ep2")
    path = checkpoint_of(original, "sharded", 3, rank=0)
    expected = logged(original, "train/loss")
    compiled = dict(activation_checkpointing=True, compile=True)
    for name, nproc, ep_size, switches in (("same", 2, 2, {}), ("compiled", 2, 2, compiled), ("ep4", 4, 4, {}),
                                           ("one", 1, 1, {})):
        folder = tmp_path / name
        folder.mkdir()
        result = run_trainer(str(folder), nproc=nproc, resume_from=path,
                             **(MOE | corpus | LAYOUTS["ep2"][1] | dict(ep_size=ep_size) | switches))
        assert "recompile_limit" not in result.stderr  # the dispatch runs eager: no recompile per routing
        got = logged(str(folder), "train/loss")
        assert sorted(got) == [4, 5, 6]
        for step in got:
            assert (got[step] == expected[step]) if name == "same" else got[step] == pytest.approx(expected[step], rel=1e-4)
        assert logged(str(folder), "train/grad_norm")[6] == pytest.approx(logged(original, "train/grad_norm")[6], rel=1e-4)
    full = checkpoint_of(runs("ep4_muon"), "full", 6)
    assert evaluated(full) == pytest.approx(logged(runs("ep4_muon"), "val/loss")[6], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_expert_parallel_layer_is_the_whole_model_on_one_rank(nproc, tmp_path):
    """Outputs, loss and every gradient (tests/ep_probe.py) within float rounding, also where every
    token goes to expert 0 (every other rank receives no row) or to the last rank's two."""
    result = launch([os.path.join(ROOT, "tests", "ep_probe.py")], str(tmp_path), nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    experts = 2 * nproc
    assert report["all to expert 0"]["counts"] == [32.0] + [0.0] * (experts - 1)
    assert report["all to the last two"]["counts"] == [0.0] * (experts - 2) + [32.0, 32.0]
    assert all(0 < count < 32 for count in report["routed"]["counts"][:2])
    for case, figures in report.items():
        assert figures["largest"] < 1e-6, (case, figures)


@pytest.mark.slow
def test_the_tools_read_an_moe_checkpoint(runs, corpus, tmp_path):
    checkpoint = checkpoint_of(runs("one"), "full", 6)
    assert evaluated(checkpoint) == pytest.approx(logged(runs("one"), "val/loss")[6], rel=1e-5)
    text = tool("sample.py", checkpoint, "--max_new_tokens", "16", "--seed", "1")
    assert text.strip() and text == tool("sample.py", checkpoint, "--max_new_tokens", "16", "--seed", "1")
    refused = launch([os.path.join(ROOT, "export_hf.py"), checkpoint, str(tmp_path / "hf")], ROOT)
    assert_one_line_error(refused, "qk_norm: False: Qwen3MoeForCausalLM normalises q and k")
    other = run_trainer(str(tmp_path), resume_from=checkpoint, check=False, **(MOE | corpus | dict(moe_experts=8)))
    assert_one_line_error(other, "has moe_experts=4 but the config has moe_experts=8", "--moe_experts=4")


@pytest.mark.slow
def test_exported_as_qwen3_moe_and_started_from(corpus, tmp_path):
    """A run with the auxiliary loss only (no bias, no shared experts: Qwen3-MoE's features):
    transformers' val loss of the export is evaluate.py's, and a run started from the folder
    (init_from, every MoE key from its config.json) begins there."""
    settings = MOE | corpus | dict(qk_norm=True, moe_shared=0, moe_bias_rate=0.0, max_iters=3, checkpoint_type="full")
    run_trainer(str(tmp_path), **settings)
    out = tmp_path / "hf"
    assert "Qwen3MoeForCausalLM" in tool("export_hf.py", checkpoint_of(str(tmp_path), "full", 3), out)
    logged = evaluated(checkpoint_of(str(tmp_path), "full", 3))
    assert hf_val_loss(out, corpus, "Qwen3MoeForCausalLM", MOE["train_batch"]) == pytest.approx(logged, rel=1e-5)
    started = tmp_path / "started"
    started.mkdir()
    keys = {k: v for k, v in settings.items() if not k.startswith("moe_")}  # the folder's config.json gives them
    result = run_trainer(str(started), **(keys | dict(max_iters=0, init_from=str(out))))
    assert "moe_experts: 4" in result.stdout and "moe_dense_layers: 1" in result.stdout
    assert logged_val(str(started)) == pytest.approx(logged, rel=1e-5)

"""FP8 matmuls (fp8) through torchao, emulated on the CPU: which linears convert, each converted
layer's numerics against high precision, the scales of FSDP2's float8 all-gather and the plain
tensors checkpoints hold, N ranks against one process, resumes (bitwise, resharded, to and from runs
without fp8, where torchao is not installed), the tools on an FP8 run's checkpoints, the refusals."""
import copy
import dataclasses
import os
import sys

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._pytree import tree_leaves

import train_fsdp
from conftest import (DEMO, ROOT, RUN, TINY, assert_quiet, checkpoint_of, launch, launcher_once, overrides,
                      run_trainer, scalars, stderr_of)
from fsdp_gpt import compat
from fsdp_gpt.config import TrainConfig
from fsdp_gpt.config_parse import parse_args
from fsdp_gpt.distributed.float8 import Float8Scales, candidates, convert, gathered_in_fp8, pays, plain, torchao_float8
from fsdp_gpt.distributed.launch import Topology
from fsdp_gpt.model import GPT, GPTConfig
from test_bad_input import one_line, train_in_process

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
FP8 = dict(fp8="tensorwise", fp8_emulate=True, fp8_layers="all")
WITHOUT_TORCHAO = {"WITHOUT_TORCHAO": "1"}  # ranks forked from a zygote that can't find torchao (tests/without_torchao.py)


def float8():
    """torchao.float8, or the test skipped saying why (the refusals where it can't run: below)."""
    if not compat.float8_training():
        pytest.skip(f"torchao 0.18's float8 training needs torch 2.11+, this is {torch.__version__}")
    try:
        return torchao_float8()
    except ImportError:
        pytest.skip('torchao is not installed: pip install -e ".[fp8]"')


def converted(model) -> list[str]:
    return [name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


def on_meta(wrap="none", shard_ranks=1, **keys) -> tuple[GPT, str]:
    """A model as build_model converts it on the meta device, and the start-up line."""
    float8()
    cfg = TrainConfig(**(dict(vocab_size=256) | keys))
    with torch.device("meta"):
        model = GPT(GPTConfig.of(cfg))
    return model, convert(model, cfg, wrap, shard_ranks)


def test_which_linears_run_in_fp8():
    tiny = {k: TINY[k] for k in ("n_layer", "n_head", "n_embd", "block_size")}
    moe, note = on_meta(arch="llama", n_kv_head=1, moe_experts=4, moe_shared=1, **tiny, **FP8)
    assert converted(moe) == [f"blocks.{i}.{kind}" for i in (0, 1) for kind in
                              ("attn.c_attn", "attn.c_proj", "mlp.shared.c_fc", "mlp.shared.c_proj")]
    assert type(moe.lm_head) is torch.nn.Linear and all(type(m.router) is torch.nn.Linear for m in moe.moe_layers())
    experts = [p for m in moe.moe_layers() for p in m.experts.parameters()]
    assert experts and all(type(p) is torch.nn.Parameter for p in experts)  # grouped, as they were
    assert note == ("fp8 tensorwise (emulated: fp32 matmuls): 8 of 8 block linears in FP8 (attn.c_attn x2, attn.c_proj "
                    "x2, mlp.shared.c_fc x2, mlp.shared.c_proj x2); high precision: the embeddings and LM head, the "
                    "routers and experts of 2 MoE layers")
    small, note = on_meta(**tiny, **FP8 | dict(fp8_layers="auto"))  # torchao's cut-offs leave a tiny model alone
    assert converted(small) == [] and "0 of 8 block linears in FP8; high precision: the embeddings and LM head, 8 by " \
                                      "fp8_layers auto (attn.c_attn x2, " in note
    # at the sizes they were measured for: Llama 3.2 1B all in tensorwise, its 8192-wide c_fc alone in rowwise;
    # GPT-2 124M's c_attn (768 -> 2304) and c_fc (768 -> 3072) pass tensorwise's (N > 1024)
    llama1b = dict(arch="llama", n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, ffn_hidden=8192, vocab_size=128256)
    for shape, recipe, expected in ((llama1b, "tensorwise", "64 of 64"), (llama1b, "rowwise", "16 of 64 block linears "
                                    "in FP8 (mlp.c_fc x16)"), ({}, "tensorwise", "24 of 48 block linears in FP8 "
                                                                                 "(attn.c_attn x12, mlp.c_fc x12)"),
                                    ({}, "rowwise", "0 of 48 block linears in FP8;")):
        assert expected in on_meta("fsdp", fp8=recipe, compile=True, **shape)[1]
    uncompiled = on_meta(fp8="tensorwise")[1]  # on a GPU, where FP8 would cost time
    assert "(uncompiled, torchao's casts run eagerly: slower than without fp8, set compile: true)" in uncompiled


def test_float8_all_gather_takes_the_weights_each_shard_rank_holds_as_many_rows_of():
    """torchao 0.18's float8 all-gather pads no uneven shard (the ranks' gathers hung): at 3 ranks a
    64-wide model's c_attn (192 rows) gathers in FP8, the others (64 and 256 rows) in high precision."""
    tiny = {k: TINY[k] for k in ("n_layer", "n_head", "n_embd", "block_size")}
    for ranks, in_fp8 in ((2, 8), (3, 2), (4, 8), (6, 2)):
        model, note = on_meta("fsdp", ranks, **tiny, **FP8)
        gathers = {name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"
                   and m.config.enable_fsdp_float8_all_gather}
        assert len(converted(model)) == 8 and len(gathers) == in_fp8, ranks
        assert all(model.get_submodule(name).weight.shape[0] % ranks == 0 for name in gathers)
    assert note == ("fp8 tensorwise (emulated: fp32 matmuls; float8 all-gather, scales computed after each step; 6 "
                    "weights all-gathered in high precision, then cast: their rows don't divide by the shard group's 6 "
                    "ranks (attn.c_proj x2, mlp.c_fc x2, mlp.c_proj x2)): 8 of 8 block linears in FP8 (attn.c_attn x2, "
                    "attn.c_proj x2, mlp.c_fc x2, mlp.c_proj x2); high precision: the embeddings and LM head")
    none_even = on_meta("fsdp", 5, **tiny, **FP8)[1]
    assert "(emulated: fp32 matmuls; 8 weights all-gathered in high precision, then cast: their rows" in none_even


def test_auto_keeps_torchaos_cut_offs():
    """pays() against torchao's own filter for the recipes it takes (rowwise_with_gw_hp takes rowwise's)."""
    ao = float8()
    sizes = [16, 1024, 1040, 2048, 2064, 3072, 4096, 4112, 8192]
    for recipe in ("tensorwise", "rowwise"):
        theirs = ao._auto_filter_for_recipe(recipe, filter_fqns=[])
        for n in sizes:
            for k in sizes:
                assert pays(recipe, n, k) == theirs(torch.nn.Linear(k, n, device="meta"), "blocks.0.mlp"), (recipe, n, k)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_each_converted_layer_is_within_torchaos_sqnr(recipe, arch):
    """Every block linear of a 2 x 128 model, emulated FP8 against itself in fp32 on the inputs and
    output gradients the fp32 model gives it: output >= 18 dB, every gradient >= 17 dB (torchao's own
    thresholds, test_base.py); measured 24-29 dB."""
    ao = float8()
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_utils import compute_error
    torch.manual_seed(0)
    model = GPT(GPTConfig(arch=arch, n_layer=2, n_head=4, n_embd=128, block_size=128, vocab_size=256))
    seen = {}
    for name, m in candidates(model).items():
        m.register_forward_hook(lambda m, args, out, name=name: seen.setdefault(name, {}).update(x=args[0].detach()))
        m.register_full_backward_hook(lambda m, grad_in, grad_out, name=name: seen[name].update(g=grad_out[0]))
    idx = torch.randint(0, 256, (4, 128))
    model(idx, idx)[1].backward()
    config = dataclasses.replace(ao.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    for name, m in candidates(model).items():
        results = []
        for linear in (copy.deepcopy(m), Float8Linear.from_float(copy.deepcopy(m), config=config)):
            x = seen[name]["x"].clone().requires_grad_()
            y = linear(x)
            y.backward(seen[name]["g"])
            results.append([y, x.grad] + [p.grad for p in linear.parameters()])
        (y, *grads), (y8, *grads8) = results
        assert compute_error(y, y8) >= 18, (name, "output")
        for which, g, g8 in zip(["input", "weight", "bias"], grads, grads8):
            assert compute_error(g, g8) >= 17, (name, which)


def built_fsdp(*overrides: str):
    """TINY's model as build_model makes it for one process wrapped in FSDP2 (needs one_process_group)."""
    cfg = parse_args([DEMO, "--dtype=fp32", "--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=32",
                      "--vocab_size=256", *overrides])
    topo = Topology(0, 1, 0, 1, torch.device("cpu"), "fsdp", init_device_mesh("cpu", (1,), mesh_dim_names=("shard",)))
    return train_fsdp.build_model(cfg, GPTConfig(**cfg.model_config), topo)


def test_scales_of_the_fp8_gathered_weights_and_checkpoints_of_plain_tensors(one_process_group):
    """Under float8 all-gather each converted weight's shard is torchao's wrapper: Float8Scales gives
    each its scale (e4m3's largest over the weight's amax); what a checkpoint takes of it is the
    plain tensor (one process: the full state dict is the shards themselves)."""
    from fsdp_gpt.checkpoint.ckpt_format import FULL_OPTIONS, piece_of
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    float8()
    model = built_fsdp(*overrides(**FP8))
    weights = [p for p in model.parameters() if gathered_in_fp8(p)]
    assert len(weights) == 8 and model.lm_head.weight is model.wte.weight  # the head stays tied, in high precision
    scales = Float8Scales(model)  # nothing at start-up: the first step's gathers reduce each weight's amax
    assert all(w._local_tensor._precomputed_scale is None for w in weights)
    scales.step()  # after each optimizer step
    for w in weights:
        shard = w._local_tensor  # what FSDP2 gathers (to_local() makes a new wrapper, without the scale)
        amax = shard._tensor.abs().max().item()
        assert shard._precomputed_scale == pytest.approx(torch.finfo(torch.float8_e4m3fn).max / amax)
    full = get_model_state_dict(model, options=FULL_OPTIONS)
    assert {type(v).__name__ for v in full.values()} == {"WeightWithDynamicFloat8CastTensor", "Tensor"}  # why plain() is
    assert {type(plain(v)) for v in full.values()} == {torch.Tensor}
    pieces = [t for w in weights for t in tree_leaves(piece_of(w, 0)) if isinstance(t, torch.Tensor)]
    assert {type(t) for t in pieces} == {torch.Tensor}


def test_refusals_that_need_torch_torchao_and_the_device(corpus, tmp_path, monkeypatch, capsys):
    float8()
    argv = [DEMO] + overrides(**(TINY | corpus | FP8))
    one_line(train_in_process(argv + ["--fp8_emulate=false"], tmp_path, monkeypatch), capsys,
             "fp8: tensorwise needs FP8 matmuls, which the CPU lacks (a GPU of sm89 or newer", "fp8_emulate: true")
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "torchao.float8")
    one_line(train_in_process(argv, tmp_path, monkeypatch), capsys,
             'fp8: tensorwise needs torchao, which is not installed: pip install -e ".[fp8]"')


@pytest.mark.compat
def test_torch_before_2_11_refuses_fp8(corpus, tmp_path, monkeypatch, capsys):
    """On the oldest supported torch (2.8) as it is; on a newer one, told it is 2.10."""
    if compat.float8_training():
        monkeypatch.setattr(compat, "torch_version", lambda: (2, 10))
    argv = [DEMO] + overrides(**(TINY | corpus | FP8))
    one_line(train_in_process(argv, tmp_path, monkeypatch), capsys, "fp8 needs torch 2.11 or newer", "fp8: null")


# Launched runs: TINY for 10 steps, emulated tensorwise on every block linear, sharded checkpoints at 5 and 10
STEPS = dict(max_iters=10, lr_decay_iters=10, eval_interval=5, save_interval=5, checkpoint_type="sharded")
TAGS = ("train/loss", "train/grad_norm", "val/loss")
PARITY = {  # name: (ranks, settings), each against one process
    "FULL_SHARD2": (2, {}),
    "FULL_SHARD4": (4, {}),
    "HYBRID_SHARD2": (2, dict(sharding_strategy="HYBRID_SHARD", fsdp_size=1)),  # two replicas of one shard each
    "HYBRID_SHARD4": (4, dict(sharding_strategy="HYBRID_SHARD", fsdp_size=2)),
    "SHARD_GRAD_OP2": (2, dict(sharding_strategy="SHARD_GRAD_OP", activation_checkpointing=True)),
    "NO_SHARD2": (2, dict(sharding_strategy="NO_SHARD", cpu_offload=True)),  # offloaded: gathered, then cast
    "DDP2": (2, dict(fsdp=False)),
}

UNEVEN = dict(train_batch=12, max_iters=4, lr_decay_iters=4, eval_interval=4, save_interval=1000)


@pytest.fixture(scope="module")
def fp8_run(corpus, tmp_path_factory):
    """fp8_run(name) -> the folder of the run PARITY (or "one", or "resharded") names, launched once."""
    float8()
    launch_once = launcher_once(tmp_path_factory, "fp8", **FP8, **STEPS, **corpus)
    others = {"one": (1, {}), "resharded": (1, dict(force_fsdp=True, checkpoint_type="full")),
              "cp2": (2, dict(cp_size=2)),
              # shard groups of 3 ranks, which divide c_attn's 192 rows alone: 12 rows a step, 4 steps
              "one12": (1, UNEVEN), "FULL_SHARD3": (3, UNEVEN),
              "HYBRID_SHARD6": (6, UNEVEN | dict(sharding_strategy="HYBRID_SHARD", fsdp_size=3)),
              # a mixture's experts over 2 ranks, Muon, HYBRID_SHARD_ZERO2's mesh (1, 2)
              "experts": (2, dict(arch="llama", n_kv_head=1, moe_experts=4, moe_shared=1, ep_size=2, optimizer="muon",
                                  sharding_strategy="HYBRID_SHARD_ZERO2", fsdp_size=2))}

    def run(name: str) -> str:
        if name == "resharded":  # FULL_SHARD2's step 5 on one process in FSDP2, writing full checkpoints
            others[name][1]["resume_from"] = checkpoint_of(run("FULL_SHARD2"), "sharded", 5, rank=0)
        nproc, settings = (PARITY | others)[name]
        return launch_once(name, nproc, **settings)
    return run


def printed(run_dir: str) -> str:
    with open(os.path.join(run_dir, "stdout.txt")) as f:
        return f.read()


def losses(run_dir: str, tag: str = "train/loss") -> dict:
    return scalars(os.path.join(run_dir, "tb"), tag)


def assert_like_one_process(one: str, run: str, first_steps: int, later: float) -> None:
    """Every figure of TAGS the run logged against one process's: val/loss within 3e-4, the training
    figures of the first steps within 1e-6, the later ones within `later`."""
    for tag in TAGS:
        reference, got = losses(one, tag), losses(run, tag)
        assert sorted(got) == sorted(reference)
        for step, value in reference.items():
            close = 3e-4 if tag == "val/loss" else 1e-6 if step <= first_steps else later
            assert got[step] == pytest.approx(value, rel=close), (tag, step, abs(got[step] / value - 1))


@pytest.mark.slow
@pytest.mark.parametrize("name", PARITY)
def test_ranks_match_one_process(name, fp8_run):
    """The first two steps within 1e-6, all ten within 1e-4: FP8's casts amplify the last bits of the
    sharded reductions' sums as steps go on (without fp8 the same runs match to 1e-7; measured here: 2e-5
    for the loss, 6e-5 for the gradient's norm). val/loss within 3e-4 from step 0 (measured 1e-4 at 4
    ranks): ranks take the val windows round-robin, so an eval's micro-batch holds other windows than
    one process's, and an activation's tensorwise scale is its micro-batch's amax."""
    one, run = fp8_run("one"), fp8_run(name)
    assert_like_one_process(one, run, first_steps=2, later=1e-4)
    assert losses(one)[10] < losses(one)[1] - 0.5  # it trains
    how = {"DDP2": "", "NO_SHARD2": "; weights all-gathered in high precision, then cast"}.get(
        name, "; float8 all-gather, scales computed after each step")
    assert f"fp8 tensorwise (emulated: fp32 matmuls{how}): 8 of 8 block linears in FP8" in printed(run)
    if name != "DDP2":  # DDP warns of find_unused_parameters, which parallelize.py sets on purpose
        assert_quiet(stderr_of(run))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["FULL_SHARD3", "HYBRID_SHARD6"])
def test_shard_groups_that_divide_no_width_match_one_process(name, fp8_run):
    """64 rows over 3 ranks: the weights sharded unevenly gather in high precision (in FP8 they hung,
    torchao's shards unpadded), c_attn's in FP8. The first step within 1e-6, the others within 1e-3:
    the 3 ranks' reductions of the first step's gradients differ from one process's in the last bits,
    and a weight's FP8 cast rounds a few elements the other way (measured: 2.7e-4 for step 2's
    gradient norm, the loss 2e-5; the same with every weight gathered in high precision)."""
    run = fp8_run(name)
    assert_like_one_process(fp8_run("one12"), run, first_steps=1, later=1e-3)
    assert ("float8 all-gather, scales computed after each step; 6 weights all-gathered in high precision, then "
            "cast: their rows don't divide by the shard group's 3 ranks") in printed(run)
    assert_quiet(stderr_of(run))


@pytest.mark.slow
def test_context_parallel_is_close_to_one_process(fp8_run):
    """cp_size 2: each rank's activations are half of each row, scaled by their own amax (tensorwise),
    not the whole row's: close to one process, not within 1e-4 as data parallelism is."""
    one, run = losses(fp8_run("one")), losses(fp8_run("cp2"))
    assert "context parallel 2" in printed(fp8_run("cp2")) and sorted(run) == sorted(one)
    for step, value in one.items():
        assert run[step] == pytest.approx(value, rel=1e-3), (step, abs(run[step] / value - 1))  # measured: 2e-4
    assert_quiet(stderr_of(fp8_run("cp2")))


@pytest.mark.slow
def test_experts_over_ranks_stay_in_high_precision_beside_muon(fp8_run):
    run = fp8_run("experts")
    assert ("8 of 8 block linears in FP8 (attn.c_attn x2, attn.c_proj x2, mlp.shared.c_fc x2, mlp.shared.c_proj x2); "
            "high precision: the embeddings and LM head, the routers and experts of 2 MoE layers") in printed(run)
    assert "expert parallel 2" in printed(run) and losses(run)[10] < losses(run)[1] - 0.5
    assert_quiet(stderr_of(run))


@pytest.mark.slow
def test_resume_is_bitwise_and_reshards(fp8_run, corpus, tmp_path):
    """FULL_SHARD2's step-5 checkpoint: at 2 ranks the same losses, bit for bit; on one process wrapped
    in FSDP2 (force_fsdp, float8 all-gather of one rank) within 1e-4."""
    expected = losses(fp8_run("FULL_SHARD2"))
    result = run_trainer(str(tmp_path), nproc=2, resume_from=checkpoint_of(fp8_run("FULL_SHARD2"), "sharded", 5, 0),
                         **FP8, **STEPS, **corpus)
    assert "resumed from" in result.stdout
    got = losses(str(tmp_path))
    assert sorted(got) == [6, 7, 8, 9, 10] and all(got[s] == expected[s] for s in got), (got, expected)
    resharded = losses(fp8_run("resharded"))
    assert sorted(resharded) == [6, 7, 8, 9, 10]
    for step, value in resharded.items():
        assert value == pytest.approx(expected[step], rel=1e-4), step


@pytest.mark.slow
def test_the_runs_without_torchao_find_none(tmp_path):
    """What the tests below rest on: a process of the zygote started with WITHOUT_TORCHAO finds no
    torchao, by import or as transformers asks (the package finders and the installed distributions)."""
    float8()  # installed here, or nothing to hide
    probe = tmp_path / "probe.py"
    probe.write_text("import importlib.metadata, importlib.util\nfrom transformers.utils import is_torchao_available\n"
                     "try:\n    import torchao\nexcept ImportError:\n    print('no import')\n"
                     "print(importlib.util.find_spec('torchao'), list(importlib.metadata.distributions(name='torchao')), "
                     "is_torchao_available())\n")
    result = launch([str(probe)], tmp_path, env=WITHOUT_TORCHAO)
    assert result.stdout.splitlines() == ["no import", "None [] False"], result.stderr[-3000:]


@pytest.mark.slow
def test_fp8_checkpoint_resumes_without_fp8_where_torchao_is_not_installed(fp8_run, corpus, tmp_path):
    expected = losses(fp8_run("FULL_SHARD2"))
    result = run_trainer(str(tmp_path), env=WITHOUT_TORCHAO, resume_from=checkpoint_of(
        fp8_run("FULL_SHARD2"), "sharded", 5, 0), **STEPS, **corpus)
    assert "resumed from" in result.stdout and "block linears in FP8" not in result.stdout
    got = losses(str(tmp_path))
    for step, value in got.items():  # the same run in high precision from step 6 (measured: 5e-5 apart)
        assert value == pytest.approx(expected[step], rel=5e-4), step


@pytest.mark.slow
def test_checkpoint_without_fp8_resumes_with_it(two_rank_runs, corpus, tmp_path):
    float8()  # torchao, or skipped saying why
    result = run_trainer(str(tmp_path), nproc=2, resume_from=checkpoint_of(two_rank_runs["sharded"], "sharded", 3),
                         **RUN, **FP8, **corpus)
    assert "resumed from" in result.stdout and "8 of 8 block linears in FP8" in result.stdout
    expected = losses(two_rank_runs["sharded"])
    got = losses(str(tmp_path))
    assert sorted(got) == [4, 5, 6]
    for step, value in got.items():  # measured: 3e-5 apart
        assert value == pytest.approx(expected[step], rel=5e-4), step


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_tools_take_an_fp8_runs_checkpoints_where_torchao_is_not_installed(kind, fp8_run, tmp_path):
    """evaluate.py, and export_hf.py (full) or sample.py (sharded), on the checkpoints of float8
    all-gather runs (the full file of one rank: where torchao's wrapper would reach the file unwrapped)."""
    run = fp8_run("resharded" if kind == "full" else "FULL_SHARD2")
    path = checkpoint_of(run, kind, 10, rank=0)

    def tool(script, *args):
        result = launch([os.path.join(ROOT, script), path, *map(str, args)], ROOT, env=WITHOUT_TORCHAO)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout
    val_loss = float(tool("evaluate.py").split("val loss ")[1].split()[0])
    assert val_loss == pytest.approx(losses(run, "val/loss")[10], rel=2e-3)  # the logged one ran its matmuls in FP8
    if kind == "full":
        assert "GPT2LMHeadModel" in tool("export_hf.py", tmp_path / "hf")
    else:
        assert tool("sample.py", "--max_new_tokens", 8, "--seed", 1).strip()

"""Muon under FSDP2: the update of torch's single-device Muon, parity of every layout with one
process, momentum in full and sharded checkpoints, resumes bitwise and resharded."""
import json
import os

import pytest
import torch

from fsdp_gpt.checkpoint import ckpt_format
from fsdp_gpt.config import TrainConfig, to_yaml
from conftest import (ROOT, TRAINER, assert_quiet, checkpoint_of, launch, launcher_once, run_trainer, scalars,
                      stderr_of)
from fsdp_gpt.optim.muon import MuonWithAdamW, orthogonalise, rms_matching_scale

# n_embd 66: 4 ranks hold 50/50/50/48 rows of c_attn, 17/17/17/15 of c_proj (uneven slices);
# 24 sequences a step: 1, 2, 3 and 4 ranks take whole micro-batches of 2, with accumulation
MUON = dict(optimizer="muon", n_embd=66, train_batch=24, max_iters=6, eval_interval=3, save_interval=3)
TAGS = ("train/loss", "train/grad_norm", "val/loss")


def test_update_is_torch_muons_with_adamw_matched_rms(one_process_group):
    """Three steps on a tall and a wide matrix: the same change of weights as torch.optim.Muon
    (momentum, Nesterov, weight decay, the match_rms_adamw scale). torch iterates in bf16, this
    optimizer in fp32 on CPU: they differ by bf16's rounding, about 1%."""
    if not hasattr(torch.optim, "Muon"):
        pytest.skip(f"torch.optim.Muon, the reference, arrives in torch 2.9 (this is {torch.__version__})")
    torch.manual_seed(0)
    start = [torch.randn(48, 16), torch.randn(16, 64)]
    theirs, ours = ([w.clone().requires_grad_() for w in start] for _ in range(2))
    reference = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    optimizer = MuonWithAdamW([dict(params=ours, muon=True, weight_decay=0.1, momentum=0.95)],
                              lr=0.02, device=torch.device("cpu"))
    for _ in range(3):
        for a, b in zip(theirs, ours):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        reference.step()
        optimizer.step()
    for w, a, b in zip(start, theirs, ours):
        change, difference = (a - w).detach(), (a - b).detach()
        assert difference.abs().max() < 0.03 * change.abs().max()
        assert not torch.equal(a, w)


@pytest.mark.parametrize("normuon", [None, 0.95])
def test_one_process_orthogonalises_each_shapes_matrices_together(normuon, one_process_group):
    """Five matrices of two shapes: two batched calls a step, and the same weights after three steps
    as each matrix stepped alone (within 1e-6 of the change)."""
    torch.manual_seed(0)
    start = [torch.randn(48, 16) for _ in range(3)] + [torch.randn(16, 64) for _ in range(2)]
    together, alone = ([w.clone().requires_grad_() for w in start] for _ in range(2))
    settings = dict(lr=0.02, device=torch.device("cpu"), normuon=normuon)
    batched = MuonWithAdamW([dict(params=together, muon=True, weight_decay=0.1, momentum=0.95)], **settings)
    singles = [MuonWithAdamW([dict(params=[w], muon=True, weight_decay=0.1, momentum=0.95)], **settings) for w in alone]
    calls = []
    transform = batched.transform
    batched.transform = lambda x: calls.append(x.shape) or transform(x)
    for _ in range(3):
        for a, b in zip(together, alone):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        batched.step()
        for single in singles:
            single.step()
    assert [shape[0] for shape in calls] == [3, 2] * 3
    for w, a, b in zip(start, together, alone):
        assert (a - b).abs().max() <= 1e-6 * (b - w).abs().max()


@pytest.mark.parametrize("coefficients", ["quintic", "polar_express"])
@pytest.mark.parametrize("shape", [(96, 32), (32, 96), (40, 40)])
def test_orthogonalise_brings_singular_values_near_one(shape, coefficients):
    torch.manual_seed(0)
    k = min(shape)
    u, _ = torch.linalg.qr(torch.randn(shape[0], k))
    v, _ = torch.linalg.qr(torch.randn(shape[1], k))
    g = u @ torch.diag(torch.logspace(-2, 0, k)) @ v.T  # singular values over two decades
    s = torch.linalg.svdvals(orthogonalise(g, coefficients))
    low, high = {"quintic": (0.6, 1.25), "polar_express": (0.85, 1.15)}[coefficients]  # Polar Express: closer
    assert low < s.min() and s.max() < high, s


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """name -> folder of a Muon run of 6 steps, each launched once per module."""
    return launcher_once(tmp_path_factory, "muon", **(MUON | corpus))


def logged(run_dir: str) -> dict:
    return {tag: scalars(os.path.join(run_dir, "tb"), tag) for tag in TAGS}


LAYOUTS = {  # name: (ranks, settings)
    "FULL_SHARD": (4, dict(sharding_strategy="FULL_SHARD")),
    "NO_SHARD": (4, dict(sharding_strategy="NO_SHARD")),
    "HYBRID_SHARD": (4, dict(sharding_strategy="HYBRID_SHARD", fsdp_size=2)),
    "FULL_SHARD_3": (3, dict(sharding_strategy="FULL_SHARD")),  # 8 matrices in rounds of 3: an idle owner
    "DDP": (3, dict(fsdp=False, checkpoint_type="full")),  # rounds of 3 again: a replica with no share
    "OFFLOAD": (2, dict(cpu_offload=True, checkpoint_type="sharded")),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [pytest.param(name, marks=[pytest.mark.compat] if name == "OFFLOAD" else [])
                                    for name in LAYOUTS])
def test_every_layout_matches_one_process(layout, runs):
    assert_matches_one_process(runs, layout, LAYOUTS[layout])


def assert_matches_one_process(runs, layout: str, ranks_and_settings: tuple) -> None:
    reference = logged(runs("one", 1))
    nproc, settings = ranks_and_settings
    run_dir = runs(layout, nproc, **settings)
    got = logged(run_dir)
    if settings.get("fsdp", True):  # DDP warns of find_unused_parameters, which parallelize.py sets on purpose
        assert_quiet(stderr_of(run_dir))
    for tag, values in reference.items():
        assert sorted(got[tag]) == sorted(values)
        for step, value in values.items():
            assert got[tag][step] == pytest.approx(value, rel=1e-4), (tag, step)
    assert reference["train/loss"][6] < reference["train/loss"][1] - 0.5  # it trains


def momentum(path: str) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=False)["optimizer"]
    # full checkpoints: {"state": {name: ...}}; sharded: {name: {key: piece}}
    return {name: s for name, s in state.get("state", state).items() if "momentum_buffer" in s}


@pytest.mark.slow
@pytest.mark.parametrize("layout, kind", [("DDP", "full"), ("OFFLOAD", "sharded")])
def test_checkpoints_hold_the_momentum_and_resume_bitwise(layout, kind, runs, corpus, tmp_path):
    nproc, settings = LAYOUTS[layout]
    original = runs(layout, nproc, **settings)
    path = checkpoint_of(original, kind, 3, rank=0)
    buffers = momentum(path)
    assert len(buffers) == 8 and all("blocks." in name for name in buffers)  # 4 matrices x 2 blocks
    result = run_trainer(str(tmp_path), nproc=nproc, resume_from=path, **(MUON | corpus | settings))
    assert f"resumed from {path} at step 3" in result.stdout
    got, expected = logged(str(tmp_path))["train/loss"], logged(original)["train/loss"]
    assert sorted(got) == [4, 5, 6] and all(got[s] == expected[s] for s in got), (got, expected)


@pytest.mark.slow
@pytest.mark.parametrize("source, kind, nproc, settings", [
    ("OFFLOAD", "sharded", 1, {}),
    ("OFFLOAD", "sharded", 4, dict(sharding_strategy="FULL_SHARD")),
    ("DDP", "full", 4, dict(sharding_strategy="HYBRID_SHARD", fsdp_size=2)),
])
def test_momentum_reshards(source, kind, nproc, settings, runs, corpus, tmp_path):
    """2-rank shards (offloaded) -> 1 process or 4 ranks; 3 DDP ranks' full file -> HYBRID 2 x 2:
    the run continues as it went."""
    source_ranks, source_settings = LAYOUTS[source]
    original = runs(source, source_ranks, **source_settings)
    path = checkpoint_of(original, kind, 3, rank=0)
    run_trainer(str(tmp_path), nproc=nproc, resume_from=path, **(MUON | corpus | settings))
    got, expected = logged(str(tmp_path))["train/loss"], logged(original)["train/loss"]
    assert sorted(got) == [4, 5, 6]
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step


@pytest.mark.slow
@pytest.mark.parametrize("fixture, layout", [("runs", "OFFLOAD"), ("recipe_runs", "FULL_SHARD")])
def test_the_dry_run_knows_muons_state(fixture, layout, request, tmp_path):
    """A dry run of a sharded Muon run's config (the recipe's: NorMuon's row moments too) at its world size:
    rank 0's state as the run logged it (one momentum per matrix, two AdamW moments for the rest)."""
    nproc, settings = {"runs": LAYOUTS, "recipe_runs": RECIPE_LAYOUTS}[fixture][layout]
    run_dir = request.getfixturevalue(fixture)(layout, nproc, **settings)
    config = tmp_path / "config.yaml"
    config.write_text(to_yaml(TrainConfig(**torch.load(checkpoint_of(run_dir, "sharded", 6, rank=0),
                                                       weights_only=True)["config"])))
    out = tmp_path / "plan.json"
    result = launch([TRAINER, str(config), f"--dry_run=1x{nproc}", f"--dry_run_out={out}"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    planned = json.loads(out.read_text())["per_rank"]["state_gb"]
    assert planned == pytest.approx(scalars(os.path.join(run_dir, "tb"), "mem/rank0/state_gb")[6], rel=1e-6)


# ---- the speedrun recipe's parts (docs/recipe.md) under Muon's layouts ----
# llama with a ReLU^2 MLP, soft-capped logits, zero-initialised projections, an untied head and
# value embeddings in the first block (AdamW's, inside an FSDP unit); Polar Express, cautious
# weight decay and NorMuon. n_head 3: RoPE needs an even head_dim (66 / 3 = 22).
RECIPE = dict(arch="llama", n_head=3, mlp="relu2", logit_softcap=15.0, zero_init_proj=True, tie_embeddings=False,
              value_embeds=1, muon_coefficients="polar_express", cautious_weight_decay=True, normuon=True)
RECIPE_LAYOUTS = {"FULL_SHARD": (4, dict(sharding_strategy="FULL_SHARD", checkpoint_type="sharded")),
                  "HYBRID_SHARD": LAYOUTS["HYBRID_SHARD"], "DDP": LAYOUTS["DDP"],
                  "FULL_SHARD_3": LAYOUTS["FULL_SHARD_3"], "OFFLOAD": LAYOUTS["OFFLOAD"]}


@pytest.fixture(scope="module")
def recipe_runs(corpus, tmp_path_factory):
    return launcher_once(tmp_path_factory, "muon_recipe", **(MUON | RECIPE | corpus))


@pytest.mark.slow
@pytest.mark.parametrize("layout", RECIPE_LAYOUTS)
def test_the_recipe_matches_one_process_under_every_layout(layout, recipe_runs):
    assert_matches_one_process(recipe_runs, layout, RECIPE_LAYOUTS[layout])


@pytest.mark.slow
def test_the_recipe_resumes_bitwise_and_reshards(recipe_runs, corpus, tmp_path):
    (tmp_path / "ddp").mkdir()
    (tmp_path / "two").mkdir()
    (tmp_path / "three").mkdir()
    ddp = recipe_runs("DDP", *RECIPE_LAYOUTS["DDP"][:1], **RECIPE_LAYOUTS["DDP"][1])
    run_trainer(str(tmp_path / "ddp"), nproc=3, resume_from=checkpoint_of(ddp, "full", 3),
                **(MUON | RECIPE | corpus | RECIPE_LAYOUTS["DDP"][1]))
    got, expected = logged(str(tmp_path / "ddp"))["train/loss"], logged(ddp)["train/loss"]
    assert sorted(got) == [4, 5, 6] and all(got[s] == expected[s] for s in got), (got, expected)
    # 4 ranks' shards read by 2 (other slices of every tensor, NorMuon's (rows, 1) moments among them)
    sharded = recipe_runs("FULL_SHARD", *RECIPE_LAYOUTS["FULL_SHARD"][:1], **RECIPE_LAYOUTS["FULL_SHARD"][1])
    run_trainer(str(tmp_path / "two"), nproc=2, resume_from=checkpoint_of(sharded, "sharded", 3, rank=0),
                **(MUON | RECIPE | corpus | RECIPE_LAYOUTS["FULL_SHARD"][1]))
    got, expected = logged(str(tmp_path / "two"))["train/loss"], logged(sharded)["train/loss"]
    assert sorted(got) == [4, 5, 6] and all(got[s] == pytest.approx(expected[s], rel=1e-4) for s in got)
    # and the two sets' optimizer state at step 6 agree, NorMuon's row moments (non-zero) among it
    states = []
    for i, run in enumerate((str(tmp_path / "two"), sharded)):
        ckpt_format.consolidate(checkpoint_of(run, "sharded", 6, rank=0), str(tmp_path / f"{i}.pth"))
        states.append(torch.load(tmp_path / f"{i}.pth", weights_only=True)["optimizer"]["state"])
    got, expected = states
    moments = [name for name in expected if "row_second_moment" in expected[name]]
    assert len(moments) == 8 and sorted(got) == sorted(expected)  # 4 matrices x 2 blocks
    for name in expected:
        for key, value in expected[name].items():
            assert torch.allclose(got[name][key], value, rtol=1e-3, atol=1e-7), (name, key)
    assert all(expected[name]["row_second_moment"].shape[1] == 1 and expected[name]["row_second_moment"].min() > 0
               for name in moments)
    # a 2 x 2 HYBRID run's full file read by 3 FULL_SHARD ranks (torch's full optimizer state dict)
    hybrid = recipe_runs("HYBRID_SHARD", *RECIPE_LAYOUTS["HYBRID_SHARD"][:1], **RECIPE_LAYOUTS["HYBRID_SHARD"][1])
    run_trainer(str(tmp_path / "three"), nproc=3, resume_from=checkpoint_of(hybrid, "full", 3), **(MUON | RECIPE | corpus))
    got, expected = logged(str(tmp_path / "three"))["train/loss"], logged(hybrid)["train/loss"]
    assert sorted(got) == [4, 5, 6] and all(got[s] == pytest.approx(expected[s], rel=1e-4) for s in got)


@pytest.mark.slow
def test_export_refuses_what_hugging_face_cannot_express(recipe_runs, tmp_path):
    result = launch([os.path.join(ROOT, "export_hf.py"), checkpoint_of(recipe_runs("one", 1), "full", 6),
                     str(tmp_path / "hf")], ROOT)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "error: logit_softcap: 15.0: LlamaForCausalLM has no logit soft cap, so an export would compute other logits"]
    assert not (tmp_path / "hf").exists()


def test_cautious_weight_decay_spares_weights_their_update_pulls_away_from_zero(one_process_group):
    torch.manual_seed(0)
    start, grad = torch.randn(32, 16), torch.randn(32, 16)
    after = {}
    for cautious in (False, True):
        weight = start.clone().requires_grad_()
        optimizer = MuonWithAdamW([dict(params=[weight], muon=True, weight_decay=0.5, momentum=0.95)], lr=0.1,
                                  device=torch.device("cpu"), cautious=cautious)
        weight.grad = grad.clone()
        optimizer.step()
        after[cautious] = weight.detach()
    update = orthogonalise(grad)  # the first step's Nesterov momentum is the gradient itself
    pulls_to_zero = update * start > 0
    spared = after[True] - after[False]  # the decay plain weight decay took and cautious did not
    assert torch.equal(spared[pulls_to_zero], torch.zeros_like(spared[pulls_to_zero]))
    assert torch.allclose(spared[~pulls_to_zero], 0.1 * 0.5 * start[~pulls_to_zero], rtol=1e-5, atol=1e-7)
    assert 0.3 < pulls_to_zero.float().mean() < 0.7


def test_normuon_is_the_papers_update_and_keeps_a_moment_per_row(one_process_group):
    """Three steps on a tall and a wide matrix against NorMuon written out (arXiv:2510.05491,
    Algorithm 1 with Nesterov momentum): orthogonalise, a running mean of each row's squared
    update, each row divided by its root, the whole scaled to 0.2 sqrt(rows x cols) / its norm."""
    torch.manual_seed(0)
    start = [torch.randn(48, 16), torch.randn(16, 64)]
    ours = [w.clone().requires_grad_() for w in start]
    optimizer = MuonWithAdamW([dict(params=ours, muon=True, weight_decay=0.1, momentum=0.95)], lr=0.02,
                              device=torch.device("cpu"), normuon=0.9)
    expected = [w.clone() for w in start]
    momenta, moments = [torch.zeros_like(w) for w in start], [torch.zeros(w.shape[0], 1) for w in start]
    for _ in range(3):
        for i, w in enumerate(ours):
            w.grad = torch.randn_like(w)
            momenta[i] = 0.95 * momenta[i] + 0.05 * w.grad
            update = orthogonalise(0.05 * w.grad + 0.95 * momenta[i])
            moments[i] = 0.9 * moments[i] + 0.1 * update.square().mean(dim=1, keepdim=True)
            normalised = update / moments[i].sqrt()
            scale = 0.2 * normalised.numel() ** 0.5 / normalised.norm()
            expected[i] = expected[i] * (1 - 0.02 * 0.1) - 0.02 * scale * normalised
        optimizer.step()
    for w, want, moment in zip(ours, expected, moments):
        assert torch.allclose(w.detach(), want, rtol=1e-5, atol=1e-6)
        assert torch.allclose(optimizer.state[w]["row_second_moment"], moment, rtol=1e-5)
    # the first step's rows all have one RMS: each row's moment is then its own mean square
    weight = torch.zeros(48, 16, requires_grad=True)
    first = MuonWithAdamW([dict(params=[weight], muon=True, weight_decay=0.0, momentum=0.95)], lr=1.0,
                          device=torch.device("cpu"), normuon=0.95)
    weight.grad = torch.randn(48, 16) * torch.logspace(-2, 0, 48)[:, None]  # rows of two decades of scale
    first.step()
    rows = weight.detach().square().mean(dim=1).sqrt()
    assert torch.allclose(rows, torch.full_like(rows, 0.2), rtol=1e-4)
    plain = orthogonalise(weight.grad).square().mean(dim=1).sqrt() * rms_matching_scale(weight.shape)
    assert plain.max() > 1.5 * plain.min()  # where Muon's rows differ

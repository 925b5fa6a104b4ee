"""The recipe (docs/recipe.md): rows aligned to documents keep the loader's guarantees (parity across
world sizes, bitwise resume, resharding), and the recipe configs are real runs of the size they say."""
import os

import pytest

from fsdp_gpt.config_parse import parse_args
from conftest import DEMO, ROOT, RUN, checkpoint_of, launcher_once, run_trainer, scalars
from fsdp_gpt.model import GPT, GPTConfig


@pytest.fixture(scope="module")
def aligned(corpus, tmp_path_factory):
    run = launcher_once(tmp_path_factory, "aligned", align_rows=True, **RUN, **corpus)
    layouts = {"one": (1, dict(checkpoint_type="full")), "two": (2, dict(checkpoint_type="sharded"))}
    return lambda name: run(name, layouts[name][0], **layouts[name][1])


def losses(run_dir: str) -> dict:
    return scalars(os.path.join(run_dir, "tb"), "train/loss")


@pytest.mark.slow
def test_aligned_rows_train_alike_on_any_world_size(aligned):
    one, two = losses(aligned("one")), losses(aligned("two"))
    assert sorted(one) == sorted(two) == list(range(1, 7))
    assert all(two[s] == pytest.approx(one[s], rel=1e-4) for s in one)
    out = open(os.path.join(aligned("one"), "stdout.txt")).read()
    assert "note: align_rows: rows start at documents; train tokens never read (cropped): data " in out


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 1])
def test_aligned_rows_resume_bitwise_and_reshard(nproc, aligned, corpus, tmp_path):
    original = aligned("two")
    run_trainer(str(tmp_path), nproc=nproc, resume_from=checkpoint_of(original, "sharded", 3, rank=0),
                align_rows=True, checkpoint_type="sharded", **RUN, **corpus)
    got, expected = losses(str(tmp_path)), losses(original)
    assert sorted(got) == [4, 5, 6]
    if nproc == 2:
        assert all(got[s] == expected[s] for s in got), (got, expected)
    else:
        assert all(got[s] == pytest.approx(expected[s], rel=1e-4) for s in got)


@pytest.mark.parametrize("config, parameters", [("recipe_demo_cpu.yaml", None), ("recipe_124M.yaml", "239M")])
def test_the_recipe_configs(config, parameters):
    cfg = parse_args([os.path.join(ROOT, "config", config)])
    demo = parse_args([DEMO])
    if parameters is None:  # the demo's data, size, batch and steps, the recipe on
        assert all(getattr(cfg, k) == getattr(demo, k) for k in ("data_path", "n_layer", "n_embd", "block_size",
                                                                   "train_batch", "max_iters", "seed"))
    cfg.vocab_size = cfg.vocab_size or {"bytes": 256, "gpt2": 50304}[cfg.tokenizer]  # the data's, padded
    model = GPT(GPTConfig(**cfg.model_config))
    if parameters is not None:
        assert f"{model.num_params() / 1e6:.0f}M" == parameters
    with open(os.path.join(ROOT, "config", config)) as f:
        assert f"{model.num_params():,} parameters" in f.read()

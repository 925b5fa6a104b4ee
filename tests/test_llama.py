"""arch: llama (RMSNorm, RoPE, SwiGLU, grouped-query attention, qk_norm): parity with one process,
resumes, resharding, activation checkpointing and compile, export to Qwen3 with transformers' val
loss equal to evaluate.py's, init_from and its malformed folders (every family's Hugging Face
mapping both ways: test_families.py)."""
import math
import os

import pytest

from conftest import checkpoint_of, evaluated, hf_val_loss, launcher_once, run_trainer, scalars, tool
from fsdp_gpt.hf_format import read_hf_folder
from fsdp_gpt.model import GPT, GPTConfig
from test_families import hf_model

# GQA (4 query heads share 2 key/value heads), qk_norm (exports as Qwen3), untied head
LLAMA = dict(arch="llama", n_head=4, n_kv_head=2, qk_norm=True)
STEPS = 8


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """name -> folder of a llama run of STEPS steps, each launched once per module."""
    return launcher_once(tmp_path_factory, "llama", max_iters=STEPS, **(LLAMA | corpus))


LAYOUTS = {  # name: (ranks, settings); each saves at step 4 and 8
    "FULL_SHARD": (4, dict(sharding_strategy="FULL_SHARD", checkpoint_type="sharded", save_interval=4)),
    "HYBRID_SHARD": (4, dict(sharding_strategy="HYBRID_SHARD", fsdp_size=2, checkpoint_type="full", save_interval=4)),
}


def losses(run_dir: str, tag: str = "train/loss") -> dict:
    return scalars(os.path.join(run_dir, "tb"), tag)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [pytest.param(name, marks=[pytest.mark.compat] if name == "FULL_SHARD" else [])
                                    for name in LAYOUTS])
def test_four_ranks_match_one_process(layout, runs):
    reference = runs("one", 1)
    got = runs(layout, *LAYOUTS[layout][:1], **LAYOUTS[layout][1])
    for tag in ("train/loss", "train/grad_norm", "val/loss"):
        assert sorted(losses(got, tag)) == sorted(losses(reference, tag))
        for step, value in losses(reference, tag).items():
            assert losses(got, tag)[step] == pytest.approx(value, rel=1e-4), (tag, step)
    assert losses(reference)[STEPS] < losses(reference)[1] - 0.3  # it trains


@pytest.mark.slow
@pytest.mark.parametrize("layout, kind", [("FULL_SHARD", "sharded"), ("HYBRID_SHARD", "full")])
def test_resume_is_bitwise(layout, kind, runs, corpus, tmp_path):
    nproc, settings = LAYOUTS[layout]
    original = runs(layout, nproc, **settings)
    path = checkpoint_of(original, kind, 4, rank=0)
    run_trainer(str(tmp_path), nproc=nproc, max_iters=STEPS, resume_from=path, **(LLAMA | corpus | settings))
    got, expected = losses(str(tmp_path)), losses(original)
    assert sorted(got) == [5, 6, 7, 8] and all(got[s] == expected[s] for s in got), (got, expected)


@pytest.mark.slow
def test_resharded_with_activation_checkpointing_and_compile(runs, corpus, tmp_path):
    """The 4-rank sharded set resumed on 2 ranks with both switches on: the run goes on as it went."""
    nproc, settings = LAYOUTS["FULL_SHARD"]
    original = runs("FULL_SHARD", nproc, **settings)
    result = run_trainer(str(tmp_path), nproc=2, timeout=600, max_iters=STEPS, activation_checkpointing=True,
                         compile=True, resume_from=checkpoint_of(original, "sharded", 4, rank=0), **(LLAMA | corpus))
    assert "compile: true" in result.stdout
    got, expected = losses(str(tmp_path)), losses(original)
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step


@pytest.mark.slow
def test_export_evaluate_sample_and_init_from(runs, corpus, tmp_path):
    """The 4-rank run's step-8 checkpoint: exported as Qwen3ForCausalLM, transformers' loss on the
    run's val windows is evaluate.py's; sample.py writes text; a run started from the exported
    folder (init_from) begins at the same val loss."""
    nproc, settings = LAYOUTS["HYBRID_SHARD"]
    checkpoint = checkpoint_of(runs("HYBRID_SHARD", nproc, **settings), "full", STEPS)
    out = tmp_path / "hf"
    assert "Qwen3ForCausalLM" in tool("export_hf.py", checkpoint, out)
    logged = evaluated(checkpoint)
    assert hf_val_loss(out, corpus, "Qwen3ForCausalLM") == pytest.approx(logged, rel=1e-5)
    text = tool("sample.py", checkpoint, "--max_new_tokens", "16", "--seed", "1")
    assert text == tool("sample.py", checkpoint, "--max_new_tokens", "16", "--seed", "1") and text.strip()
    started = tmp_path / "started"
    started.mkdir()
    run_trainer(str(started), max_iters=0, init_from=str(out), **(LLAMA | corpus))
    assert losses(str(started), "val/loss")[0] == pytest.approx(logged, rel=1e-5)
    assert math.isfinite(logged)


def test_init_from_refuses_a_folder_of_another_shape(corpus, tmp_path):
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_embd=64, **LLAMA)
    hf_model(cfg, GPT(cfg).state_dict()).save_pretrained(tmp_path / "hf")
    result = run_trainer(str(tmp_path), check=False, max_iters=0, init_from=str(tmp_path / "hf"),
                         **(LLAMA | corpus | dict(n_embd=32)))
    assert result.returncode == 2
    assert (f"error: init_from {tmp_path / 'hf'} has n_embd=64 but the config sets n_embd=32: drop n_embd from the "
            f"config and the command line, or set --n_embd=64 (the folder defines the model)") in result.stderr


def test_checkpoints_written_before_arch_existed_still_load():
    """Their model_config has only GPT-2's keys: the missing ones read as the GPT-2 layout."""
    from fsdp_gpt.checkpoint.ckpt_format import check_model_shape
    from fsdp_gpt.config import TrainConfig, UserError
    from fsdp_gpt.config_checks import validate

    old = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64, bias=True, dropout=0.0)
    gpt2 = TrainConfig(**{k: v for k, v in old.items()})
    validate(gpt2)
    check_model_shape("checkpoint old.pth", old, gpt2)  # no error
    assert GPT(GPTConfig(**old)).state_dict().keys() == GPT(GPTConfig(**gpt2.model_config)).state_dict().keys()
    llama = TrainConfig(**old | dict(arch="llama"))
    validate(llama)
    with pytest.raises(UserError, match="checkpoint old.pth has arch=gpt2 but the config has arch=llama"):
        check_model_shape("checkpoint old.pth", old, llama)
    # where init_from set the model, --arch=gpt2 would contradict the folder: the folder is what to change
    llama.init_from = "hf_llama"
    with pytest.raises(UserError) as refused:
        check_model_shape("checkpoint old.pth", old, llama)
    assert str(refused.value) == ("checkpoint old.pth has arch=gpt2 but init_from hf_llama defines arch=llama: give "
                                  "the init_from the checkpoint's run started from")


def damage_header(path, edit) -> None:
    """Rewrite a safetensors file's JSON header through edit(header) (the data stays as it was)."""
    import json
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + size:])


DAMAGES = {  # name: (damage(folder), what the line says)
    "truncated file": (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-100]),
                       "past the data's end"),
    "header length past the end": (lambda d: (d / "model.safetensors").write_bytes(
        (10 ** 9).to_bytes(8, "little") + (d / "model.safetensors").read_bytes()[8:]), "the header claims 1,000,000,000 bytes"),
    "offsets past the end": (lambda d: damage_header(d / "model.safetensors", lambda h: h["model.norm.weight"].update(
        data_offsets=[10 ** 8, 10 ** 8 + 256])), "tensor model.norm.weight lies at data bytes 100,000,000"),
    "missing tensor": (lambda d: damage_header(d / "model.safetensors", lambda h: h.pop("model.layers.1.mlp.up_proj.weight")),
                       "has no tensor 'model.layers.1.mlp.up_proj.weight'"),
    "unknown dtype": (lambda d: damage_header(d / "model.safetensors", lambda h: h["model.norm.weight"].update(dtype="I32")),
                      "tensor model.norm.weight is I32; F32, F16, BF16 and (with their scales) F8_E4M3"),
    # a float8 weight beside no scales, in a folder whose config.json says nothing of a quantization
    "float8 without scales": (lambda d: damage_header(d / "model.safetensors", lambda h: h["model.norm.weight"].update(
        dtype="F8_E4M3", shape=[256])), "model.norm.weight is float8_e4m3fn with no model.norm.weight_scale_inv beside "
                                        "it (config.json's quantization_config: None): not read as if it were full"),
    "config.json not JSON": (lambda d: (d / "config.json").write_text("{'vocab_size': 256,"), "config.json is not JSON"),
    "index not JSON": (lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": {'),
                       "model.safetensors.index.json is not JSON"),
    "index without its map": (lambda d: (d / "model.safetensors.index.json").write_text('{"metadata": {}}'),
                              "model.safetensors.index.json lacks weight_map"),
}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64, arch="llama", n_kv_head=2)
    hf_model(cfg, GPT(cfg).state_dict()).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_malformed_folder_is_named_in_one_line(damage, hf_folder, tmp_path):
    from fsdp_gpt.config import UserError
    import shutil
    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    read_hf_folder(str(folder))  # whole: reads
    make, phrase = DAMAGES[damage]
    make(folder)
    with pytest.raises(UserError) as error:
        read_hf_folder(str(folder))
    assert phrase in str(error.value) and str(folder) in str(error.value), str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_the_trainer_stops_on_a_malformed_folder_with_exit_2(hf_folder, corpus, tmp_path):
    import shutil
    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    DAMAGES["truncated file"][0](folder)
    result = run_trainer(str(tmp_path), check=False, max_iters=0, init_from=str(folder),
                         **(corpus | dict(arch="llama", n_head=4, n_kv_head=2, vocab_size=256)))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: init_from: {folder / 'model.safetensors'}: tensor ")
    assert "past the data's end" in errors[0]

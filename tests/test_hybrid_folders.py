"""Qwen3.5 from its folders beyond a family's row of test_continued_pretraining.FOLDERS: the published
multimodal form (Qwen3_5ForConditionalGeneration and its MoE), whose language model trains while its
vision tower stays in the folder, both exports (the language model as its CausalLM class, and the whole
folder back); a sharded resume, bitwise; the MoE's experts over ranks (ep_size) as one process."""
import json
import os

import pytest
import torch

from conftest import ROOT, assert_quiet, launch, scalars, tool
from test_continued_pretraining import AT_LR_0, FOLDERS, ROWS, SMALL, bare_config, family_folder, run
from test_hf_tokenizer import write_docs

pytestmark = pytest.mark.slow

VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, num_position_embeddings=16,
              patch_size=4)
# the processor's files beside the weights, which the whole folder's export copies as they were
PROCESSOR = {"preprocessor_config.json": '{"image_processor_type": "Qwen2VLImageProcessorFast"}\n',
             "chat_template.jinja": "{% for message in messages %}{{ message['content'] }}{% endfor %}\n"}
MULTIMODAL = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}


def multimodal_folder(tmp_path_factory, name: str) -> str:
    """FOLDERS[name]'s language model inside its multimodal class, with a vision tower and processor files."""
    return family_folder(tmp_path_factory, name, (MULTIMODAL[name], dict(vision_config=VISION), PROCESSOR))


def tensors(folder) -> dict:
    from safetensors.torch import load_file
    return {k: v for file in sorted(os.listdir(folder)) if file.endswith(".safetensors")
            for k, v in load_file(os.path.join(folder, file)).items()}


def text_logits(model, idx) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=idx).logits


@pytest.mark.parametrize("name", MULTIMODAL)
def test_a_multimodal_folder_trains_its_language_model_and_exports_both_ways(name, tmp_path_factory, tmp_path):
    """init_from a Qwen3_5(Moe)ForConditionalGeneration folder, no model keys: one line says the language
    model trains and the vision tower stays; a step at learning rate 0 keeps the folder's model (transformers'
    text logits within 1e-4 on rows of 150: past two of its linear layers' chunks), exported as the CausalLM
    class transformers loads, and as the
    whole folder: every file and tensor as it came. Trained 2 steps at 2 ranks, the whole folder holds the
    trained language model beside the vision tower as it was, and loads as the multimodal class."""
    import transformers
    from transformers import AutoModelForCausalLM

    from fsdp_gpt.checkpoint.ckpt_format import load_gpt
    folder = multimodal_folder(tmp_path_factory, name)
    architecture = getattr(transformers, MULTIMODAL[name])
    original = architecture.from_pretrained(folder).eval()
    write_docs(tmp_path / "docs.jsonl", n=60)
    config = bare_config(tmp_path, tmp_path / "docs.jsonl")
    (tmp_path / "kept").mkdir()
    small = SMALL | dict(block_size=ROWS[name])
    kept = run(tmp_path / "kept", config, init_from=folder, **(small | AT_LR_0 | dict(eval_interval=100, sample_tokens=0)))
    assert kept.returncode == 0, kept.stderr[-3000:]
    causal = FOLDERS[name][0]
    assert (f"note: init_from {folder} holds a {MULTIMODAL[name]}: its language model (text_config) trains, as a "
            f"{causal}; the rest (vision_config) is left in the folder as it is (export_hf.py --whole_folder writes "
            f"the folder back with the trained language model)") in kept.stdout.splitlines()
    checkpoint = tmp_path / "kept" / "ckpt" / "fsdp_cpt1.pth"
    idx = torch.randint(0, 500, (2, ROWS[name]), generator=torch.Generator().manual_seed(0))
    expected = text_logits(original, idx)
    with torch.no_grad():
        torch.testing.assert_close(load_gpt(str(checkpoint), torch.device("cpu"))[0](idx)[0], expected, rtol=1e-4,
                                   atol=1e-4)
    tool("export_hf.py", checkpoint, tmp_path / "lm")
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "lm").eval()
    assert type(lm).__name__ == causal
    torch.testing.assert_close(text_logits(lm, idx), expected, rtol=1e-4, atol=1e-4)
    # the whole folder, untrained: each file as it came, each tensor (the vision tower's, the language model's) alike
    said = tool("export_hf.py", checkpoint, tmp_path / "whole", "--whole_folder")
    assert f"({folder}/ as it was, a {MULTIMODAL[name]}, with the trained {causal}'s weights in its dtypes)" in said
    assert sorted(os.listdir(tmp_path / "whole")) == sorted(os.listdir(folder))
    for file in set(os.listdir(folder)) - {"model.safetensors"}:
        assert (tmp_path / "whole" / file).read_bytes() == open(os.path.join(folder, file), "rb").read() or \
            file == "config.json" and json.loads((tmp_path / "whole" / file).read_text()) == \
            json.loads(open(os.path.join(folder, file)).read()), file
    source, whole = tensors(folder), tensors(tmp_path / "whole")
    assert source.keys() == whole.keys() and any(k.startswith("model.visual.") for k in source)
    assert all(torch.equal(source[k], whole[k]) for k in source)
    # trained at 2 ranks: the language model's tensors are the checkpoint's, the vision tower's the folder's
    (tmp_path / "trained").mkdir()
    trained = run(tmp_path / "trained", config, nproc=2, init_from=folder, **(small | dict(sample_tokens=0)))
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert_quiet(trained.stderr)
    checkpoint = tmp_path / "trained" / "ckpt" / "fsdp_cpt2.pth"
    tool("export_hf.py", checkpoint, tmp_path / "whole_trained", "--whole_folder", folder)
    after = architecture.from_pretrained(tmp_path / "whole_trained").eval()
    assert type(after) is architecture
    whole = tensors(tmp_path / "whole_trained")
    vision = [k for k in source if k.startswith("model.visual.")]
    assert all(torch.equal(source[k], whole[k]) for k in vision)
    assert all(not torch.equal(source[k], whole[k]) for k in source if k.endswith("embed_tokens.weight"))
    with torch.no_grad():
        torch.testing.assert_close(text_logits(after, idx), load_gpt(str(checkpoint), torch.device("cpu"))[0](idx)[0],
                                   rtol=1e-4, atol=1e-4)
    # into the folder of another model: refused in one line, naming it
    families = {"qwen3_5": "Qwen3.5", "qwen3_5_moe": "Qwen3.5-MoE"}
    other_name = next(n for n in MULTIMODAL if n != name)
    other = family_folder(tmp_path_factory, other_name)
    refused = launch([os.path.join(ROOT, "export_hf.py"), str(checkpoint), str(tmp_path / "other"),
                      f"--whole_folder={other}"], ROOT)
    assert refused.returncode == 2 and [line for line in refused.stderr.splitlines() if line.startswith("error: ")] == [
        f"error: export_hf.py --whole_folder: {other}/ holds a {families[other_name]} model, the checkpoint a "
        f"{families[name]} one: give the folder the run started from"]


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_a_qwen3_5_run_resumes_bitwise_from_shards(name, tmp_path_factory, tmp_path):
    """2 ranks, sharded checkpoints at step 2 of 4: resumed there, steps 3 and 4 lose what the run
    uninterrupted lost, bit for bit."""
    folder = family_folder(tmp_path_factory, name)
    write_docs(tmp_path / "docs.jsonl", n=60)
    config = bare_config(tmp_path, tmp_path / "docs.jsonl")
    settings = SMALL | dict(block_size=ROWS[name], max_iters=4, lr_decay_iters=4, save_interval=2, eval_interval=100,
                            sample_tokens=0, checkpoint_type="sharded")
    losses = {}
    for kind, extra in (("whole", {}), ("resumed", dict(resume_from=str(tmp_path / "whole" / "ckpt" /
                                                                         "fsdp_sharded_cpt2_rank0.pth")))):
        (tmp_path / kind).mkdir()
        result = run(tmp_path / kind, config, 2, init_from=folder, **(settings | extra))
        assert result.returncode == 0, result.stderr[-3000:]
        losses[kind] = scalars(tmp_path / kind / "tb", "train/loss")
    assert sorted(losses["resumed"]) == [3, 4]
    assert all(losses["resumed"][s] == losses["whole"][s] for s in (3, 4)), losses  # bitwise


def test_qwen3_5_moe_experts_over_two_ranks_train_as_one_process(tmp_path_factory, tmp_path):
    """--ep_size=2 beside init_from a Qwen3.5-MoE folder at 2 ranks: its 4 experts, 2 a rank, the shared
    expert and its gate on every rank, train as one process does."""
    folder = family_folder(tmp_path_factory, "qwen3_5_moe")
    write_docs(tmp_path / "docs.jsonl", n=200)
    config = bare_config(tmp_path, tmp_path / "docs.jsonl")
    logged = {}
    for name, nproc, extra in (("one", 1, {}), ("ep2", 2, dict(ep_size=2))):
        (tmp_path / name).mkdir()
        settings = SMALL | dict(block_size=ROWS["qwen3_5_moe"]) | extra
        result = run(tmp_path / name, config, nproc, init_from=folder, **settings)
        assert result.returncode == 0, result.stderr[-3000:]
        logged[name] = {tag: scalars(tmp_path / name / "tb", tag) for tag in ("train/loss", "val/loss")}
    assert "expert parallel 2 (2 experts a rank)" in result.stdout
    assert_quiet(result.stderr)
    for tag, values in logged["one"].items():
        assert values and logged["ep2"][tag] == pytest.approx(values, rel=1e-5), tag

"""What users do with a checkpoint: sample from it and export it to Hugging Face."""
import os

import pytest
import torch

from conftest import ROOT, checkpoint_of, tool

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_sample_is_text_and_deterministic_for_a_seed(kind, two_rank_runs):
    checkpoint = checkpoint_of(two_rank_runs[kind], kind, 6)
    args = (checkpoint, "--prompt", "import json\n", "--max_new_tokens", 40)
    first, again, other = tool("sample.py", *args, "--seed", 1), tool("sample.py", *args, "--seed", 1), \
        tool("sample.py", *args, "--seed", 2)
    assert first.startswith("import json\n") and len(first) > len("import json\n") + 20
    assert first == again
    assert first != other


def test_sample_from_a_folder_takes_the_newest_checkpoint(two_rank_runs):
    folder = os.path.join(two_rank_runs["sharded"], "ckpt")
    args = ("--max_new_tokens", 30, "--seed", 5)
    assert tool("sample.py", folder, *args) == tool("sample.py", checkpoint_of(two_rank_runs["sharded"], "sharded", 6),
                                                    *args)


def test_exported_model_loads_in_transformers_with_the_same_logits(two_rank_runs, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ckpt_format import load_gpt

    exports = {}
    for kind in ("full", "sharded"):
        exports[kind] = tmp_path / kind
        tool("export_hf.py", checkpoint_of(two_rank_runs[kind], kind, 6), exports[kind])
    hf = AutoModelForCausalLM.from_pretrained(exports["full"]).eval()
    ours, _ = load_gpt(checkpoint_of(two_rank_runs["full"], "full", 6), torch.device("cpu"))
    idx = torch.randint(0, ours.config.vocab_size, (3, ours.config.block_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = ours(idx)[0], hf(idx).logits
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4), (got - expected).abs().max()
    # the sharded checkpoint of the same run exports the same tensors
    full, sharded = (load_file(exports[kind] / "model.safetensors") for kind in ("full", "sharded"))
    assert full.keys() == sharded.keys()
    assert all(torch.equal(full[name], sharded[name]) for name in full)


def test_exported_tokenizer_encodes_as_tiktoken(tmp_path):
    from transformers import AutoTokenizer

    from data import get_tokenizer
    from export_hf import save_tokenizer

    encoding = get_tokenizer("cl100k_base")
    assert save_tokenizer(encoding, str(tmp_path))
    hf = AutoTokenizer.from_pretrained(tmp_path)
    text = open(os.path.join(ROOT, "README.md")).read() + " héllo 12345 <|endoftext|> 日本語 😀\n\n\tx  \n "
    ids = encoding.encode(text, allowed_special="all")
    assert hf.encode(text) == ids
    assert hf.decode(ids) == text
    assert not save_tokenizer(get_tokenizer("bytes"), str(tmp_path / "bytes"))  # no HF form: no files

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

    from fsdp_gpt.checkpoint.ckpt_format import load_gpt

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


@pytest.mark.compat  # on transformers 4.51 (CI's oldest venv) as on 5
def test_exported_tokenizers_encode_as_the_runs(tmp_path):
    """tiktoken's BPE and raw bytes converted, a Hugging Face tokenizer copied: each encodes as the
    run's tokenizer did; tokenizer_config.json gives the trained context and a class transformers 4
    and 5 both know."""
    import json

    from transformers import AutoTokenizer

    from fsdp_gpt.data.tokenizer_export import save_tokenizer
    from test_hf_tokenizer import make_tokenizer
    from fsdp_gpt.data.tokenizer import get_tokenizer

    text = open(os.path.join(ROOT, "README.md")).read() + " héllo 12345 <|endoftext|> 日本語 😀\n\n\tx  \n "
    for name in ("cl100k_base", "bytes", make_tokenizer(tmp_path / "hf_tokenizer")):
        ours, out = get_tokenizer(name), tmp_path / "exported" / os.path.basename(name)
        save_tokenizer(ours, str(out), block_size=96)
        hf = AutoTokenizer.from_pretrained(out)
        ids = ours.encode(text, allowed_special="all") if name == "cl100k_base" else ours.encode_ordinary(text)
        assert hf.encode(text, add_special_tokens=False) == ids, name
        assert hf.decode(ids) == text, name
        assert hf.convert_tokens_to_ids(hf.eos_token) == ours.eot_token, name
        config = json.loads((out / "tokenizer_config.json").read_text())
        if name == "bytes" or name == "cl100k_base":
            assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["model_max_length"] == 96
        else:  # copied as it is
            assert (out / "tokenizer.json").read_bytes() == (tmp_path / "hf_tokenizer" / "tokenizer.json").read_bytes()


# A tokenizer folder as transformers 5 saves it (tokenizer_class TokenizersBackend, extra_special_tokens a
# list, chat templates in .jinja files), made by save_as_transformers_5 with transformers 5.24 and kept
# here: CI's compat run, on transformers 4.51, exports it as the main run does
SAVED_BY_5 = os.path.join(ROOT, "tests", "data", "tokenizer_saved_by_transformers_5")
TEMPLATES = {"default": "{% for m in messages %}<|bos|>{{ m['content'] }}<|endoftext|>{% endfor %}",
             "tool_use": "<|tool|>{{ messages[0]['content'] }}"}


def save_as_transformers_5(folder) -> None:
    """tests/data/tokenizer_saved_by_transformers_5/ (transformers 5 writes its own format)."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast
    words = {word: i for i, word in enumerate(["hello", "world", "tool", "call", "[UNK]"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|bos|>",
                                 additional_special_tokens=["<|tool|>"])
    hf.chat_template = dict(TEMPLATES)
    hf.save_pretrained(folder)


def test_the_kept_folder_is_what_transformers_5_saves(tmp_path):
    """What the export rewrites, as transformers 5 writes it now: refresh the folder if this fails."""
    import json

    import tokenizers
    import transformers
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip(f"the folder is transformers 5's (this is {transformers.__version__})")
    save_as_transformers_5(tmp_path)
    files = {os.path.relpath(os.path.join(d, f), folder) for folder in (SAVED_BY_5, tmp_path)
             for d, _, names in os.walk(folder) for f in names}
    assert all(os.path.isfile(os.path.join(folder, f)) for f in files for folder in (SAVED_BY_5, tmp_path)), files
    configs = [json.load(open(os.path.join(folder, "tokenizer_config.json"))) for folder in (SAVED_BY_5, tmp_path)]
    keys = ("tokenizer_class", "extra_special_tokens", "eos_token", "bos_token")
    assert [{k: c.get(k) for k in keys} for c in configs] == 2 * [dict(
        tokenizer_class="TokenizersBackend", extra_special_tokens=["<|tool|>"], eos_token="<|endoftext|>",
        bos_token="<|bos|>")]
    vocabularies = [tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json")).get_vocab()
                    for folder in (SAVED_BY_5, tmp_path)]
    assert vocabularies[0] == vocabularies[1]
    for name in files - {"tokenizer.json", "tokenizer_config.json"}:  # the chat templates
        assert open(os.path.join(SAVED_BY_5, name)).read() == open(os.path.join(tmp_path, name)).read(), name


@pytest.mark.compat  # on transformers 4.51 (CI's oldest venv) as on 5
def test_an_export_of_a_tokenizer_transformers_5_saved_loads_in_this_transformers(tmp_path):
    """transformers 4.51 refuses TokenizersBackend and fails on a list of extra_special_tokens, and
    reads no named template from additional_chat_templates/: the export writes a tokenizer_config.json
    both versions read, with the source's special tokens and chat templates."""
    from transformers import AutoTokenizer

    from fsdp_gpt.data.tokenizer_export import save_tokenizer
    from fsdp_gpt.data.tokenizer import HFTokenizer
    source = HFTokenizer(SAVED_BY_5)
    save_tokenizer(source, str(tmp_path), block_size=64)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    text = "hello world <|tool|> call tool"
    assert hf.encode(text, add_special_tokens=False) == source.encode_ordinary(text) == [0, 1, 7, 3, 2]
    assert (hf.bos_token, hf.eos_token) == ("<|bos|>", "<|endoftext|>") and "<|tool|>" in hf.all_special_tokens
    assert hf.chat_template == TEMPLATES
    chat = [{"role": "user", "content": "hello"}]
    assert hf.apply_chat_template(chat, tokenize=False) == "<|bos|>hello<|endoftext|>"
    assert hf.apply_chat_template(chat, tokenize=False, chat_template="tool_use") == "<|tool|>hello"


def test_export_in_bf16_halves_the_folder_and_large_models_come_in_shards(two_rank_runs, tmp_path):
    import json

    from safetensors.torch import load_file
    checkpoint = checkpoint_of(two_rank_runs["full"], "full", 6)
    tool("export_hf.py", checkpoint, tmp_path / "fp32")
    tool("export_hf.py", checkpoint, tmp_path / "bf16", "--dtype", "bf16", "--max_shard_size", "200KB")
    fp32 = load_file(tmp_path / "fp32" / "model.safetensors")
    index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    bf16 = {k: v for shard in shards for k, v in load_file(tmp_path / "bf16" / shard).items()}
    assert bf16.keys() == fp32.keys() and all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert all(torch.equal(bf16[k], fp32[k].bfloat16()) for k in fp32)
    size = {d: sum(f.stat().st_size for f in (tmp_path / d).glob("*.safetensors")) for d in ("fp32", "bf16")}
    assert 0.45 < size["bf16"] / size["fp32"] < 0.55
    # a second export into that folder replaces the first's weights: no shard set left beside the one file,
    # which transformers and init_from would each read as another model
    tool("export_hf.py", checkpoint, tmp_path / "bf16")
    assert sorted(f.name for f in (tmp_path / "bf16").glob("model*")) == ["model.safetensors"]


def test_an_export_names_the_tokenizers_own_beginning_of_text():
    """A tokenizer whose bos_token is not its end-of-text (Gemma's <bos> 2 beside <eos> 1; here <|bos|>):
    config.json's bos_token_id is the tokenizer's own; a tokenizer that names none (bytes, tiktoken's)
    gives the end-of-text id to both, as before."""
    from fsdp_gpt.data.tokenizer import HFTokenizer, get_tokenizer
    from fsdp_gpt.hf_format import hf_config
    from fsdp_gpt.model import GPTConfig
    cfg = GPTConfig(arch="llama", vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    source = HFTokenizer(SAVED_BY_5)
    ids = [source.tokenizer.token_to_id(token) for token in ("<|bos|>", "<|endoftext|>")]
    assert ids[0] != ids[1] and (source.bos_token, source.eot_token) == tuple(ids)
    keys = hf_config(cfg, source.eot_token, source.bos_token)
    assert [keys["bos_token_id"], keys["eos_token_id"]] == ids
    plain = get_tokenizer("bytes")
    assert getattr(plain, "bos_token", None) is None
    assert hf_config(cfg, plain.eot_token)["bos_token_id"] == plain.eot_token

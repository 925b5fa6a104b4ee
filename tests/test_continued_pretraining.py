"""Continued pretraining from a Hugging Face folder: its config.json defines the model (a key the
config contradicts is refused naming both values), its tokenizer is the run's, its vocabulary stays
the model's, block_size is the run's choice up to the folder's positions."""
import os
import re
import sys

import pytest

from conftest import ROOT, assert_quiet, launch, needs_class, overrides, scalars, shared, tool
from test_hf_tokenizer import make_sentencepiece_tokenizer, make_tokenizer, write_docs

sys.path.insert(0, os.path.join(ROOT, "bench"))
from mc_cost import write_items  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory) -> str:
    """A small random Qwen3ForCausalLM saved by transformers, with a tokenizer trained here beside it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    folder = tmp_path_factory.mktemp("qwen3")
    # heads x head_dim = 128, not hidden_size, as in Qwen3-0.6B (16 x 128 against 1024)
    config = Qwen3Config(vocab_size=576, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                         rope_theta=1e6, tie_word_embeddings=True)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    make_tokenizer(folder)  # 500 tokens: fewer than the model's 576 rows
    return str(folder)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> str:
    """A small random LlamaForCausalLM with Llama 3.1's RoPE scaling and an untied head, and a tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM
    folder = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512, rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=32), tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)
    make_tokenizer(folder)
    return str(folder)


@pytest.fixture(scope="module")
def qwen3_moe_folder(tmp_path_factory) -> str:
    """A small random Qwen3MoeForCausalLM (8 experts, top 2) saved by transformers, and a tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    folder = tmp_path_factory.mktemp("qwen3_moe")
    config = Qwen3MoeConfig(vocab_size=576, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            max_position_embeddings=256, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    Qwen3MoeForCausalLM(config).save_pretrained(folder)
    make_tokenizer(folder)
    return str(folder)


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory) -> str:
    """A small random Gemma3ForCausalLM saved by the transformers installed (5.x writes layer_types and
    rope_parameters, 4.51 the pattern and both bases): a local layer (a window of 16, shorter than
    the runs' rows of 64) then a global one, a local RoPE base other than the default 10,000, another
    attention scale, a final soft cap; Gemma's kind of tokenizer beside it."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    folder = tmp_path_factory.mktemp("gemma3")
    config = Gemma3TextConfig(vocab_size=576, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                              sliding_window=16, sliding_window_pattern=2, query_pre_attn_scalar=24, rope_theta=1e6,
                              rope_local_base_freq=2e4, final_logit_softcapping=30.0, rms_norm_eps=1e-6)
    model = Gemma3ForCausalLM(config)
    with __import__("torch").no_grad():  # norms away from their zeros: (1 + weight) exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    make_sentencepiece_tokenizer(folder)  # Gemma's kind: "▁" for spaces, byte fallback, <eos> and <bos>
    return str(folder)


def exported_as_it_came(folder, checkpoint, export, keys_of_5: tuple[str, ...], rows: int = 64,
                        loading: dict | None = None) -> dict:
    """A checkpoint kept by a step at learning rate 0 and its export: the checkpoint's model gives
    transformers' logits of the folder within 1e-4 on rows of 64 (longer than any window here; `rows`), the
    export loads as the folder's class with its weights and logits exactly, and so does it without the
    keys only transformers 5 reads (keys_of_5: what is left is what 4.5x reads). loading: how transformers
    loads the folder (an MXFP4 folder's dequantize). The export's config.json."""
    import json
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_gpt.checkpoint.ckpt_format import load_gpt
    config = json.loads((export / "config.json").read_text())
    shutil.copytree(export, export.parent / "as_4_reads")
    (export.parent / "as_4_reads" / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                                         if k not in keys_of_5}))
    original = AutoModelForCausalLM.from_pretrained(folder, **(loading or {})).eval()
    exported, read_as_4 = (AutoModelForCausalLM.from_pretrained(path).eval() for path in (export, export.parent / "as_4_reads"))
    assert type(exported) is type(original) is type(read_as_4)
    assert all(torch.equal(a, exported.state_dict()[name]) for name, a in original.state_dict().items())
    ours = load_gpt(str(checkpoint), torch.device("cpu"))[0]
    idx = torch.randint(0, 500, (2, rows), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = original(idx).logits
        torch.testing.assert_close(ours(idx)[0], expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(exported(idx).logits, expected, rtol=0, atol=0)
        torch.testing.assert_close(read_as_4(idx).logits, expected, rtol=0, atol=0)
    return config


def bare_config(tmp_path, docs) -> str:
    """A config with no model key and no tokenizer: the folder brings them."""
    path = tmp_path / "continue.yaml"
    path.write_text(f"data_path: {tmp_path / 'prepared'}\ndata_source: {docs or 'null'}\n")
    return str(path)


def run(run_dir, config: str, nproc: int = 1, **settings):
    """The trainer with `settings` alone (no test defaults: they would name model keys)."""
    settings |= dict(checkpoint_dir=os.path.join(run_dir, "ckpt"), tensorboard_dir=os.path.join(run_dir, "tb"))
    return launch([os.path.join(ROOT, "train_fsdp.py"), config] + overrides(**settings), run_dir, nproc)


SMALL = dict(block_size=64, max_iters=2, log_interval=1, eval_interval=2, eval_iters=1, train_batch=4, micro_batch=2,
             warmup_iters=1, lr_decay_iters=2, sample_tokens=4, dtype="fp32")
AT_LR_0 = dict(max_iters=1, learning_rate=0.0, min_lr=0.0, warmup_iters=0, lr_schedule="constant")  # weights kept


def test_the_folder_defines_the_model_and_its_tokenizer_feeds_the_run(qwen3_folder, tmp_path):
    docs = tmp_path / "docs.jsonl"
    write_docs(docs, n=200)
    config = bare_config(tmp_path, docs)
    result = run(tmp_path, config, nproc=2, init_from=qwen3_folder, **SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    for key, value in dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, head_dim=32, ffn_hidden=128, qk_norm="true",
                           rope_theta=1000000.0, vocab_size=576, tokenizer=qwen3_folder, block_size=64).items():
        assert f"\n{key}: {value}\n" in result.stdout, key
    assert "step 2/2 | val loss" in result.stdout
    refused = run(tmp_path, config, init_from=qwen3_folder, **(SMALL | dict(n_layer=3)))
    assert refused.returncode == 2
    assert (f"error: init_from {qwen3_folder} has n_layer=2 but the config sets n_layer=3: drop n_layer from the "
            f"config and the command line") in refused.stderr
    other = make_tokenizer(tmp_path / "other", vocab_size=400)
    mismatched = run(tmp_path, config, init_from=qwen3_folder,
                             **(SMALL | dict(tokenizer=other)))
    assert mismatched.returncode == 2 and f"not with this run's {other}" in mismatched.stderr
    # data prepared with another tokenizer than the model's: refused, the model's tokenizer named
    tool("data.py", "prepare", tmp_path / "other_data", docs, f"--tokenizer={other}")
    refused = run(tmp_path, config, init_from=qwen3_folder, **(SMALL | dict(data_path=str(tmp_path / "other_data"))))
    assert refused.returncode == 2 and f"not with this run's {qwen3_folder} (sha256" in refused.stderr
    assert os.path.isfile(tmp_path / "prepared" / "meta.json")


def test_ep_size_alone_splits_a_mixture_folders_experts(qwen3_moe_folder, qwen3_folder, tmp_path):
    """--ep_size=2 beside init_from at 2 ranks, no model key restated: the folder's 8 experts, 4 a rank,
    train as one process does, and the console stays quiet; beside a dense folder, ep_size is refused
    in one line naming the folder's moe_experts=0."""
    write_docs(tmp_path / "docs.jsonl", n=200)
    config = bare_config(tmp_path, tmp_path / "docs.jsonl")
    logged = {}
    for name, nproc, extra in (("one", 1, {}), ("ep2", 2, dict(ep_size=2))):
        (tmp_path / name).mkdir()
        result = run(tmp_path / name, config, nproc, init_from=qwen3_moe_folder, **(SMALL | extra))
        assert result.returncode == 0, result.stderr[-3000:]
        logged[name] = {tag: scalars(tmp_path / name / "tb", tag) for tag in ("train/loss", "val/loss")}
    assert "\nmoe_experts: 8\n" in result.stdout and "expert parallel 2 (4 experts a rank)" in result.stdout
    assert_quiet(result.stderr)
    for tag, values in logged["one"].items():
        assert logged["ep2"][tag] == pytest.approx(values, rel=1e-4), tag
    refused = run(tmp_path, config, nproc=2, init_from=qwen3_folder, **(SMALL | dict(ep_size=2)))
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert refused.returncode != 0 and "Traceback" not in refused.stderr and errors == [
        f"error: ep_size=2 splits a mixture's experts over ranks, and moe_experts: 0 is a dense model: ep_size must be "
        f"1 (init_from {qwen3_folder} sets moe_experts=0)"]


def defined(folder: str, *overrides: str) -> str:
    """continue_hf.yaml with init_from=folder and the overrides, read as the trainer reads it, then the
    folder's keys applied (define_model): "note: ..." as it says, or "error: ..." as it refuses."""
    from fsdp_gpt.config import UserError
    from fsdp_gpt.config_parse import parse_args
    from fsdp_gpt.hf_format import define_model
    cfg = parse_args([os.path.join(ROOT, "config", "continue_hf.yaml"), f"--init_from={folder}", "--block_size=64",
                      *overrides])
    try:
        return "".join(f"note: {note}" for note in define_model(cfg))
    except UserError as e:
        return f"error: {e}"


@pytest.mark.parametrize("override, refusal", [
    ("--ep_size=3", "ep_size=3 must divide moe_experts=8: each rank of an expert group holds moe_experts / ep_size "
                    "experts (init_from {} sets moe_experts=8)"),
    ("--cp_size=3", "cp_size=3 must divide n_head=4: Ulysses splits each row's tokens and attention's heads over "
                    "cp_size ranks (cp_mode: ring has no head-count limit) (init_from {} sets n_head=4)"),
])
def test_a_check_of_a_folders_key_runs_once_it_is_read_and_names_it(override, refusal, qwen3_moe_folder):
    """Reading the config leaves the model's checks to the folder's keys (launch checks the world size)."""
    assert defined(qwen3_moe_folder, override) == "error: " + refusal.format(qwen3_moe_folder)


@pytest.mark.parametrize("override, said", [
    # keys the folder leaves unset, where its class computes without them: refused before any work
    ("--logit_softcap=15", "error: init_from {} holds a Qwen3ForCausalLM: logit_softcap: 15.0: Qwen3ForCausalLM has "
                           "no logit soft cap, so the run would train another model than the folder's: drop "
                           "logit_softcap from the config and the command line"),
    ("--value_embeds=1", "error: init_from {} holds a Qwen3ForCausalLM: value_embeds: 1: Qwen3ForCausalLM has no value "
                         "embeddings, so the run would train another"),
    ("--mlp=relu2", "error: init_from {} holds a Qwen3ForCausalLM: mlp: relu2: Qwen3ForCausalLM computes swiglu MLPs "
                    "only"),
    # the context keys change as on a resume (no weights change), said in a note
    ("--rope_theta=2000000", "note: the context changes from init_from {}: rope_theta 1000000.0 -> 2000000.0; the "
                             "weights are the folder's"),
    ("--block_size=512", "note: the context changes from init_from {}: block_size 512, past the 256 positions of its "
                         "config.json; the weights are the folder's"),
])
def test_a_key_the_folder_leaves_unset_is_its_class_or_a_context_change(override, said, qwen3_folder):
    got = defined(qwen3_folder, override)
    assert got.startswith(said.format(qwen3_folder)), got


@pytest.mark.parametrize("folder, overrides, said", [
    # a null is a value: a context key takes it as a resume does, any other is refused as any value is
    ("mistral", ["--sliding_window=null"], "note: the context changes from init_from {}: sliding_window 16 -> null; "
                                           "the weights are the folder's"),
    ("gemma3", ["--window_pattern=[global]", "--rope_local_theta=null"],
     "note: the context changes from init_from {}: rope_local_theta 20000.0 -> null, window_pattern ['local', 'global'] "
     "-> ['global']; the weights are the folder's"),
    # the refusal's advice names the folder's keys, not the value the user gave
    ("gemma3", ["--window_pattern=[global]"], "error: rope_local_theta=20000 is the local layers' RoPE base, and no "
     "layer is local (window_pattern ['global'] over 2 layers): make a layer local (sliding_window, window_pattern), "
     "or set rope_local_theta: null (every layer on rope_theta) (init_from {} sets rope_theta=1000000.0, "
     "rope_local_theta=20000.0, sliding_window=16)"),
    ("mistral", ["--n_kv_head=null"], "error: init_from {} has n_kv_head=2 but the config sets n_kv_head=null: drop "
                                      "n_kv_head from the config and the command line, or set --n_kv_head=2"),
    # a null that settles to the folder's value contradicts nothing (Gemma 3 normalises q and k: its default)
    ("gemma3", ["--qk_norm=null"], ""),  # and says nothing
])
def test_a_null_beside_init_from_is_applied_or_refused(folder, overrides, said, tmp_path_factory, gemma3_folder):
    path = gemma3_folder if folder == "gemma3" else family_folder(tmp_path_factory, folder)
    got = defined(path, *overrides)
    assert got.startswith(said.format(path)) if said.startswith("error") else got == said.format(path), got


@pytest.mark.compat  # and on transformers 4.51 (CI's oldest venv)
def test_llama3_rope_scaling_gives_transformers_logits_past_the_original_context(tmp_path):
    """A Llama folder with Llama 3.1's rope_scaling (original context 32): model.GPT built from it
    (init_from's reader) gives transformers' logits at every position of a 200-token row, and the
    export writes the scaling back."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdp_gpt.hf_format import hf_config, read_hf_folder
    from fsdp_gpt.model import GPT, GPTConfig
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=500000.0,
                         rope_scaling=dict(scaling), tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    keys, state = read_hf_folder(str(tmp_path))
    assert keys["rope_scaling"] == scaling
    cfg = GPTConfig(**(keys | dict(block_size=200)))
    ours = GPT(cfg).eval()
    ours.load_state_dict(state)
    x = torch.randint(0, 128, (2, 200))
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], hf(x).logits, rtol=1e-4, atol=1e-4)
        plain = GPT(GPTConfig(**(keys | dict(block_size=200, rope_scaling=None)))).eval()
        plain.load_state_dict(state)
        assert (plain(x)[0] - hf(x).logits).abs().max() > 1e-3  # 10x the agreement: the scaling matters here
    assert hf_config(cfg, 0)["rope_scaling"] == scaling
    config.rope_scaling = dict(scaling, rope_type="dynamic")
    config.save_pretrained(tmp_path)
    from fsdp_gpt.config import UserError
    with pytest.raises(UserError, match=r"RoPE scaling of type 'dynamic' is not built here \(only llama3, Llama 3.1's, "
                                        r"and yarn\)"):
        read_hf_folder(str(tmp_path))


@pytest.mark.compat  # the export loads in transformers 4.51 as in 5 (CI's oldest venv)
@pytest.mark.parametrize("folder", ["qwen3_folder", "llama_folder", "gemma3_folder"])
def test_end_to_end_prepare_continue_on_two_ranks_export_and_evaluate(folder, request, tmp_path):
    """data.py prepare --tokenizer=FOLDER -> init_from: FOLDER on 2 ranks -> export: transformers loads
    the export, its tokenizer encodes as the folder's, its loss on the val windows is evaluate.py's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import as_gpt, evaluated
    from fsdp_gpt.data.prepare import prepare_data
    from fsdp_gpt.evaluation.val_loss import val_loss_sums
    from fsdp_gpt.data.loader import BatchLoader
    from fsdp_gpt.data.tokenizer import HFTokenizer
    folder = request.getfixturevalue(folder)
    write_docs(tmp_path / "docs.jsonl", n=200)
    tool("data.py", "prepare", tmp_path / "prepared", tmp_path / "docs.jsonl", f"--tokenizer={folder}", "--workers=2")
    result = run(tmp_path, bare_config(tmp_path, None), nproc=2, init_from=folder, **(SMALL | dict(max_iters=4)))
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = tmp_path / "ckpt" / "fsdp_cpt4.pth"
    tool("export_hf.py", checkpoint, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    text = (tmp_path / "docs.jsonl").read_text()[:2000]
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").encode(text, add_special_tokens=False) == \
        HFTokenizer(folder).encode_ordinary(text)
    meta = prepare_data(str(tmp_path / "prepared"), None, folder)
    loader = BatchLoader({"data": (str(tmp_path / "prepared"), meta)}, SMALL["block_size"], 2, 2, 0, 1, 1337,
                         torch.device("cpu"))
    with torch.no_grad():
        total, windows = val_loss_sums(as_gpt(hf), loader, SMALL["train_batch"])[0].tolist()
    assert total / windows == pytest.approx(evaluated(checkpoint), abs=1e-4)
    # sampling and multiple-choice evaluation take the run's tokenizer from the checkpoint
    assert tool("sample.py", checkpoint, "--max_new_tokens", "8", "--seed", "1").strip()
    write_items(tmp_path / "mc.jsonl", 8, seed=0)
    assert "acc_norm" in tool("evaluate.py", checkpoint, "--mc", tmp_path / "mc.jsonl")


@pytest.mark.compat
def test_a_gemma3_folder_trains_with_no_model_keys_and_exports_as_it_came(gemma3_folder, tmp_path):
    """init_from a Gemma 3 folder: its keys (the window and pattern, both RoPE bases, the attention
    scale, the soft cap, q/k norms, four norms a block) from config.json alone; a step at learning rate
    0 exports the same weights, and the checkpoint's model computes transformers' logits on rows
    longer than the window (within 1e-4); the export's config.json holds what transformers 4.5x reads
    beside 5's keys: without 5's, the same model (its local base, 20,000, was 4.51's default 10,000)."""
    import yaml
    write_docs(tmp_path / "docs.jsonl", n=60)
    settings = SMALL | AT_LR_0 | dict(tokenizer=gemma3_folder)
    result = run(tmp_path, bare_config(tmp_path, tmp_path / "docs.jsonl"), init_from=gemma3_folder, **settings)
    assert result.returncode == 0, result.stderr[-3000:]
    for key, value in dict(arch="gemma3", sliding_window=16, window_pattern=["local", "global"], rope_theta=1000000.0,
                           rope_local_theta=20000.0, attn_scale_dim=24, logit_softcap=30.0, qk_norm=True,
                           mlp="geglu").items():
        assert "\n" + yaml.safe_dump({key: value}) in result.stdout, key  # the resolved config it prints
    tool("export_hf.py", tmp_path / "ckpt" / "fsdp_cpt1.pth", tmp_path / "hf")
    config = exported_as_it_came(gemma3_folder, tmp_path / "ckpt" / "fsdp_cpt1.pth", tmp_path / "hf",
                                 ("rope_parameters", "layer_types"))
    assert (config["rope_theta"], config["rope_local_base_freq"], config["sliding_window_pattern"]) == (1e6, 2e4, 2)


@pytest.mark.compat
def test_a_folder_of_another_architecture_is_named(tmp_path):
    import json

    from fsdp_gpt.config import UserError
    from fsdp_gpt.hf_format import hf_classes, hf_model_keys
    # a masked model, never a family here; the classes named are the families' table's, multimodal ones among them
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "hidden_size": 64}))
    classes = list(hf_classes())
    assert "LlamaForCausalLM" in classes and "Qwen3_5ForConditionalGeneration" in classes
    with pytest.raises(UserError, match=re.escape(f"init_from: {tmp_path}/ holds a BertForMaskedLM (config.json's "
                                                  f"architectures); this trainer starts from {', '.join(classes)}")):
        hf_model_keys(str(tmp_path))


# ---- the families people continue (issue 63): each from a folder its transformers class saved ----

def family_tokenizer(folder, kind: str, tokenizer_class: str) -> None:
    """A tokenizer of the family's kind beside its folder, under the class its tokenizer_config.json
    names, as the family's folders do: transformers 5 rebuilds some classes from their own pipeline
    (Qwen2Tokenizer: NFC, Qwen2's split, bytes; Qwen3_5Tokenizer: its own split), so the file is made
    with that pipeline too."""
    import json

    import tokenizers
    from tokenizers import Regex, normalizers, pre_tokenizers
    if kind == "sentencepiece":  # Llama 2's kind: Mistral's, Phi-3's
        make_sentencepiece_tokenizer(folder)
    else:  # byte-level BPE: Qwen2's, OLMo 2's, SmolLM3's, Qwen3.5's (single digits, marks with their letters)
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
        if kind == "qwen3_5":
            from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX
        make_tokenizer(folder, vocab_size=500)
        path = os.path.join(folder, "tokenizer.json")
        tok = tokenizers.Tokenizer.from_file(path)
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.save(path)
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump(config | {"tokenizer_class": tokenizer_class}, f)


SHAPE = dict(vocab_size=576, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
NOT_IN_CLASS = object()  # a key of SHAPE a family's configuration class has no place for (Qwen3.5-MoE's intermediate_size)
# Qwen3.5's shape beside SHAPE: heads of 16 (RoPE on 4 of their dimensions), its layer types
QWEN3_5 = dict(head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
# a folder of each family: its transformers class, config.json's keys beside SHAPE (the features it maps),
# its tokenizer's kind and class
FOLDERS = {
    "qwen2": ("Qwen2ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=False), "bytelevel", "Qwen2Tokenizer"),
    # v0.1's window, shorter than the rows of 64 (v0.3's none: tests/test_families.py)
    "mistral": ("MistralForCausalLM", dict(sliding_window=16), "sentencepiece", "LlamaTokenizer"),
    "olmo2": ("Olmo2ForCausalLM", dict(rope_theta=5e5, rms_norm_eps=1e-6), "bytelevel", "GPT2Tokenizer"),
    # a window (shorter than the rows of 64) on the layer layer_types names sliding, the other full, YaRN on the
    # full layer alone past an original context of 32, as the long-context models have it
    "olmo3": ("Olmo3ForCausalLM", dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                                       rope_theta=1e6, rope_scaling=dict(rope_type="yarn", factor=8.0, beta_fast=32,
                                                                         beta_slow=1, attention_factor=1.2079,
                                                                         original_max_position_embeddings=32),
                                       pad_token_id=None), "bytelevel", "GPT2Tokenizer"),
    # Phi-3-mini-4k's window on every layer; its class's pad token, 32000, is past this vocabulary
    "phi3": ("Phi3ForCausalLM", dict(sliding_window=16, pad_token_id=None), "sentencepiece", "LlamaTokenizer"),
    # Phi-4-mini's RoPE on the first 3/4 of each head, its byte-level tokenizer
    "phi4_mini": ("Phi3ForCausalLM", dict(partial_rotary_factor=0.75, pad_token_id=None), "bytelevel", "GPT2Tokenizer"),
    # the second layer without RoPE; its class's pad token, 128004, is past this vocabulary
    "smollm3": ("SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0], pad_token_id=None), "bytelevel",
                "PreTrainedTokenizerFast"),
    "qwen3_5": ("Qwen3_5ForCausalLM", QWEN3_5 | dict(tie_word_embeddings=True), "qwen3_5", "Qwen3_5Tokenizer"),
    # 4 experts, top 2, a shared expert as wide as one of them
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", QWEN3_5 | dict(intermediate_size=NOT_IN_CLASS, num_experts=4,
                                                           num_experts_per_tok=2, moe_intermediate_size=32,
                                                           shared_expert_intermediate_size=32), "qwen3_5",
                    "Qwen3_5Tokenizer"),
    # DeepSeek V3's kind (Moonlight's, Kimi K2's): q through a low rank, RoPE by pairs with YaRN (mscale in the
    # scale), a dense first layer, 8 experts in 4 groups beside a shared one; its folders' tokenizer class names
    # Llama's over a byte-level tokenizer.json (transformers 5 loads it as the file says)
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, num_nextn_predict_layers=0, pad_token_id=None,
        rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0)),
        "bytelevel", "LlamaTokenizerFast"),
    # DeepSeek-V2-Lite's: one q matrix, softmax scores as they are, two shared experts
    "deepseek_v2": ("DeepseekV2ForCausalLM", dict(
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1,
        topk_method="greedy", norm_topk_prob=False, pad_token_id=None), "bytelevel", "LlamaTokenizerFast"),
}


# the rows a family's folder trains on where longer than SMALL's 64: Qwen3.5's linear layers compute by chunks of 64
# tokens (its class too), so its rows pass two chunks and end inside a third
ROWS = {"qwen3_5": 150, "qwen3_5_moe": 150}


def family_folder(tmp_path_factory, name: str, inside: tuple[str, dict, dict] | None = None) -> str:
    """The family's folder, saved by the transformers installed (5.x, or 4.51 in CI's oldest venv), every
    weight away from its initial value (biases from zeros, norms from ones), made once a session. inside:
    (a multimodal class, its other configs, files beside the weights): the family's model as that class's
    language model (config.json's text_config)."""
    import torch
    import transformers
    architecture, keys, kind, tokenizer_class = FOLDERS[name]
    architecture, others, files = inside or (architecture, None, {})
    needs_class(architecture)

    def make(folder: str) -> None:
        text = {k: v for k, v in (SHAPE | keys).items() if v is not NOT_IN_CLASS}
        config_class = getattr(transformers, architecture).config_class
        config = config_class(**text) if others is None else config_class(
            text_config=text, tie_word_embeddings=text.get("tie_word_embeddings", False), **others)
        torch.manual_seed(0)
        model = getattr(transformers, architecture)(config)
        with torch.no_grad():  # the buffers a folder holds too (DeepSeek V3's selection bias)
            for name, p in [*model.named_parameters(), *model.named_buffers()]:
                if name in model.state_dict():
                    p.add_(torch.randn_like(p) * 0.05)
        model.save_pretrained(folder)
        family_tokenizer(folder, kind, tokenizer_class)
        for file, content in files.items():
            with open(os.path.join(folder, file), "w") as f:
                f.write(content)
    return shared(tmp_path_factory, f"family_{name}_{architecture}_{transformers.__version__}", make)


@pytest.mark.compat  # and on transformers 4.51, where it has the class (CI's oldest venv)
@pytest.mark.parametrize("name", FOLDERS)
def test_a_family_continues_from_its_folder_and_exports_as_it_came(name, tmp_path_factory, tmp_path):
    """init_from a family's folder with no model keys: its tokenizer prepares the data as transformers
    encodes it; a step at learning rate 0 keeps its weights, which compute transformers' logits
    (within 1e-4, on rows longer than any window), and the export loads as its class with the folder's
    logits exactly; 2 ranks train as one process (1e-5)."""
    import json

    import numpy
    from transformers import AutoTokenizer

    import export_hf
    from fsdp_gpt.data.prepare import VAL_EVERY, prepare_data
    folder = family_folder(tmp_path_factory, name)
    docs = write_docs(tmp_path / "docs.jsonl", n=60)
    docs[-1] += "\n\n 2023 650841823  two  spaces\r\n"  # digits, runs of spaces and newlines split per family
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    meta = prepare_data(str(tmp_path / "prepared"), [str(tmp_path / "docs.jsonl")], folder)
    theirs = AutoTokenizer.from_pretrained(folder)
    prepared = {split: numpy.fromfile(tmp_path / "prepared" / f"{split}.bin", dtype=meta["dtype"]).tolist()
                for split in ("train", "val")}
    in_order = sorted(enumerate(docs), key=lambda doc: doc[0] % VAL_EVERY == VAL_EVERY - 1)  # train's, then val's
    assert prepared["train"] + prepared["val"] == [
        token for _, doc in in_order for token in theirs.encode(doc, add_special_tokens=False) + [meta["eot_token"]]]
    config, small = bare_config(tmp_path, None), SMALL | dict(block_size=ROWS.get(name, SMALL["block_size"]))
    (tmp_path / "kept").mkdir()
    kept = run(tmp_path / "kept", config, init_from=folder, **(small | AT_LR_0 | dict(eval_interval=100, sample_tokens=0)))
    assert kept.returncode == 0, kept.stderr[-3000:]
    checkpoint = tmp_path / "kept" / "ckpt" / "fsdp_cpt1.pth"
    export_hf.export(str(checkpoint), str(tmp_path / "hf"))
    exported_as_it_came(folder, checkpoint, tmp_path / "hf", ("rope_parameters",), small["block_size"])  # 4.5x: rope_theta
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").encode(docs[-1], add_special_tokens=False) == \
        theirs.encode(docs[-1], add_special_tokens=False)
    logged = {}
    for nproc in (1, 2):
        (tmp_path / f"ranks{nproc}").mkdir()
        result = run(tmp_path / f"ranks{nproc}", config, nproc, init_from=folder, **(small | dict(sample_tokens=0)))
        assert result.returncode == 0, result.stderr[-3000:]
        logged[nproc] = {tag: scalars(tmp_path / f"ranks{nproc}" / "tb", tag) for tag in ("train/loss", "val/loss")}
    for tag, values in logged[1].items():
        assert values and logged[2][tag] == pytest.approx(values, rel=1e-5), tag

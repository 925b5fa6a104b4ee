"""Export a checkpoint as a Hugging Face folder (needs `pip install transformers`): its family's
class (fsdp_gpt/families.py: GPT2LMHeadModel, LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM).

python export_hf.py CHECKPOINT OUT_DIR [--dtype fp32|bf16] [--max_shard_size 5GB]

CHECKPOINT: a full file, any rank's file of a sharded set, or a folder (its newest complete
checkpoint). OUT_DIR gets config.json and the weights as safetensors (shards of at most
--max_shard_size with their index for large models), which
transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR) loads with model.GPT's logits, and the
run's tokenizer: a Hugging Face tokenizer's files copied (its tokenizer_config.json in a form
transformers 4.51 and 5.x both load, whichever wrote it), a tiktoken encoding or bytes converted
(encoding alike). --dtype fp32 (the default) writes the trained weights exactly;
bf16 halves the folder (for serving and sharing) at bf16's rounding of every weight.
"""
import argparse
import glob
import json
import os
import re
import shutil
import sys

import torch

from fsdp_gpt.config import UserError, exit_code
from fsdp_gpt.data.tokenizer import ByteTokenizer, HFTokenizer, get_tokenizer
from fsdp_gpt.files import read_json
from fsdp_gpt.checkpoint.ckpt_format import read_model
from fsdp_gpt.hf_format import fused_like, hf_config, to_hf
from fsdp_gpt.model import GPTConfig

def oniguruma_pattern(pattern: str) -> str:
    r"""tiktoken's regex for the tokenizers library: Oniguruma reads a possessive `{1,3}+` as a
    repeat (greedy forms split these patterns alike) and `$` as any line's end (`\z`: the text's)."""
    return re.sub(r"([+*?}])\+", r"\1", pattern).replace("$", r"\z")


def save_bpe(ranks: dict[bytes, int], special: dict[str, int], pattern: str | None, eot: int, out_dir: str) -> None:
    """A byte-level BPE (tiktoken's ranks) as Hugging Face tokenizer files; `eot`: the separator's id."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_to_char = bytes_to_unicode()  # GPT-2's printable stand-in for every byte

    def text(token: bytes) -> str:
        return "".join(byte_to_char[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()} | special
    # tiktoken merges the adjacent pair whose union ranks lowest: every split of a token into
    # two tokens is a merge, ordered by the rank of the token it makes
    merges = sorted(((token[:i], token[i:], rank) for token, rank in ranks.items() for i in range(1, len(token))
                     if token[:i] in ranks and token[i:] in ranks), key=lambda m: m[2])
    bpe = Tokenizer(BPE(vocab, [(text(left), text(right)) for left, right, _ in merges], ignore_merges=True))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.pre_tokenizer = byte_level if pattern is None else pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(oniguruma_pattern(pattern)), behavior="isolated"), byte_level])
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(list(special))
    eot_text = next(token for token, i in vocab.items() if i == eot)
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=eot_text, eos_token=eot_text).save_pretrained(out_dir)


def save_tokenizer(tokenizer, out_dir: str, block_size: int) -> None:
    """The run's tokenizer as Hugging Face files: a Hugging Face one's copied (its special tokens and
    chat template kept); tiktoken's BPE and raw bytes (each byte its own token, byte 0 the separator)
    converted, their tokenizer_config.json saying the context the model was trained on. Either way
    that file is one transformers 4.51 and 5.x both read (portable_tokenizer_config)."""
    os.makedirs(out_dir, exist_ok=True)
    if isinstance(tokenizer, HFTokenizer):
        source = os.path.dirname(tokenizer.name) if os.path.isfile(tokenizer.name) else tokenizer.name
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if os.path.isfile(os.path.join(source, name)):
                shutil.copy(os.path.join(source, name), out_dir)
        portable_tokenizer_config(out_dir, source, {})
        return
    if isinstance(tokenizer, ByteTokenizer):
        save_bpe({bytes([b]): b for b in range(256)}, {}, None, tokenizer.eot_token, out_dir)
    else:
        save_bpe(tokenizer._mergeable_ranks, tokenizer._special_tokens, tokenizer._pat_str, tokenizer.eot_token,
                 out_dir)
    portable_tokenizer_config(out_dir, out_dir, {"model_max_length": block_size})


def portable_tokenizer_config(out_dir: str, source: str, settings: dict) -> None:
    """out_dir's tokenizer_config.json rewritten, with `settings`, as transformers 4.51 and 5.x both
    read it, whichever version wrote it:
    - a generic class becomes PreTrainedTokenizerFast, which both read from tokenizer.json alone:
      transformers 5's *Backend (TokenizersBackend), which 4.x refuses; 4.x's PreTrainedTokenizer
      (it drops "Fast" when it saves); none;
    - 5's list of extra special tokens (`extra_special_tokens`, a name 4.x keeps for a dict of named
      ones: a list fails there) goes under additional_special_tokens, which both read;
    - 5's chat templates (chat_template.jinja, named ones in additional_chat_templates/, which 4.51
      does not read) go into the chat_template key, which both read."""
    path = os.path.join(out_dir, "tokenizer_config.json")
    config = read_json(path, "the tokenizer's folder is damaged") if os.path.isfile(path) else {}
    if str(config.get("tokenizer_class") or "PreTrainedTokenizer").endswith(("Backend", "PreTrainedTokenizer")):
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(config.get("extra_special_tokens"), list):
        listed = config.get("additional_special_tokens", [])
        config["additional_special_tokens"] = listed + [t for t in config.pop("extra_special_tokens") if t not in listed]
    files = {"default": os.path.join(source, "chat_template.jinja")} | {
        os.path.basename(file).removesuffix(".jinja"): file
        for file in sorted(glob.glob(os.path.join(source, "additional_chat_templates", "*.jinja")))}
    templates = {}
    for name, file in files.items():
        if os.path.isfile(file):
            with open(file, encoding="utf-8") as f:
                templates[name] = f.read()
    if templates:
        config["chat_template"] = templates["default"] if list(templates) == ["default"] else [
            {"name": name, "template": text} for name, text in templates.items()]
    with open(path, "w") as f:
        json.dump(config | settings, f, indent=2)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_legacy_keys(path: str, keys: dict, dtype: str) -> None:
    """transformers 5 writes RoPE's settings into rope_parameters and the dtype as `dtype`, which
    transformers 4 does not read (it would run plain RoPE at theta 10,000): the 4.x keys go beside
    them, with the same values, so that both load the same model."""
    with open(path) as f:
        config = json.load(f)
    # and the experts' count under both versions' names
    legacy = {k: keys[k] for k in ("rope_theta", "rope_scaling", "num_experts", "num_local_experts") if k in keys}
    config |= legacy | {"torch_dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype]}
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def export(checkpoint: str, out_dir: str, dtype: str = "fp32", max_shard_size: str = "5GB") -> None:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise UserError("export_hf.py needs transformers: pip install transformers")
    ckpt, state = read_model(checkpoint)
    cfg = GPTConfig(**ckpt["model_config"])
    tokenizer = get_tokenizer(ckpt["config"]["tokenizer"])
    keys = hf_config(cfg, tokenizer.eot_token)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(keys.pop("model_type"), **keys))
    model.load_state_dict(fused_like(to_hf(state, cfg), model.state_dict()))
    model.to(DTYPES[dtype]).config.torch_dtype = DTYPES[dtype]
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    # a fresh dict: AutoConfig took `keys` and wrote into its rope_scaling
    add_legacy_keys(os.path.join(out_dir, "config.json"), hf_config(cfg, tokenizer.eot_token), dtype)
    save_tokenizer(tokenizer, out_dir, cfg.block_size)
    print(f"wrote {out_dir}/ ({cfg.family.hf_class} in {dtype}, tokenizer files of '{ckpt['config']['tokenizer']}') "
          f"from {checkpoint}, step {ckpt['step']}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a full file, any rank's file of a sharded set, or a folder")
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="fp32 (exact; default) or bf16 (half the size)")
    parser.add_argument("--max_shard_size", default="5GB", help="largest safetensors file (default 5GB)")
    args = parser.parse_args(argv)
    export(args.checkpoint, args.out_dir, args.dtype, args.max_shard_size)
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(lambda: main(sys.argv[1:])))

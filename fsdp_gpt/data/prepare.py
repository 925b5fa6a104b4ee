"""Datasets: corpora prepared into token files (the work of `python data.py prepare`). No torch
here, so tokenizing worker processes start light (loader.py reads the token files back and turns
them into batches).

SOURCE: text files (one document each), .jsonl / .jsonl.gz (a `text` field per line), .parquet
(a `text` column), folders of them, globs, or `stdlib` (the offline corpus). A prepared data_path
holds train.bin and val.bin (token ids, uint16 when the vocabulary fits, else uint32, a
document separator after each document; every 20th document goes to val) and meta.json.
Read as they are: nanoGPT's raw train.bin/val.bin (uint16, no meta.json) and folders of llm.c /
modded-nanogpt shards (*_train_*.bin, *_val_*.bin).

Preparation streams: documents go to the tokenizing workers in ~1 MB chunks, a few chunks in
flight at a time, and come back in order to be appended to temp files, renamed when complete.
The bytes depend on the documents alone: not on the workers, chunking or source format.
"""
import collections
import fcntl
import glob
import gzip
import json
import multiprocessing
import os
import sysconfig
import time
from dataclasses import dataclass

import numpy as np

from fsdp_gpt.config import UserError
from fsdp_gpt.data.tokenizer import get_tokenizer, is_hf_tokenizer
from fsdp_gpt.files import read_json

DOCUMENT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl", ".jsonl.gz", ".parquet")
STDLIB_CORPUS_BYTES = 16 << 20  # enough text for the demo, quick to tokenize
VAL_EVERY = 20  # every 20th document goes to val.bin
CHUNK_BYTES = 1 << 20  # text per task sent to a worker
LLMC_HEADER_INTS = 256  # llm.c shards: 256 int32 header (magic, version, token count, ...), then the tokens


@dataclass(frozen=True)
class LlmcFormat:
    magic: int
    dtype: str  # of the tokens
    tokenizer: str
    vocab_size: int
    separator: int  # the token llm.c writes before each document


# by header version: GPT-2 shards, and Llama 3's (whose tokenizer tiktoken can't load: text samples are skipped)
LLMC_FORMATS = {1: LlmcFormat(20240520, "uint16", "gpt2", 50257, 50256),
                7: LlmcFormat(20240801, "uint32", "llama3", 128256, 128000)}


# ---- sources and their documents ----
def source_files(sources) -> list[str]:
    files = []
    for source in sources if isinstance(sources, list) else [sources]:
        if source == "stdlib":
            files += _stdlib_files()
            continue
        matches = sorted(glob.glob(os.path.expanduser(source), recursive=True))
        if not matches:
            raise UserError(f"data_source '{source}' matches no file or folder")
        for match in matches:
            if os.path.isdir(match):
                files += sorted(p for p in glob.glob(os.path.join(match, "**", "*"), recursive=True)
                                if p.endswith(DOCUMENT_SUFFIXES) and os.path.isfile(p))
            else:
                files.append(match)
    if not files:
        raise UserError(f"data_source {sources!r} holds no documents ({', '.join(DOCUMENT_SUFFIXES)})")
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


def _jsonl_chunks(path: str):
    """(first line number, raw lines, bytes of the file consumed): workers parse the JSON."""
    with open(path, "rb") as raw:
        lines = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
        chunk, size, first = [], 0, 1
        for line_no, line in enumerate(lines, 1):
            chunk.append(line)
            size += len(line)
            if size >= CHUNK_BYTES:
                yield first, chunk, raw.tell()
                chunk, size, first = [], 0, line_no + 1
        if chunk:
            yield first, chunk, raw.tell()


def _parquet_chunks(path: str, text_field: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path}: reading parquet needs pyarrow: pip install pyarrow")
    parquet = pq.ParquetFile(path)
    if text_field not in parquet.schema_arrow.names:
        raise UserError(f"{path}: no column '{text_field}' (columns: {', '.join(parquet.schema_arrow.names)}); "
                        f"set --text_field")
    size, row = os.path.getsize(path), 0
    for group in range(parquet.num_row_groups):  # a row group at a time: memory stays bounded
        texts = parquet.read_row_group(group, columns=[text_field]).column(0).to_pylist()
        for start in range(0, len(texts), 1000):
            yield row + start + 1, texts[start:start + 1000], size * (group + 1) // parquet.num_row_groups
        row += len(texts)


def _chunks(files: list[str], text_field: str):
    """Tasks for the workers, in document order: (path, kind, first line/row, items, bytes done)."""
    done = 0
    for path in files:
        if path.endswith((".jsonl", ".jsonl.gz")):
            for first, lines, consumed in _jsonl_chunks(path):
                yield path, "jsonl", first, lines, done + consumed
        elif path.endswith(".parquet"):
            for first, texts, consumed in _parquet_chunks(path, text_field):
                yield path, "texts", first, texts, done + consumed
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield path, "texts", 1, [f.read()], done + os.path.getsize(path)
        done += os.path.getsize(path)


# ---- tokenizing (in worker processes, or in this one) ----
_worker = {}


def _init_worker(tokenizer: str, text_field: str, skip_bad: bool) -> None:
    _worker.update(tokenizer=get_tokenizer(tokenizer), text_field=text_field, skip_bad=skip_bad)


def _texts(path: str, kind: str, first: int, items: list):
    """The documents of one chunk; a malformed one stops with file:line unless skipped."""
    for i, item in enumerate(items):
        if kind == "jsonl":
            if not item.strip():
                continue
            try:
                item = json.loads(item)[_worker["text_field"]]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
                item = None
        if isinstance(item, str):
            yield item
        elif not _worker["skip_bad"]:
            what = "line" if kind == "jsonl" else "row"
            raise UserError(f"{path}:{first + i}: {what} has no '{_worker['text_field']}' text; fix it, or pass "
                            f"--skip_bad_lines to count and skip such {what}s")
        else:
            yield None


def _tokenize(task) -> tuple[np.ndarray, list[int], int, int]:
    """(tokens of the chunk's documents, each followed by the separator; document lengths; bad
    documents skipped; bytes of the sources consumed)."""
    path, kind, first, items, consumed = task
    tokenizer, ids, lengths, skipped = _worker["tokenizer"], [], [], 0
    for text in _texts(path, kind, first, items):
        if text is None:
            skipped += 1
            continue
        doc = tokenizer.encode_ordinary(text) + [tokenizer.eot_token]
        ids += doc
        lengths.append(len(doc))
    return np.array(ids, dtype=np.uint16 if tokenizer.n_vocab <= 1 << 16 else np.uint32), lengths, skipped, consumed


def _tokenized(files: list[str], tokenizer: str, workers: int, text_field: str, skip_bad: bool):
    """Tokenized chunks in document order. 1 worker: in this process; more: that many processes,
    at most two chunks each in flight (memory stays bounded however large the corpus)."""
    init = (tokenizer, text_field, skip_bad)
    if workers == 1:
        _init_worker(*init)
        yield from map(_tokenize, _chunks(files, text_field))
        return
    with multiprocessing.get_context("spawn").Pool(workers, _init_worker, init) as pool:
        pending = collections.deque()
        for task in _chunks(files, text_field):
            pending.append(pool.apply_async(_tokenize, (task,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ---- preparation ----
class _Progress:
    def __init__(self, total_bytes: int):
        self.total, self.start, self.last = total_bytes, time.perf_counter(), 0.0

    def show(self, docs: int, consumed: int, tokens: int, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - self.last < 5:
            return
        self.last, rate = now, consumed / max(now - self.start, 1e-9)
        eta = (self.total - consumed) / rate if rate else 0
        print(f"{docs:,} documents | {consumed / 1e6:,.1f} of {self.total / 1e6:,.1f} MB | {tokens / 1e6:,.1f}M "
              f"tokens | {rate / 1e6:.1f} MB/s | ETA {eta:.0f}s", flush=True)


def _prepare(data_path: str, sources, tokenizer_name: str, tokenizer, workers: int = 1, text_field: str = "text",
             skip_bad: bool = False) -> None:
    """tokenizer: get_tokenizer(tokenizer_name) (each worker loads its own by name)."""
    tokenizer_name = tokenizer.name if is_hf_tokenizer(tokenizer_name) else tokenizer_name  # an absolute path
    dtype = np.dtype(np.uint16 if tokenizer.n_vocab <= 1 << 16 else np.uint32)
    files = source_files(sources)
    print(f"preparing {data_path} from {len(files)} files with tokenizer '{tokenizer_name}', {workers} "
          f"worker{'s' * (workers > 1)}", flush=True)
    tmp = {split: os.path.join(data_path, f"{split}.bin.tmp") for split in ("train", "val")}
    counts = {"train": 0, "val": 0}
    docs = skipped = 0
    progress = _Progress(sum(os.path.getsize(f) for f in files))
    with open(tmp["train"], "wb") as train, open(tmp["val"], "wb") as val:
        for tokens, lengths, bad, consumed in _tokenized(files, tokenizer_name, workers, text_field, skip_bad):
            start = 0
            for length in lengths:  # the split of a document depends on its index in the corpus alone
                split = "val" if docs % VAL_EVERY == VAL_EVERY - 1 else "train"
                tokens[start:start + length].tofile(val if split == "val" else train)
                counts[split] += length
                start += length
                docs += 1
            skipped += bad
            progress.show(docs, consumed, sum(counts.values()))
        if counts["val"] == 0:  # too few documents to split by document: val is the stream's tail
            cut = int(counts["train"] * (1 - 1 / VAL_EVERY))
            train.flush()
            with open(tmp["train"], "rb") as f:
                f.seek(cut * dtype.itemsize)
                val.write(f.read())
            train.truncate(cut * dtype.itemsize)
            counts = {"train": cut, "val": counts["train"] - cut}
        for f in (train, val):
            f.flush()
            os.fsync(f.fileno())
    progress.show(docs, progress.total, sum(counts.values()), final=True)
    meta = {"tokenizer": tokenizer_name, "vocab_size": tokenizer.n_vocab, "eot_token": tokenizer.eot_token,
            "dtype": dtype.name, "train_tokens": counts["train"], "val_tokens": counts["val"], "documents": docs,
            "skipped": skipped, "sources": sources} | (
        {"tokenizer_sha256": tokenizer.sha256} if hasattr(tokenizer, "sha256") else {})
    # meta.json first, the bins after: a folder counts as prepared only once both bins exist,
    # and a crash part-way leaves a meta.json that stops it passing for nanoGPT's format
    _write_atomically(os.path.join(data_path, "meta.json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))
    for split in ("train", "val"):
        os.replace(tmp[split], os.path.join(data_path, f"{split}.bin"))
    skipped_note = f", {skipped:,} malformed documents skipped" if skipped else ""
    print(f"prepared {counts['train']:,} train and {counts['val']:,} val tokens of {docs:,} documents in "
          f"{data_path}{skipped_note}", flush=True)


def _write_atomically(path: str, write) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_prepared(data_path: str) -> bool:
    return all(os.path.isfile(os.path.join(data_path, f"{s}.bin")) for s in ("train", "val")) or bool(
        llmc_shards(data_path, "train"))


def prepare_data(data_path: str, sources, tokenizer: str, **options) -> dict:
    """Prepare data_path if needed and return its metadata.

    Every rank of every launch may call this at once: an exclusive file lock lets the first
    one prepare while the others wait, then find the folder prepared. A preparation killed
    part-way leaves only temp files, which the next one starts over.
    """
    if not is_prepared(data_path):
        if not sources:
            raise UserError(f"no prepared data in '{data_path}' (train.bin, val.bin) and no data_source to prepare it "
                            f"from: python data.py prepare {data_path} YOUR_TEXT --tokenizer {tokenizer}")
        loaded = get_tokenizer(tokenizer)  # a bad tokenizer is refused before anything is written
        os.makedirs(data_path, exist_ok=True)
        with open(os.path.join(data_path, ".prepare.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not is_prepared(data_path):
                _prepare(data_path, sources, tokenizer, loaded, **options)
    if shards := llmc_shards(data_path, "train"):
        fmt = LLMC_FORMATS[llmc_header(shards[0])[0]]
        return {"tokenizer": fmt.tokenizer, "vocab_size": fmt.vocab_size, "eot_token": fmt.separator,
                "dtype": fmt.dtype, "format": "llm.c"}
    meta_path = os.path.join(data_path, "meta.json")
    again = f"prepare the data again (remove {data_path}/, then python data.py prepare, or a run with data_source set)"
    if not os.path.isfile(meta_path):  # nanoGPT's format: uint16 ids of the configured tokenizer
        meta = {"tokenizer": tokenizer, "vocab_size": None, "dtype": "uint16"}
    else:
        meta = read_json(meta_path, again, keys=("tokenizer", "dtype"))
    if meta["dtype"] not in ("uint16", "uint32"):
        raise UserError(f"{meta_path}: dtype {meta['dtype']!r} is not uint16 or uint32: {again}")
    for split in ("train", "val"):
        path, itemsize = os.path.join(data_path, f"{split}.bin"), np.dtype(meta["dtype"]).itemsize
        if os.path.getsize(path) % itemsize:
            raise UserError(f"{path} holds {os.path.getsize(path):,} bytes, not a whole number of {meta['dtype']} "
                            f"tokens: cut short? {again}")
    return meta


def prepare_sources(data_mix: dict | None, data_path: str, data_source, tokenizer: str) -> dict[str, tuple[str, dict]]:
    """{name: (folder, metadata)}: a mixture's sources (each prepared already: `data.py prepare`), or
    data_path (prepared from data_source on first use) as the one source "data". A mixture's
    sources must hold one tokenizer's tokens."""
    if data_mix is None:
        return {"data": (data_path, prepare_data(data_path, data_source, tokenizer))}
    sources = {name: (path, prepare_data(path, None, tokenizer)) for name, path in data_mix.items()}
    (first, (_, reference)), *others = sources.items()
    for name, (_, meta) in others:
        if (meta["tokenizer"], meta.get("vocab_size")) != (reference["tokenizer"], reference.get("vocab_size")):
            raise UserError(f"data_mix: {name} holds '{meta['tokenizer']}' tokens (vocabulary {meta.get('vocab_size')}), "
                            f"{first} '{reference['tokenizer']}' ones ({reference.get('vocab_size')}): prepare every "
                            f"source with one tokenizer")
    return sources


# ---- llm.c shards, read as they are ----
def llmc_shards(data_path: str, split: str) -> list[str]:
    return sorted(glob.glob(os.path.join(data_path, f"*_{split}_*.bin")))


def llmc_format(version: int) -> LlmcFormat:
    return LLMC_FORMATS[version]


def llmc_header(path: str) -> tuple[int, int]:
    """(version, token count) of an llm.c shard, checked against the file."""
    header = np.fromfile(path, dtype=np.int32, count=LLMC_HEADER_INTS)
    magics = {fmt.magic: version for version, fmt in LLMC_FORMATS.items()}
    if len(header) < LLMC_HEADER_INTS or int(header[0]) not in magics:
        raise UserError(f"{path} is not an llm.c token shard (its header has none of the magics "
                        f"{', '.join(map(str, magics))})")
    version, count = int(header[1]), int(header[2])
    if version != magics[int(header[0])]:
        raise UserError(f"{path}: llm.c shard version {version} with magic {int(header[0])} is not supported "
                        f"(only {', '.join(f'{f.magic} v{v}' for v, f in LLMC_FORMATS.items())})")
    expected = 4 * LLMC_HEADER_INTS + count * np.dtype(LLMC_FORMATS[version].dtype).itemsize
    if os.path.getsize(path) != expected:
        raise UserError(f"{path} holds {os.path.getsize(path):,} bytes, but its header says {count:,} tokens "
                        f"({expected:,} bytes): a truncated download? fetch it again")
    return version, count

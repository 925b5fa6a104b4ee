"""Preparation at scale (the `data.py prepare` command): the same bytes for any number of workers
and any source format, malformed lines, a killed preparation run again; llm.c token shards."""
import gzip
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time

import numpy as np
import pytest
import torch

from fsdp_gpt.data import prepare as data
from fsdp_gpt.config import UserError
from conftest import ROOT, run_trainer
from fsdp_gpt.data.loader import BatchLoader
from fsdp_gpt.data.tokenizer import get_tokenizer


@pytest.fixture(scope="module")
def documents() -> list[str]:
    """Real text with non-ASCII in it: ~2.5 MB of the standard library, one document per module."""
    stdlib = sysconfig.get_paths()["stdlib"]
    docs, total = [], 0
    for name in sorted(os.listdir(stdlib)):
        if name.endswith(".py") and total < 2_500_000:
            with open(os.path.join(stdlib, name), encoding="utf-8", errors="replace") as f:
                docs.append(f.read())
            total += len(docs[-1])
    return docs + ["naïve café – 東京 🙂"]


def write_jsonl(path, docs, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc, "id": len(doc)}) + "\n")
    return str(path)


def write_parquet(path, docs):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path, row_group_size=40)
    return str(path)


def prepare(data_path, *sources, workers=2, extra=(), **popen):
    cmd = [sys.executable, os.path.join(ROOT, "data.py"), "prepare", str(data_path), *map(str, sources),
           "--tokenizer=cl100k_base", f"--workers={workers}", *extra]
    if popen:
        return subprocess.Popen(cmd, **popen)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def token_files(data_path) -> tuple[bytes, bytes]:
    return tuple(open(os.path.join(data_path, f"{split}.bin"), "rb").read() for split in ("train", "val"))


def test_same_bytes_for_any_number_of_workers(documents, tmp_path):
    half = len(documents) // 2
    sources = [write_jsonl(tmp_path / "a.jsonl", documents[:half]), write_jsonl(tmp_path / "b.jsonl", documents[half:])]
    results = {}
    for workers in (1, 2, 3):
        result = prepare(tmp_path / f"w{workers}", *sources, workers=workers)
        assert result.returncode == 0, result.stderr
        results[workers] = token_files(tmp_path / f"w{workers}")
    assert results[1] == results[2] == results[3]
    meta = json.loads((tmp_path / "w2" / "meta.json").read_text())
    assert meta["documents"] == len(documents) and meta["dtype"] == "uint32"
    train = np.frombuffer(results[1][0], dtype=np.uint32)
    tokenizer = get_tokenizer("cl100k_base")
    assert tokenizer.decode(train[:len(tokenizer.encode_ordinary(documents[0]))].tolist()) == documents[0]


def test_jsonl_gz_and_parquet_give_the_same_bytes(documents, tmp_path):
    sources = {"jsonl": write_jsonl(tmp_path / "c.jsonl", documents),
               "gz": write_jsonl(tmp_path / "c.jsonl.gz", documents, opener=gzip.open),
               "parquet": write_parquet(tmp_path / "c.parquet", documents)}
    results = {}
    for kind, source in sources.items():
        result = prepare(tmp_path / kind, source)
        assert result.returncode == 0, result.stderr
        results[kind] = token_files(tmp_path / kind)
    assert results["jsonl"] == results["gz"] == results["parquet"]


def test_a_malformed_line_names_its_file_and_line_or_is_skipped(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "one"}\n\n{"txt": "two"}\n{"text": "three"}\n')
    result = prepare(tmp_path / "d", path)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: {path}:3: line has no 'text' text; fix it, or pass --skip_bad_lines "
                                     f"to count and skip such lines")
    assert not os.path.exists(tmp_path / "d" / "train.bin")
    result = prepare(tmp_path / "d", path, extra=["--skip_bad_lines"])
    assert result.returncode == 0, result.stderr
    assert "1 malformed documents skipped" in result.stdout
    assert json.loads((tmp_path / "d" / "meta.json").read_text())["documents"] == 2


def test_a_killed_preparation_run_again_gives_the_same_bytes(documents, tmp_path):
    corpus = [f"copy {i}: {doc}" for i in range(8) for doc in documents]  # ~20 MB: seconds to tokenize
    source = write_jsonl(tmp_path / "big.jsonl", corpus)
    killed = prepare(tmp_path / "d", source, start_new_session=True, stdout=subprocess.DEVNULL)
    partial = tmp_path / "d" / "train.bin.tmp"
    deadline = time.time() + 60
    while not (partial.exists() and partial.stat().st_size > 0) and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(killed.pid, signal.SIGKILL)  # the preparer and its workers, part-way
    killed.wait()
    assert partial.stat().st_size > 0 and not data.is_prepared(str(tmp_path / "d"))
    assert prepare(tmp_path / "d", source).returncode == 0
    assert prepare(tmp_path / "whole", source, workers=1).returncode == 0
    assert token_files(tmp_path / "d") == token_files(tmp_path / "whole")


def write_llmc_shard(path, tokens, version=1, magic=None, count=None):
    """A shard as llm.c writes it: GPT-2's (version 1, uint16) or Llama 3's (version 7, uint32)."""
    fmt = data.LLMC_FORMATS[version if version in data.LLMC_FORMATS else 1]
    header = np.zeros(data.LLMC_HEADER_INTS, dtype=np.int32)
    header[:3] = fmt.magic if magic is None else magic, version, len(tokens) if count is None else count
    with open(path, "wb") as f:
        f.write(header.tobytes() + np.asarray(tokens, dtype=fmt.dtype).tobytes())


@pytest.fixture
def prepared_and_shards(tmp_path):
    """A prepared byte-level folder, and the same tokens as llm.c shards (train cut into 3 files)."""
    source = tmp_path / "src.txt"
    source.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    meta = data.prepare_data(str(tmp_path / "prepared"), str(source), "bytes")
    train, val = (np.fromfile(tmp_path / "prepared" / f"{s}.bin", dtype=np.uint16) for s in ("train", "val"))
    (tmp_path / "shards").mkdir()
    write_llmc_shard(tmp_path / "shards" / "web_val_000000.bin", val)
    for i, part in enumerate(np.array_split(train, 3), 1):
        write_llmc_shard(tmp_path / "shards" / f"web_train_{i:06d}.bin", part)
    return (str(tmp_path / "prepared"), meta), str(tmp_path / "shards")


def test_llmc_shards_train_on_the_same_stream_as_one_file(prepared_and_shards):
    (prepared, meta), shards = prepared_and_shards
    shard_meta = data.prepare_data(shards, None, "gpt2")
    assert shard_meta["format"] == "llm.c" and shard_meta["vocab_size"] == 50257 and shard_meta["tokenizer"] == "gpt2"
    loaders = [BatchLoader({"data": (path, m)}, 32, 16, 4, 0, 1, 5, torch.device("cpu"))
               for path, m in ((prepared, meta), (shards, shard_meta))]
    for step in range(1, 30):  # 16 windows a step: many cross the files' boundaries
        one, cut = (torch.cat([x for x, _, _ in loader.micro_batches(step)]) for loader in loaders)
        assert torch.equal(one, cut)
    one, cut = (torch.cat([x for _, x, _, _, _ in loader.val_batches(8)]) for loader in loaders)
    assert torch.equal(one, cut)


@pytest.mark.parametrize("damage, message", [
    (dict(magic=123), "is not an llm.c token shard"),
    (dict(version=7, magic=20240520), "llm.c shard version 7 with magic 20240520 is not supported"),
    (dict(count=10_000), "but its header says 10,000 tokens"),
])
def test_damaged_llmc_shards_are_refused(damage, message, tmp_path):
    write_llmc_shard(tmp_path / "x_val_000000.bin", range(100))
    write_llmc_shard(tmp_path / "x_train_000001.bin", range(100), **damage)
    with pytest.raises(UserError, match=message):
        BatchLoader({"data": (str(tmp_path), data.prepare_data(str(tmp_path), None, "gpt2"))}, 8, 4, 2, 0, 1, 0,
                    torch.device("cpu"))


@pytest.mark.slow
def test_training_on_gpt2_shards_needs_no_bpe_file(prepared_and_shards, tmp_path):
    """Offline, with no gpt2 BPE file: the shards train; only the text sample is skipped, with a note."""
    _, shards = prepared_and_shards
    result = run_trainer(str(tmp_path), data_path=shards, data_source=None, tokenizer="gpt2", max_iters=2,
                         sample_tokens=8, env={"TIKTOKEN_CACHE_DIR": str(tmp_path / "empty_cache")})
    assert "note: no text samples at eval: tokenizer 'gpt2' needs its BPE file" in result.stdout
    assert "vocab_size: 50304" in result.stdout and "step 2/2 | val loss" in result.stdout

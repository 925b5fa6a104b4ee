"""Data preparation (atomic, shared safely) and the loader's global-batch determinism."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from fsdp_gpt.data import prepare as data
from conftest import ROOT
from fsdp_gpt.data.loader import BatchLoader
from fsdp_gpt.config import UserError
from fsdp_gpt.data.tokenizer import get_tokenizer


def write_corpus(folder, n_docs=40):
    os.makedirs(folder, exist_ok=True)
    for i in range(n_docs):
        with open(os.path.join(folder, f"doc{i:02d}.txt"), "w") as f:
            f.write(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 20)
    return folder


def test_prepare_writes_bins_and_meta(tmp_path):
    source = write_corpus(tmp_path / "src")
    meta = data.prepare_data(str(tmp_path / "d"), str(source), "bytes")
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 256
    train = np.memmap(tmp_path / "d" / "train.bin", dtype=np.uint16, mode="r")
    val = np.memmap(tmp_path / "d" / "val.bin", dtype=np.uint16, mode="r")
    assert len(train) == meta["train_tokens"] and len(val) == meta["val_tokens"]
    assert (train == 0).sum() == 38 and (val == 0).sum() == 2  # every 20th document goes to val
    assert bytes(train[:10].astype(np.uint8)) == b"document 0"


def test_jsonl_and_uint32_for_large_vocabularies(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"line {i} of text"}) for i in range(30)))
    meta = data.prepare_data(str(tmp_path / "d"), str(path), "cl100k_base")  # ships offline, 100k tokens
    assert meta["dtype"] == "uint32" and meta["vocab_size"] > 65536
    enc = get_tokenizer("cl100k_base")
    train = np.memmap(tmp_path / "d" / "train.bin", dtype=np.uint32, mode="r")
    assert enc.decode(list(train[:4])) .startswith("line 0 of")


def test_concurrent_preparation_prepares_once(tmp_path):
    source = write_corpus(tmp_path / "src", n_docs=400)
    code = f"import sys; sys.path.insert(0, {ROOT!r}); from fsdp_gpt.data.prepare import prepare_data; prepare_data({str(tmp_path / 'd')!r}, {str(source)!r}, 'bytes')"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum("preparing" in out for out in outputs) == 1


def test_nanogpt_raw_bins_are_used_as_they_are(tmp_path):
    (tmp_path / "d").mkdir()
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "d" / "train.bin")
    np.arange(500, dtype=np.uint16).tofile(tmp_path / "d" / "val.bin")
    meta = data.prepare_data(str(tmp_path / "d"), None, "gpt2")
    assert meta == {"tokenizer": "gpt2", "vocab_size": None, "dtype": "uint16"}
    loader = BatchLoader({"data": (str(tmp_path / "d"), meta)}, 8, 4, 2, 0, 1, 0, torch.device("cpu"))
    x, y, opens = next(loader.micro_batches(1))
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(x[:, 1] - x[:, 0], torch.ones(2, dtype=torch.long))


def test_missing_data_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no prepared data"):
        data.prepare_data(str(tmp_path / "none"), None, "bytes")


def global_batch(data_path, meta, step, dp_size, micro_batch, train_batch=8):
    rows = []
    for rank in range(dp_size):
        loader = BatchLoader({"data": (data_path, meta)}, 16, train_batch, micro_batch, rank, dp_size, 3, torch.device("cpu"))
        rows += [x for x, _, _ in loader.micro_batches(step)]
    return torch.cat(rows)


def test_global_batch_depends_on_seed_and_step_alone(tmp_path):
    meta = data.prepare_data(str(tmp_path / "d"), str(write_corpus(tmp_path / "src")), "bytes")
    reference = global_batch(str(tmp_path / "d"), meta, 5, 1, 8)
    for dp_size, micro in ((1, 2), (2, 1), (2, 4), (4, 2), (8, 1)):
        assert torch.equal(global_batch(str(tmp_path / "d"), meta, 5, dp_size, micro), reference)
    assert not torch.equal(global_batch(str(tmp_path / "d"), meta, 6, 1, 8), reference)


def test_val_windows_cover_the_same_tokens_for_any_world_size(tmp_path):
    meta = data.prepare_data(str(tmp_path / "d"), str(write_corpus(tmp_path / "src")), "bytes")
    for dp_size in (1, 3, 4):
        seen = []
        for rank in range(dp_size):
            loader = BatchLoader({"data": (str(tmp_path / "d"), meta)}, 16, 8, 2, rank, dp_size, 3, torch.device("cpu"))
            batches = list(loader.val_batches(10))
            assert len(batches) == -(-(-(-10 // dp_size)) // 2)  # same count on every rank
            seen += [x[i] for _, x, _, _, w in batches for i in range(len(w)) if w[i] == 1]
        val = np.memmap(tmp_path / "d" / "val.bin", dtype=np.uint16, mode="r")
        expected = [tuple(val[i * 16:i * 16 + 16].tolist()) for i in range(10)]
        assert sorted(tuple(x.tolist()) for x in seen) == sorted(expected)


def test_one_ahead_loading_yields_the_same_batches_and_reads_each_once(tmp_path):
    """The GPU loader's order (copy of micro-batch i+1 started before i is handed over, across
    steps too), run on CPU: same batches as the plain loader, no micro-batch read twice except
    after a jump in steps, where the one in flight is of no use."""
    meta = data.prepare_data(str(tmp_path / "d"), str(write_corpus(tmp_path / "src")), "bytes")
    plain, ahead = (BatchLoader({"data": (str(tmp_path / "d"), meta)}, 16, 8, 2, 1, 2, 3, torch.device("cpu")) for _ in range(2))
    ahead.one_ahead = True
    reads = []
    host_rows = ahead._host_rows
    ahead._host_rows = lambda split, starts: reads.append(tuple(starts)) or host_rows(split, starts)
    for step in (1, 2, 3, 7, 8):
        for (x0, y0, _), (x1, y1, _) in zip(plain.micro_batches(step), ahead.micro_batches(step), strict=True):
            assert torch.equal(x0, x1) and torch.equal(y0, y1)
    # 5 steps of 2 micro-batches, one read ahead at the end, one wasted by the jump from 3 to 7
    assert len(reads) == 5 * 2 + 1 + 1
    assert ahead._ahead[0] == (9, 0)


def test_document_starts_and_the_tokens_cropping_drops():
    from fsdp_gpt.data.loader import TokenStream, document_starts, never_read
    # two files read as one stream: separators (0) at offsets 2, 9 and 12; a row of block_size 2 needs 3 tokens
    stream = TokenStream([np.array([1, 1, 0, 1, 1, 1, 1, 1, 1]), np.array([0, 1, 1, 0, 1])])
    starts = document_starts(stream, 0, 2)
    assert starts.tolist() == [2, 9]  # 12: no whole row after it
    assert never_read(starts, len(stream), 2) == 2 + (9 - 2 - 3) + (14 - 9 - 3)
    with pytest.raises(UserError, match="align_rows: no document separator \\(token 7\\)"):
        document_starts(stream, 7, 2)


@pytest.mark.parametrize("mixture", [False, True])
def test_aligned_rows_start_at_documents_and_depend_on_seed_and_step_alone(mixture, tmp_path):
    from fsdp_gpt.data.mixture import Segment
    meta = data.prepare_data(str(tmp_path / "d"), str(write_corpus(tmp_path / "src")), "bytes")
    sources = {"a": (str(tmp_path / "d"), meta)} | ({"b": (str(tmp_path / "d"), meta)} if mixture else {})
    segment = Segment(0, 8, {"a": 0.5, "b": 0.5}, {}) if mixture else None

    def global_aligned(step, dp_size, micro):
        loaders = [BatchLoader(sources, 16, 8, micro, rank, dp_size, 3, torch.device("cpu"), segment, align_rows=True)
                   for rank in range(dp_size)]
        return torch.cat([x for loader in loaders for x, _, _ in loader.micro_batches(step)])

    reference = global_aligned(5, 1, 8)
    assert (reference[:, 0] == 0).all()  # each row starts at a separator (bytes: 0), then a document
    assert all(bytes(row[1:10].tolist()) == b"document " for row in reference)
    for dp_size, micro in ((2, 1), (4, 2)):
        assert torch.equal(global_aligned(5, dp_size, micro), reference)
    assert not torch.equal(global_aligned(6, 1, 8), reference)

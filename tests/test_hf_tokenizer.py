"""Hugging Face tokenizers (tokenizer.json, read with the `tokenizers` library): prepared tokens are
the tokenizer's own encoding of each document, the end-of-text token chosen eos then bos, uint32
where the vocabulary needs it, the tokenizer's hash recorded, bad tokenizers refused in one line."""
import json
import os
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from fsdp_gpt.data import prepare as data
from fsdp_gpt.config import UserError
from conftest import ROOT
from fsdp_gpt.data.tokenizer import HFTokenizer, get_tokenizer

STDLIB = sysconfig.get_paths()["stdlib"]


def make_tokenizer(folder, vocab_size=500, config=None) -> str:
    """A byte-level BPE trained offline on a few standard-library files, saved as a model folder
    would hold it: tokenizer.json and tokenizer_config.json (eos <|endoftext|> unless `config`; the
    generic class, or transformers would rebuild it as the model's own tokenizer class)."""
    import tokenizers
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|bos|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train([os.path.join(STDLIB, "json", name) for name in ("decoder.py", "encoder.py")], trainer)
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:  # the class: transformers loads it as it is
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast"} | (
            {"eos_token": "<|endoftext|>"} if config is None else config), f)
    return str(folder)


def make_sentencepiece_tokenizer(folder, vocab_size=576) -> str:
    """Gemma's kind of tokenizer.json (SentencePiece's BPE as `tokenizers` holds it): spaces made "▁"
    by the normalizer, no pre-tokenizer, bytes outside the vocabulary as <0xNN> tokens, special tokens
    <pad> <eos> <bos> <unk> first; tokenizer_config.json names eos and bos as Gemma's does."""
    import tokenizers
    from tokenizers import decoders, normalizers
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials)
    tok.train([os.path.join(STDLIB, "json", name) for name in ("decoder.py", "encoder.py")], trainer)
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "bos_token": "<bos>",
                   "pad_token": "<pad>", "unk_token": "<unk>", "add_bos_token": True}, f)
    return str(folder)


def write_docs(path, n=30) -> list[str]:
    lines = open(os.path.join(STDLIB, "json", "scanner.py")).read().splitlines()
    docs = ["\n".join(lines[i:i + 3 + i % 5]) + " é ✓" for i in range(n)]
    with open(path, "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    return docs


def test_prepared_tokens_are_the_tokenizers_own_encoding(tmp_path):
    folder = make_tokenizer(tmp_path / "tok")
    docs = write_docs(tmp_path / "docs.jsonl")
    meta = data.prepare_data(str(tmp_path / "prepared"), [str(tmp_path / "docs.jsonl")], folder, workers=2)
    tok = HFTokenizer(folder)
    assert meta["tokenizer"] == os.path.abspath(folder) and meta["tokenizer_sha256"] == tok.sha256
    assert meta["eot_token"] == tok.tokenizer.token_to_id("<|endoftext|>") and meta["dtype"] == "uint16"
    assert meta["vocab_size"] == 500
    import tokenizers
    own = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    expected = {"train": [], "val": []}
    for i, doc in enumerate(docs):  # data.VAL_EVERY-th documents go to val
        split = "val" if i % data.VAL_EVERY == data.VAL_EVERY - 1 else "train"
        expected[split] += own.encode(doc, add_special_tokens=False).ids + [meta["eot_token"]]
    for split, tokens in expected.items():
        got = np.fromfile(tmp_path / "prepared" / f"{split}.bin", dtype=np.uint16).tolist()
        assert got == tokens, split
    assert tok.decode(own.encode(docs[3], add_special_tokens=False).ids) == docs[3]


def test_a_sentencepiece_tokenizer_prepares_data_as_transformers_encodes(tmp_path):
    """Gemma's kind: "▁" for spaces, bytes outside the vocabulary by fallback (é, ✓), <eos> between
    documents; the prepared tokens are transformers' encoding of each document, and decode back."""
    from transformers import PreTrainedTokenizerFast
    folder = make_sentencepiece_tokenizer(tmp_path / "tok")
    docs = write_docs(tmp_path / "docs.jsonl")
    meta = data.prepare_data(str(tmp_path / "prepared"), [str(tmp_path / "docs.jsonl")], folder)
    tok, theirs = HFTokenizer(folder), PreTrainedTokenizerFast.from_pretrained(folder)
    assert meta["eot_token"] == tok.eot_token == theirs.eos_token_id == 1
    train = np.fromfile(tmp_path / "prepared" / "train.bin", dtype=np.uint16).tolist()
    expected = []
    for i, doc in enumerate(docs):
        if i % data.VAL_EVERY != data.VAL_EVERY - 1:
            expected += theirs.encode(doc, add_special_tokens=False) + [1]
    assert train == expected and any(t >= 4 and t < 260 for t in train)  # byte fallback took part
    assert tok.decode(theirs.encode(docs[0], add_special_tokens=False)) == docs[0]


def test_end_of_text_is_eos_then_bos_and_large_vocabularies_take_uint32(tmp_path):
    only_bos = make_tokenizer(tmp_path / "bos", config={"bos_token": {"content": "<|bos|>"}})
    assert HFTokenizer(only_bos).eot_token == HFTokenizer(only_bos).tokenizer.token_to_id("<|bos|>")
    import tokenizers
    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "</s>": 70_001}
    big = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    big.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    (tmp_path / "big").mkdir()
    big.save(str(tmp_path / "big" / "tokenizer.json"))
    (tmp_path / "big" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"w1 w69999 w{i}"}) + "\n" for i in range(20)))
    meta = data.prepare_data(str(tmp_path / "prepared"), [str(tmp_path / "docs.jsonl")],
                             str(tmp_path / "big" / "tokenizer.json"))
    assert meta["dtype"] == "uint32" and meta["eot_token"] == 70_001
    assert np.fromfile(tmp_path / "prepared" / "train.bin", dtype=np.uint32)[:4].tolist() == [1, 69999, 0, 70_001]


@pytest.mark.parametrize("make, message", [
    (lambda d: d.mkdir(), "no tokenizer.json there"),
    (lambda d: (d.mkdir(), (d / "tokenizer.json").write_text("{not json")), "does not parse"),
    (lambda d: make_tokenizer(d, config={}), "has no end-of-text token to separate documents"),
    (lambda d: (make_tokenizer(d), (d / "tokenizer_config.json").write_text('{"eos_token": ')),
     "is not JSON"),
])
def test_bad_tokenizers_are_refused_in_one_line_and_nothing_is_written(make, message, tmp_path):
    make(tmp_path / "tok")
    write_docs(tmp_path / "docs.jsonl")
    with pytest.raises(UserError, match=message):
        get_tokenizer(str(tmp_path / "tok"))
    result = subprocess.run([sys.executable, os.path.join(ROOT, "data.py"), "prepare", str(tmp_path / "out"),
                             str(tmp_path / "docs.jsonl"), f"--tokenizer={tmp_path / 'tok'}"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.slow
def test_a_run_trains_on_its_tokenizers_data_and_refuses_another(tmp_path):
    from conftest import run_trainer
    folder = make_tokenizer(tmp_path / "tok")
    other = make_tokenizer(tmp_path / "other", vocab_size=400)
    write_docs(tmp_path / "docs.jsonl", n=200)
    settings = dict(data_path=str(tmp_path / "prepared"), data_source=str(tmp_path / "docs.jsonl"), max_iters=2,
                    sample_tokens=4)
    result = run_trainer(str(tmp_path), tokenizer=folder, **settings)
    assert "note: the data was prepared" not in result.stdout and "step 2/2 | val loss" in result.stdout
    refused = run_trainer(str(tmp_path), tokenizer=other, check=False, **settings)
    assert refused.returncode == 2
    assert (f"error: the data in {tmp_path / 'prepared'} was prepared with tokenizer {os.path.abspath(folder)} (sha256 "
            in refused.stderr) and f"not with this run's {other} (sha256 " in refused.stderr

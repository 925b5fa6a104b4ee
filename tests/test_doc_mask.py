"""doc_mask: attention stops at the separator between documents inside a row; each document is
computed as it would be alone, the same with rows split over ranks; evaluations of single
sequences (multiple choice) are unaffected."""
import json
import os
import sys

import pytest
import torch

from conftest import ROOT, RUN, run_trainer, scalars, shared
from fsdp_gpt.data.prepare import prepare_data
from fsdp_gpt.attention import Documents, document_attention
from fsdp_gpt.model import GPT, GPTConfig

sys.path.insert(0, os.path.join(ROOT, "bench"))
from short_docs import main as write_short_docs  # noqa: E402


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_each_document_is_computed_as_it_would_be_alone(arch):
    torch.manual_seed(0)
    model = GPT(GPTConfig(arch=arch, vocab_size=64, n_layer=2, n_head=4, n_kv_head=2 if arch == "llama" else None,
                          n_embd=32, block_size=48)).eval()
    row = torch.randint(1, 64, (2, 48))
    row[:, [10, 11, 30]] = 0  # separators: documents [0, 10), [10, 11), [11, 30), [30, 48), each opened by one
    masked, plain = model(row, opens=row == 0)[0], model(row)[0]
    bounds = [0, 10, 11, 30, 48]
    for first, end in zip(bounds, bounds[1:]):  # alone, at the same positions of a row
        alone = model(row[:, first:end], positions=torch.arange(first, end))[0]
        torch.testing.assert_close(masked[:, first:end], alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain[:, 30:], masked[:, 30:], atol=1e-3)  # unmasked, later documents see earlier ones


def test_documents_of_like_length_share_one_kernel_call(monkeypatch):
    """The cost in calls follows the groups of like length, not the documents: 4 rows of 1,024
    tokens, three cut into documents of 226 to 256 tokens (rounded up to a quarter of 128: 256, one
    group) and a few others, one whole row; each document still computed alone."""
    lengths = [[256, 230, 250, 240, 48], [231, 256, 256, 281], [1024], [226, 226, 226, 226, 120]]
    opens = torch.zeros(4, 1024, dtype=torch.bool)
    for row, docs in enumerate(lengths):
        opens[row, torch.tensor(docs).cumsum(0)[:-1]] = True
    docs = Documents.of_rows(opens)
    assert [g.shape[1] for g in docs.buckets(torch.device("cpu")).gathers] == [48, 128, 256, 320, 1024]
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda q, *a, **kw: (
        calls.append(q.shape[0]), sdpa(q, *a, **kw))[1])
    q, k, v = (torch.randn(4, 2, 1024, 8) for _ in range(3))
    out = document_attention(q, k, v, 0.0, False, docs)
    assert calls == [1, 1, 11, 1, 1]  # documents per call: 48; 120; the 226-256s; 281; the whole row
    for row, row_lengths in enumerate(lengths):
        start = 0
        for length in row_lengths:
            alone = sdpa(*(t[row:row + 1, :, start:start + length] for t in (q, k, v)), is_causal=True)
            torch.testing.assert_close(out[row:row + 1, :, start:start + length], alone, rtol=1e-5, atol=1e-5)
            start += length


@pytest.fixture(scope="session")
def short_corpus(tmp_path_factory) -> dict:
    """Python's json and email packages cut at their top-level definitions: 287 documents of ~800
    bytes, several to a row of 128 tokens."""
    def make(folder):
        jsonl = os.path.join(folder, "docs.jsonl")
        sys.argv = ["short_docs.py", jsonl, "--dirs", "json", "email"]
        write_short_docs()
        prepare_data(os.path.join(folder, "prepared"), [jsonl], "bytes")
    return dict(data_path=os.path.join(shared(tmp_path_factory, "short_docs", make), "prepared"), data_source=None)


def mc_items(path) -> str:
    """A few multiple-choice items ({context, choices, label} jsonl): single sequences."""
    items = [{"context": f"def f{i}(x):\n    return", "choices": [" x + 1\n", " None\n", " x\n"], "label": i % 3}
             for i in range(6)]
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return str(path)


@pytest.mark.slow
def test_doc_mask_is_the_same_over_context_ranks_and_leaves_multiple_choice_alone(short_corpus, tmp_path):
    settings = dict(RUN, arch="llama", n_head=4, n_kv_head=2, block_size=128, train_batch=8, micro_batch=4,
                    eval_interval=3, mc_eval_path=mc_items(tmp_path / "mc.jsonl"), **short_corpus)
    runs = {"masked": (1, dict(doc_mask=True)), "masked_cp2": (2, dict(doc_mask=True, cp_size=2)), "plain": (1, {})}
    for name, (nproc, extra) in runs.items():
        os.makedirs(tmp_path / name)
        run_trainer(str(tmp_path / name), nproc=nproc, **settings | extra)
    tb = {name: str(tmp_path / name / "tb") for name in runs}
    for tag in ("train/loss", "train/grad_norm", "val/loss"):  # the same run with rows split over 2 ranks
        one, split = scalars(tb["masked"], tag), scalars(tb["masked_cp2"], tag)
        assert sorted(one) == sorted(split) and all(split[s] == pytest.approx(one[s], rel=1e-4) for s in one), tag
    # with the same (initial) weights, the mask changes the val loss: its windows hold several documents...
    assert scalars(tb["masked"], "val/loss")[0] != scalars(tb["plain"], "val/loss")[0]
    # ...but not multiple choice, whose items are one sequence each
    for metric in ("acc", "acc_norm"):
        assert scalars(tb["masked"], f"eval/mc/{metric}")[0] == scalars(tb["plain"], f"eval/mc/{metric}")[0]


def test_doc_mask_needs_data_that_names_its_separator(tmp_path, corpus):
    raw = tmp_path / "raw"  # nanoGPT's raw .bin files: no meta.json naming a separator
    os.makedirs(raw)
    for split in ("train", "val"):
        (raw / f"{split}.bin").write_bytes(torch.randint(0, 256, (4096,), dtype=torch.int16).numpy().tobytes())
    result = run_trainer(str(tmp_path), check=False, doc_mask=True, data_path=str(raw), data_source=None, max_iters=1)
    assert result.returncode == 2 and "error: doc_mask needs the token that separates documents" in result.stderr


def test_the_varlen_call_keeps_the_layouts_through_forward_and_backward():
    """doc_mask's CUDA path (one varlen flash call: its kernels run on CUDA only, tests/test_gpu.py)
    on the meta device: the rows laid end to end and back, grouped key/value heads as they are, the
    log-sum-exp the ring merges as (B, heads, T)."""
    from fsdp_gpt.attention import VarlenAttention, varlen_forward
    q = torch.randn(2, 4, 16, 8, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 8, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    bounds = torch.tensor([0, 5, 16, 20, 32], dtype=torch.int32, device="meta")  # documents of 5, 11, 4, 12
    out = VarlenAttention.apply(q, k, v, bounds, 0.0)
    out.backward(torch.randn_like(out))
    assert out.shape == q.shape and q.grad.shape == q.shape and k.grad.shape == v.grad.shape == k.shape
    assert varlen_forward(q, k, v, bounds, 0.0)[1].shape == (2, 4, 16)

"""Sliding-window attention: each attention path against a dense mask (key j of query i where
i - W < j <= i), its gradients too; a window at least the row equals full attention exactly; the
band's cost is linear in the row."""
import os

import pytest
import torch
import torch.nn.functional as F

from fsdp_gpt.attention import Documents, band_mask, causal_attention
from test_doc_mask import short_corpus  # noqa: F401 - the fixture: rows holding several documents

B, H, KV, D = 2, 4, 2, 8


def window_mask(T: int, window: int | None, ids: torch.Tensor | None = None) -> torch.Tensor:
    """(B, 1, T, T): the dense truth, within each document where ids (B, T) says where they lie."""
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    mask = (j <= i) & (i - j < (window or T))
    mask = mask.expand(B, T, T)
    if ids is not None:
        mask = mask & (ids[:, :, None] == ids[:, None, :])
    return mask.unsqueeze(1)


def qkv(T: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, T, D, generator=g, dtype=torch.float64).requires_grad_() for n in (H, KV, KV)]


def with_grads(fn, tensors, dout):
    out = fn(*tensors)
    grads = torch.autograd.grad(out, tensors, dout)
    return [out.detach(), *grads]


def dense(q, k, v, mask, scale=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)


@pytest.mark.parametrize("T, window", [(37, 5), (32, 8), (33, 1), (40, 39)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_the_band_is_the_dense_window(T, window, scale):
    """banded_attention (CPU, fp32 on a GPU): rows that are and aren't whole blocks, a window of 1 (each
    query itself), grouped-query heads, another scale; output and gradients in fp64."""
    tensors = qkv(T)
    dout = torch.randn(B, H, T, D, dtype=torch.float64)
    ours = with_grads(lambda q, k, v: causal_attention(q, k, v, 0.0, True, window=window, scale=scale), tensors, dout)
    truth = with_grads(lambda q, k, v: dense(q, k, v, window_mask(T, window), scale), tensors, dout)
    for a, b in zip(ours, truth):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_a_window_reaching_the_whole_row_is_full_attention_exactly():
    q, k, v = qkv(24)
    full = causal_attention(q, k, v, 0.0, True)
    for window in (24, 25, 1000):
        assert torch.equal(causal_attention(q, k, v, 0.0, True, window=window), full)


@pytest.mark.parametrize("window", [3, 6, 64])
def test_documents_keep_their_window_inside(window):
    """doc_mask's grouped path: each document attends within itself and within the window."""
    T = 48
    opens = torch.zeros(B, T, dtype=torch.bool)
    opens[0, [10, 11, 30]] = True
    opens[1, [5, 40]] = True
    docs = Documents.of_rows(opens.numpy())
    tensors = qkv(T, seed=1)
    dout = torch.randn(B, H, T, D, dtype=torch.float64)
    ours = with_grads(lambda q, k, v: causal_attention(q, k, v, 0.0, True, docs, window), tensors, dout)
    ids = torch.from_numpy(docs.ids)
    truth = with_grads(lambda q, k, v: dense(q, k, v, window_mask(T, window, ids)), tensors, dout)
    for a, b in zip(ours, truth):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_the_rings_window_tiles_compute_in_fp32_under_autocast():
    """The windowed ring's kernel (one rank) is fp32 matmuls whatever autocast says: under CPU
    autocast to bf16 its output and gradients are fp32 attention's, several tiles a row (tiles of 5
    queries); before, autocast ran them in bf16 (0.15 off) and the backward in fp32 against the
    forward's bf16 log-sum-exp."""
    import numpy as np

    from fsdp_gpt.distributed.ring_attention import RingAttention
    from fsdp_gpt.distributed.window_ring import WindowPlan
    T, window = 37, 8
    tensors = [t.detach().float().requires_grad_() for t in qkv(T, seed=2)]
    dout = torch.randn(B, H, T, D)
    ring = RingAttention(None, 0, [torch.arange(T)])
    ring._windows[window] = WindowPlan(0, [np.arange(T)], window, tile=5)  # 8 tiles a row
    with torch.autocast("cpu", torch.bfloat16):
        ours = with_grads(lambda q, k, v: ring.window_tiles(q, k, v, None, window, None), tensors, dout)
    truth = with_grads(lambda q, k, v: dense(q, k, v, window_mask(T, window)), tensors, dout)
    for a, b in zip(ours, truth):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_ring_of_one_rank_runs_the_models_own_window():
    """cp_mode: ring at cp_size 1 holds whole rows: a window shorter than them is the model's own
    (the flash kernel's window on CUDA, the bands here), bitwise, and no tile is planned."""
    from fsdp_gpt.distributed.ring_attention import RingAttention
    T, window = 37, 8
    q, k, v = qkv(T, seed=3)
    ring = RingAttention(None, 0, [torch.arange(T)])
    assert torch.equal(ring(q, k, v, 0.0, True, None, window), causal_attention(q, k, v, 0.0, True, None, window))
    assert not ring._windows


def test_the_band_grows_with_the_row_not_its_square():
    """The band's scores: 2 x window for each query (the mask's size), whatever the row; of them it
    keeps exactly the pairs the window holds."""
    mask = band_mask(64, 16, torch.device("cpu"))
    assert mask.shape == (64, 1, 16, 32)
    assert int(mask.sum()) == sum(min(i + 1, 16) for i in range(64 * 16))


# ---- trained runs: a window of 6 on rows of 32 (a ring chunk at cp_size 2 is 8 tokens, Ulysses' slice 16) ----

WINDOWED = dict(arch="llama", n_head=4, n_kv_head=2, sliding_window=6, window_pattern=["local", "global"],
                rope_local_theta=500.0)
LAYOUTS = {"one": (1, {}), "dp2": (2, {}), "ulysses": (2, dict(cp_size=2)), "ring": (2, dict(cp_size=2, cp_mode="ring"))}


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, corpus):
    from conftest import launcher_once
    return launcher_once(tmp_path_factory, "window", **WINDOWED, **corpus)


def losses(run_dir) -> dict[int, float]:
    from conftest import scalars
    return scalars(f"{run_dir}/tb", "train/loss")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "ulysses", "ring"])
def test_windowed_runs_over_ranks_train_as_one_process(layout, windowed):
    """2 data-parallel ranks, and each row over 2 ranks (Ulysses; the ring, which exchanges only the
    columns the window reaches), every step's loss within 1e-5 of one process's."""
    nproc, settings = LAYOUTS[layout]
    reference, got = losses(windowed("one", 1)), losses(windowed(layout, nproc, **settings))
    assert sorted(got) == sorted(reference) == list(range(1, 9))
    assert all(abs(got[step] - reference[step]) < 1e-5 for step in reference), (got, reference)


@pytest.mark.slow
def test_documents_keep_their_window_on_the_ring(tmp_path_factory, short_corpus):
    """doc_mask with the window: the ring at cp_size 2 (each tile's mask the window's pairs of one
    document) against one process, rows of 64 holding several short documents."""
    from conftest import launcher_once
    run = launcher_once(tmp_path_factory, "window_docs", **WINDOWED, **short_corpus, doc_mask=True, block_size=64)
    reference, ring = losses(run("one", 1)), losses(run("ring", 2, cp_size=2, cp_mode="ring"))
    assert sorted(ring) == sorted(reference) == list(range(1, 9))
    assert all(abs(ring[step] - reference[step]) < 1e-5 for step in reference), (ring, reference)


@pytest.mark.slow
def test_a_window_that_covers_the_row_trains_as_full_attention_exactly(windowed, corpus, tmp_path):
    """sliding_window 32 on rows of 32 (one RoPE base): every loss bitwise what the same run without a window logs."""
    from conftest import run_trainer
    runs = {}
    for name, window in (("full", {}), ("covering", dict(sliding_window=32))):
        (tmp_path / name).mkdir()
        run_trainer(str(tmp_path / name), **(WINDOWED | dict(sliding_window=None, window_pattern=None, rope_local_theta=None)
                                           | window), **corpus)
        runs[name] = losses(tmp_path / name)
    assert runs["covering"] == runs["full"] and len(runs["full"]) == 8
    assert runs["full"] != losses(windowed("one", 1))  # the window of 6 trains otherwise


@pytest.mark.slow
def test_a_resume_that_moves_layers_between_rope_bases_names_them(windowed, corpus, tmp_path):
    """window_pattern [local, global] -> [global, local] (a change a resume may make): the note says
    which layers now rotate with the other base, which the pattern's change alone leaves unsaid."""
    from conftest import run_trainer
    checkpoint = os.path.join(windowed("one", 1), "ckpt", "fsdp_cpt8.pth")
    result = run_trainer(str(tmp_path), **(WINDOWED | dict(window_pattern=["global", "local"], max_iters=9,
                                                           resume_from=checkpoint)), **corpus)
    assert ("note: the context changes on resume: window_pattern ['local', 'global'] -> ['global', 'local'], RoPE base "
            "of layers [0] from rope_local_theta 500 to rope_theta 10000, RoPE base of layers [1] from rope_theta 10000 "
            "to rope_local_theta 500; the weights are the checkpoint's") in result.stdout, result.stdout[-2000:]

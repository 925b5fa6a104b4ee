"""The attention kernels of doc_mask and the ring on one device, against attention with a dense mask
computed in fp32 (test_ring_attention.py on the CPU; test_gpu.py runs it on CUDA, in bf16):

    python tests/attention_check.py cuda bfloat16      # prints the largest differences as JSON

- "merged blocks": the second half of a row's queries against the first half's keys (in full) and
  against their own half (causal), each block apart through the ring's kernels, merged by
  log-sum-exp; then each block's backward run with the merged output and log-sum-exp. Together:
  causal attention over the row and its gradients (dq summed over the blocks).
- "per-document calls": attention.grouped_document_attention, a causal SDPA call per group of documents.
- "varlen call" (CUDA only): attention.VarlenAttention, the flash kernel's one call over every document;
  "varlen log-sum-exp": its log-sum-exp (what the ring merges by) against the dense one.
- "ring kernels, documents": the ring of one rank (its kernels and per-document rectangles).
- "window", "window, documents": a sliding window of 48 (CUDA: the flash kernel's window, by varlen;
  elsewhere banded_attention and the per-document groups); "window, ring" (and with documents): the
  ring's windowed tiles (distributed/window_ring.py) at one rank (where the ring itself, at cp_size 1,
  runs the window as above).
- "sinks: ...": gpt-oss's attention sinks (a logit per head in every row's denominator) on each path
  above: whole rows, a window, documents, both (CUDA: flash's forward and its varlen call, elsewhere the
  CPU's flash kernel), the ring's kernels with documents and its windowed tiles; against the dense
  reference with the sink's column in its softmax, the sinks' gradients among the figures.
Grouped-query heads (4 over 2) throughout.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_gpt.attention_kernels import KERNELS  # noqa: E402
from fsdp_gpt.distributed.ring_attention import RingAttention  # noqa: E402
from fsdp_gpt.distributed.window_ring import fold_heads, merge, repeat_heads  # noqa: E402
from fsdp_gpt.attention import (Documents, VarlenAttention, causal_attention, grouped_document_attention,  # noqa: E402
                                 varlen_forward, varlen_runs)

B, H, KV, T, D = 2, 4, 2, 256, 64
WINDOW = 48  # a sliding window: on CUDA the flash kernel's own, elsewhere bands; the ring's tiles


def inputs(device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, n, T, D, generator=g).to(device, dtype) for n in (H, KV, KV, H)]  # q, k, v, dout


def reference(q, k, v, dout, mask: torch.Tensor) -> list[torch.Tensor]:
    """Output and gradients of q, k, v in fp32 with a dense (B, T, T) mask."""
    q, k, v = (t.detach().float().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), enable_gqa=True)
    out.backward(dout.float())
    return [out.detach(), q.grad, k.grad, v.grad]


def sink_reference(q, k, v, sinks, dout, mask: torch.Tensor) -> list[torch.Tensor]:
    """Output and gradients of q, k, v and the sinks in fp32, each head's sink a column of every row's
    softmax beside its keys (transformers' eager gpt-oss attention), with a dense (B, T, T) mask."""
    q, k, v, sinks = (t.detach().float().clone().requires_grad_() for t in (q, k, v, sinks))
    scores = (q @ k.repeat_interleave(H // KV, dim=1).transpose(-1, -2)) / D ** 0.5
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    with_sink = torch.cat([scores, sinks.view(1, H, 1, 1).expand(B, H, T, 1)], dim=-1).softmax(-1)[..., :-1]
    out = with_sink @ v.repeat_interleave(H // KV, dim=1)
    out.backward(dout.float())
    return [out.detach(), q.grad, k.grad, v.grad, sinks.grad]


def merged_blocks(q, k, v, dout) -> list[torch.Tensor]:
    """The second half's queries: output and gradients (zero for the first half's queries)."""
    run, run_backward = KERNELS[q.device.type]
    half, groups = T // 2, H // KV
    mine = q[:, :, half:]
    blocks = [(slice(0, half), False), (slice(half, T), True)]  # the earlier half in full, its own causal
    out = torch.zeros(mine.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(mine.shape[:-1], dtype=torch.float32, device=q.device)
    auxes = []
    for i, (keys, causal) in enumerate(blocks):
        block_out, block_lse, aux = run(mine, repeat_heads(k[:, :, keys], groups), repeat_heads(v[:, :, keys], groups), causal,
                                        None)
        auxes.append(aux)
        if i == 0:
            out.copy_(block_out)
            lse.copy_(block_lse)
        else:
            merge(out, lse, block_out, block_lse)
    out = out.to(q.dtype)
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in (q, k, v))
    for (keys, causal), aux in zip(blocks, auxes):
        grads = run_backward(dout[:, :, half:], mine, repeat_heads(k[:, :, keys], groups), repeat_heads(v[:, :, keys], groups),
                             out, lse, aux, causal, None)
        dq[:, :, half:] += grads[0]
        dk[:, :, keys] += fold_heads(grads[1], groups)
        dv[:, :, keys] += fold_heads(grads[2], groups)
    return [torch.cat([torch.zeros_like(out), out], dim=2).float(), dq, dk, dv]


def with_autograd(attention, q, k, v, dout, sinks=None) -> list[torch.Tensor]:
    """Output and gradients of q, k, v (and of the sinks, where given: attention takes them last)."""
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v) + ((sinks,) if sinks is not None else ())]
    out = attention(*inputs)
    out.backward(dout)
    return [out.detach().float()] + [t.grad.float() for t in inputs]


def masks(device: str) -> tuple:
    """The rows' documents, and the dense (B, T, T) masks: causal, within documents, within the window."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(B, T, T)
    opens = torch.zeros(B, T, dtype=torch.bool)
    opens[0, [7, 8, 100, 129, 200]] = True
    opens[1, [0, 128]] = True
    docs = Documents.of_rows(opens)
    ids = torch.from_numpy(docs.ids).to(device)
    band = torch.ones(T, T, dtype=torch.bool, device=device).triu(1 - WINDOW).expand(B, T, T)  # i - j < WINDOW
    return docs, causal, causal & (ids.unsqueeze(-1) == ids.unsqueeze(-2)), band


def plain_cases(device: str, dtype: torch.dtype) -> dict:
    q, k, v, dout = inputs(device, dtype)
    docs, causal, documents, band = masks(device)
    second = torch.zeros_like(dout)
    second[:, :, T // 2:] = dout[:, :, T // 2:]  # the loss reads the second half's outputs alone
    expected = reference(q, k, v, second, causal)
    expected[0][:, :, :T // 2] = 0
    got = {"merged blocks": (merged_blocks(q, k, v, second), expected)}
    expected = reference(q, k, v, dout, documents)
    got["per-document calls"] = (with_autograd(lambda *t: grouped_document_attention(*t, 0.0, True, docs), q, k, v, dout),
                                 expected)
    if varlen_runs(q):
        got["varlen call"] = (with_autograd(lambda *t: VarlenAttention.apply(*t, docs.sequences(q.device), 0.0), q, k, v,
                                            dout), expected)
        scores = (q.float() @ k.float().repeat_interleave(H // KV, dim=1).transpose(-1, -2)) / D ** 0.5
        dense_lse = scores.masked_fill(~documents.unsqueeze(1), float("-inf")).logsumexp(-1)
        got["varlen log-sum-exp"] = ([varlen_forward(q, k, v, docs.sequences(q.device), 0.0)[1]], [dense_lse])
    ring = RingAttention(None, 0, [torch.arange(T)])
    got["ring kernels, documents"] = (with_autograd(lambda *t: ring(*t, 0.0, True, docs), q, k, v, dout), expected)
    for case, rows in (("", None), (", documents", docs)):
        expected = reference(q, k, v, dout, (documents if rows else causal) & band)
        got["window" + case] = (with_autograd(lambda *t: causal_attention(*t, 0.0, True, rows, WINDOW), q, k, v, dout),
                                expected)
        got["window, ring" + case] = (with_autograd(lambda *t: ring.window_tiles(*t, rows, WINDOW, None), q, k, v, dout),
                                      expected)
    return got


def sink_cases(device: str, dtype: torch.dtype) -> dict:
    q, k, v, dout = inputs(device, dtype)
    docs, causal, documents, band = masks(device)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(1)).to(device)  # fp32, as the model's parameter
    got = {}
    for case, rows, window, mask in (("rows", None, None, causal), ("window", None, WINDOW, causal & band),
                                     ("documents", docs, None, documents),
                                     ("window, documents", docs, WINDOW, documents & band)):
        got[f"sinks: {case}"] = (with_autograd(lambda *t: causal_attention(*t[:3], 0.0, True, rows, window, sinks=t[3]),
                                               q, k, v, dout, sinks), sink_reference(q, k, v, sinks, dout, mask))
    ring, expected = RingAttention(None, 0, [torch.arange(T)]), sink_reference(q, k, v, sinks, dout, documents)
    got["sinks: ring kernels, documents"] = (with_autograd(lambda *t: ring(*t[:3], 0.0, True, docs, sinks=t[3]), q, k, v,
                                                           dout, sinks), expected)
    got["sinks: window, ring, documents"] = (with_autograd(lambda *t: ring.window_tiles(*t[:3], docs, WINDOW, None, t[3]),
                                                           q, k, v, dout, sinks),
                                             sink_reference(q, k, v, sinks, dout, documents & band))
    if varlen_runs(q):
        got["sinks: varlen call"] = (with_autograd(lambda *t: VarlenAttention.apply(*t[:3], docs.sequences(q.device), 0.0,
                                                                                    None, None, t[3]), q, k, v, dout,
                                                   sinks), expected)
    return got


def largest_differences(device: str, dtype: torch.dtype, cases=(plain_cases, sink_cases)) -> dict[str, float]:
    got = {name: pair for case in cases for name, pair in case(device, dtype).items()}
    # relative to each tensor's largest entry: bf16 rounds at ~4e-3 of a value
    return {case: max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, theirs))
            for case, (ours, theirs) in got.items()}


if __name__ == "__main__":
    print(json.dumps(largest_differences(sys.argv[1], getattr(torch, sys.argv[2]))))

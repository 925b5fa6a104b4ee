"""Attention's core for the model (no distributed code): causal over whole rows, or over the
documents inside them (doc_mask), in full or within a sliding window, with each head's sink in every
row's softmax where the model has sinks (gpt-oss: attention_kernels.py); and which grouped-query
attention SDPA runs without a T x T matrix. Context parallelism swaps the core from outside
(distributed/context_parallel.py).

A window of W: a query attends to the W keys up to itself, itself included (key j of query i where
i - W < j <= i, as transformers' Gemma 3 and Mistral count it); None, or W at least the row, is
full causal attention, computed as such. Windows are computed without a T x T matrix: on CUDA's
flash kernel by its own window (window_size_left = W - 1), elsewhere in bands (banded_attention).
"""
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fsdp_gpt.attention_kernels import SinkAttention, sink_gradient, sink_merged
from fsdp_gpt.compat import flash_takes_window


def sdpa_takes_gqa(q: torch.Tensor) -> bool:
    """Whether scaled_dot_product_attention(enable_gqa=True) runs q's grouped-query attention
    without a T x T scores matrix. CPU's fused kernel takes it in every dtype; on CUDA only the
    flash kernel does (fp16/bf16 on sm80+, head_dim a multiple of 8 up to 256): elsewhere (fp32,
    fp16 on a V100 or T4) CUDA would fall back to the math kernel."""
    if q.device.type != "cuda":
        return True
    head_dim = q.shape[-1]
    return (q.dtype in (torch.float16, torch.bfloat16) and torch.cuda.get_device_capability(q.device)[0] >= 8
            and head_dim % 8 == 0 and head_dim <= 256)


@dataclass
class DocumentBuckets:
    """Every document of a micro-batch's rows, in groups of like length: a document is computed
    right-padded to its group's length, and causal attention keeps its queries off the padding that
    follows it, so no mask is needed. Positions are flat, row * T + column."""
    gathers: list[torch.Tensor]  # per group, (documents, padded length): each token's position, the padding repeating the last
    reals: list[torch.Tensor]  # per group, (documents, padded length): True at a real token, False at padding
    source: torch.Tensor  # (B * T,): where each position's result lies in the groups' results, flattened and concatenated

    def regroup(self, results: list[torch.Tensor], rows: int) -> torch.Tensor:
        """The groups' results, (documents x padded length, heads, ...) each, back in the rows'
        order: (rows, heads, T, ...)."""
        return torch.cat(results)[self.source].unflatten(0, (rows, -1)).transpose(1, 2)


def by_position(t: torch.Tensor) -> torch.Tensor:
    """(B, heads, T, ...) -> (B * T, heads, ...): the rows' positions flat, as DocumentBuckets counts them."""
    return t.transpose(1, 2).flatten(0, 1)


def padded_length(lengths: np.ndarray) -> np.ndarray:
    """A document's group: its length rounded up to a quarter of the power of two below it (at
    least 16). At most (5/4)^2 the causal work of the document alone, and 4 groups per octave."""
    granule = np.left_shift(1, np.maximum(np.floor(np.log2(lengths)).astype(np.int64) - 2, 4))
    return -(-lengths // granule) * granule


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to the device without making the host wait (pinned, queued on the stream)."""
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


class Documents:
    """Where the documents of a micro-batch's rows lie, found once per forward for every layer:
    ids (B, T), a host array, the document of each position (a separator opens the next: 0, 1, ...
    or 1, 2, ... where a row starts with one). Linear in T: no T x T mask."""

    def __init__(self, ids: np.ndarray):
        self.ids = ids
        self._buckets, self._sequences = {}, {}  # by device: made at the first layer, read by the others

    @classmethod
    def of_rows(cls, opens: np.ndarray | torch.Tensor) -> "Documents":
        """opens (B, T): the tokens of whole rows that open a document; a host array (the loader's)
        for free, or a tensor, whose copy to the host waits for its device."""
        return cls(np.cumsum(opens if isinstance(opens, np.ndarray) else opens.cpu().numpy(), axis=-1))

    def starts(self) -> np.ndarray:
        """Where each document starts in the rows' positions laid end to end (row * T + column)."""
        ids = self.ids
        flat = (ids + np.arange(ids.shape[0])[:, None] * (ids.max() + 1)).ravel()  # no document spans two rows
        return np.flatnonzero(np.concatenate([[True], flat[1:] != flat[:-1]]))

    def sequences(self, device: torch.device) -> torch.Tensor:
        """The documents' bounds in the rows laid end to end, (documents + 1,) int32 on the device:
        varlen attention's cumulative sequence lengths."""
        if device not in self._sequences:
            self._sequences[device] = to_device(torch.from_numpy(np.append(self.starts(), self.ids.size).astype(np.int32)),
                                                device)
        return self._sequences[device]

    def buckets(self, device: torch.device) -> DocumentBuckets:
        if device not in self._buckets:
            starts = self.starts()
            lengths = np.diff(np.append(starts, self.ids.size))
            padded = padded_length(lengths)
            gathers, reals, source, offset = [], [], np.empty(self.ids.size, dtype=np.int64), 0
            for length in np.unique(padded):
                mine = padded == length
                column = np.arange(length)
                gathers.append(starts[mine, None] + np.minimum(column, lengths[mine, None] - 1))
                reals.append(column < lengths[mine, None])
                source[gathers[-1][reals[-1]]] = offset + np.flatnonzero(reals[-1])
                offset += gathers[-1].size
            # one copy to the device for all of it
            arrays = gathers + [r.astype(np.int64) for r in reals] + [source]
            moved = to_device(torch.from_numpy(np.concatenate([a.ravel() for a in arrays])), device)
            moved = moved.split([a.size for a in arrays])
            moved = [m.view(a.shape) for m, a in zip(moved, arrays)]
            self._buckets[device] = DocumentBuckets(moved[:len(gathers)], [m.bool() for m in moved[len(gathers):-1]],
                                                    moved[-1])
        return self._buckets[device]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, enable_gqa: bool,
                     docs: Documents | None = None, window: int | None = None, scale: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention's core: q (B, heads, T, head_dim), k and v (B, kv heads, T, head_dim) -> like q.
    docs: where documents lie in these rows, or None: each row is one sequence. window: each
    query's keys, itself and the window - 1 before it (None: every earlier key); scale: the scores'
    factor (None: 1/sqrt(head_dim)); sinks: each head's sink logit (heads,), or None. SDPA picks the
    flash or memory-efficient kernel on GPU, a fused flash kernel on CPU (with sinks: attention_kernels')."""
    if docs is not None:
        return document_attention(q, k, v, dropout_p, enable_gqa, docs, window, scale, sinks)
    if window is None or window >= q.shape[-2]:
        return sdpa(q, k, v, dropout_p, enable_gqa, scale, sinks, causal=True)
    if varlen_runs(q, window):  # each row a sequence of the varlen call
        B, T = q.shape[0], q.shape[-2]
        rows = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device)
        return VarlenAttention.apply(q, k, v, rows, dropout_p, window, scale, sinks)
    return banded_attention(q, k, v, window, dropout_p, enable_gqa, scale, sinks)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, enable_gqa: bool, scale: float | None,
         sinks: torch.Tensor | None, causal: bool = False, mask: torch.Tensor | None = None) -> torch.Tensor:
    """One call over whole rows: SDPA's, or with sinks a kernel that returns the rows' log-sum-exp, the
    sinks applied on it (attention_kernels.SinkAttention; the checks refuse dropout beside sinks)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout_p,
                                              enable_gqa=enable_gqa, scale=scale)
    return SinkAttention.apply(q, k, v, sinks, causal, mask, scale)


def band_mask(blocks: int, window: int, device: torch.device) -> torch.Tensor:
    """(blocks, 1, window, 2 window): which of a block's keys (the block before, then its own) each of
    its queries attends to: key j of query i where i < j <= i + window, and none of block 0's
    first half (there is no block before it)."""
    i = torch.arange(window, device=device)[:, None]
    j = torch.arange(2 * window, device=device)[None, :]
    mask = ((j > i) & (j <= i + window)).expand(blocks, window, 2 * window).clone()
    mask[0, :, :window] = False
    return mask.unsqueeze(1)


def banded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, dropout_p: float,
                     enable_gqa: bool, scale: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention within a window, in work and memory linear in the row: the row cut into
    blocks of `window` queries, each block's against its own keys and the block before's (2 x window
    keys, the band masked), one SDPA call for every block of every row. The row is padded to whole
    blocks at its end, keys no real query reaches."""
    B, H, T, D = q.shape
    blocks = -(-T // window)

    def cut(t: torch.Tensor) -> torch.Tensor:  # (B, h, T, D) -> (B, h, blocks, window, D)
        return F.pad(t, (0, 0, 0, blocks * window - T)).unflatten(2, (blocks, window))

    def batched(t: torch.Tensor) -> torch.Tensor:  # (B, h, blocks, L, D) -> (B x blocks, h, L, D)
        return t.transpose(1, 2).flatten(0, 1)

    if enable_gqa and q.device.type == "cuda":  # no fused CUDA kernel takes a mask and grouped heads
        k, v = (t.repeat_interleave(H // k.shape[1], dim=1) for t in (k, v))
        enable_gqa = False
    kb, vb = cut(k), cut(v)
    # each block's keys: the block before it (block 0: zeros, masked), then its own
    k2, v2 = (torch.cat([F.pad(t, (0, 0, 0, 0, 1, 0))[:, :, :blocks], t], dim=3) for t in (kb, vb))
    mask = band_mask(blocks, window, q.device).expand(B, -1, -1, -1, -1).flatten(0, 1)  # (B x blocks, 1, w, 2w)
    out = sdpa(batched(cut(q)), batched(k2), batched(v2), dropout_p, enable_gqa, scale, sinks, mask=mask)
    return out.unflatten(0, (B, blocks)).transpose(1, 2).flatten(2, 3)[:, :, :T]


def varlen_runs(q: torch.Tensor, window: int | None = None) -> bool:
    """Whether CUDA's flash kernel computes q's sequences (a micro-batch's documents, or its rows
    under a window) by its variable-length call: where SDPA would run it (sdpa_takes_gqa), with its
    head counts as they are, and with a window where this torch's kernel takes one."""
    return q.device.type == "cuda" and sdpa_takes_gqa(q) and (window is None or flash_takes_window())


@torch.compiler.disable  # host-side bookkeeping of the documents (made once a forward): eager in compiled blocks
def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, enable_gqa: bool,
                       docs: Documents, window: int | None = None, scale: float | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """doc_mask: a token attends to the earlier tokens of its own document only (within the window,
    where one is set). On CUDA's flash kernel, one varlen call over every document of every row;
    elsewhere, in groups of like length."""
    if varlen_runs(q, window):
        return VarlenAttention.apply(q, k, v, docs.sequences(q.device), dropout_p, window, scale, sinks)
    return grouped_document_attention(q, k, v, dropout_p, enable_gqa, docs, window, scale, sinks)


aten = torch.ops.aten


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(B, heads, T, D) -> (B * T, heads, D): the rows' positions laid end to end, as varlen takes them."""
    B, heads, T, D = t.shape
    return t.transpose(1, 2).reshape(B * T, heads, D)


def flash_window(window: int | None) -> dict:
    """The flash kernel's window arguments: keys up to window - 1 before the query, none after it."""
    return {} if window is None else dict(window_size_left=window - 1, window_size_right=0)


def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, dropout_p: float,
                   window: int | None = None, scale: float | None = None):
    """The flash kernel's variable-length form, causal within each document (cu_seqlens: their
    bounds in the rows laid end to end): one call for all of them, nothing gathered or padded. ->
    the output like q, its log-sum-exp (B, heads, T) in fp32, and what the backward needs."""
    B, H, T, D = q.shape
    out, lse, rng_state, unused, _ = aten._flash_attention_forward(_flat(q), _flat(k), _flat(v), cu_seqlens, cu_seqlens,
                                                                   T, T, dropout_p, True, False, scale=scale,
                                                                   **flash_window(window))
    return out.view(B, T, H, D).transpose(1, 2), lse.view(H, B, T).transpose(0, 1), (rng_state, unused)


def varlen_backward(dout, q, k, v, out, lse, cu_seqlens: torch.Tensor, dropout_p: float, aux,
                    window: int | None = None, scale: float | None = None) -> list[torch.Tensor]:
    """dq, dk, dv of varlen_forward, given the output and log-sum-exp to take (a ring's merged ones)."""
    B, H, T, D = q.shape
    grads = aten._flash_attention_backward(_flat(dout), _flat(q), _flat(k), _flat(v), _flat(out),
                                           lse.transpose(0, 1).reshape(H, B * T), cu_seqlens, cu_seqlens, T, T,
                                           dropout_p, True, *aux, scale=scale, **flash_window(window))
    return [g.reshape(B, T, -1, D).transpose(1, 2) for g in grads]


class VarlenAttention(torch.autograd.Function):
    """doc_mask (and windows) on CUDA's flash kernel: every document of every row in one varlen call,
    and only each document's own causal work done (within the window, where one is set); with sinks,
    each head's sink applied on the call's log-sum-exp (attention_kernels.py)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, dropout_p, window=None, scale=None, sinks=None):
        out, lse, aux = varlen_forward(q, k, v, cu_seqlens, dropout_p, window, scale)
        if sinks is not None:
            out, lse = sink_merged(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, *([] if sinks is None else [sinks]), *aux)
        ctx.dropout_p, ctx.window, ctx.scale, ctx.sinks = dropout_p, window, scale, sinks is not None
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_seqlens, *aux = ctx.saved_tensors
        sinks = aux.pop(0) if ctx.sinks else None
        grads = varlen_backward(dout, q, k, v, out, lse, cu_seqlens, ctx.dropout_p, aux, ctx.window, ctx.scale)
        return *grads, None, None, None, None, None if sinks is None else sink_gradient(dout, out, lse, sinks)


def grouped_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, enable_gqa: bool,
                               docs: Documents, window: int | None = None, scale: float | None = None,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """doc_mask where no varlen kernel runs (the CPU): the documents of all rows are gathered into
    groups of like length (Documents.buckets), and each group is one causal call (within the window,
    where one is set): no mask is built, memory is about the unmasked call's, and the work is each
    document's length squared, so a row of many short documents costs less than a row of one."""
    buckets = docs.buckets(q.device)
    flat = [by_position(t) for t in (q, k, v)]  # (B*T, heads, D)
    results = [by_position(causal_attention(*(t[gather].transpose(1, 2) for t in flat), dropout_p, enable_gqa,
                                            window=window, scale=scale, sinks=sinks))
               for gather in buckets.gathers]  # (documents x padded length, heads, D) each
    return buckets.regroup(results, q.shape[0])

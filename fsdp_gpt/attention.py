"""Attention's core for the model (no distributed code): causal over whole rows, or over the
documents inside them (doc_mask), and which grouped-query attention SDPA runs without a T x T matrix.
Context parallelism swaps the core from outside (distributed/context_parallel.py).
"""
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


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
                     docs: Documents | None = None) -> torch.Tensor:
    """Attention's core: q (B, heads, T, head_dim), k and v (B, kv heads, T, head_dim) -> like q.
    docs: where documents lie in these rows, or None: each row is one sequence. SDPA picks the flash
    or memory-efficient kernel on GPU, a fused flash kernel on CPU."""
    if docs is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=enable_gqa)
    return document_attention(q, k, v, dropout_p, enable_gqa, docs)


def varlen_runs(q: torch.Tensor) -> bool:
    """Whether CUDA's flash kernel takes the documents as sequences of their own (varlen): where SDPA
    would run it (sdpa_takes_gqa), with its head counts as they are."""
    return q.device.type == "cuda" and sdpa_takes_gqa(q)


@torch.compiler.disable  # host-side bookkeeping of the documents (made once a forward): eager in compiled blocks
def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, enable_gqa: bool,
                       docs: Documents) -> torch.Tensor:
    """doc_mask: a token attends to the earlier tokens of its own document only. On CUDA's flash
    kernel, one varlen call over every document of every row; elsewhere, in groups of like length."""
    if varlen_runs(q):
        return VarlenAttention.apply(q, k, v, docs.sequences(q.device), dropout_p)
    return grouped_document_attention(q, k, v, dropout_p, enable_gqa, docs)


aten = torch.ops.aten


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(B, heads, T, D) -> (B * T, heads, D): the rows' positions laid end to end, as varlen takes them."""
    B, heads, T, D = t.shape
    return t.transpose(1, 2).reshape(B * T, heads, D)


def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, dropout_p: float):
    """The flash kernel's variable-length form, causal within each document (cu_seqlens: their
    bounds in the rows laid end to end): one call for all of them, nothing gathered or padded. ->
    the output like q, its log-sum-exp (B, heads, T) in fp32, and what the backward needs."""
    B, H, T, D = q.shape
    out, lse, rng_state, unused, _ = aten._flash_attention_forward(_flat(q), _flat(k), _flat(v), cu_seqlens, cu_seqlens,
                                                                   T, T, dropout_p, True, False)
    return out.view(B, T, H, D).transpose(1, 2), lse.view(H, B, T).transpose(0, 1), (rng_state, unused)


def varlen_backward(dout, q, k, v, out, lse, cu_seqlens: torch.Tensor, dropout_p: float, aux) -> list[torch.Tensor]:
    """dq, dk, dv of varlen_forward, given the output and log-sum-exp to take (a ring's merged ones)."""
    B, H, T, D = q.shape
    grads = aten._flash_attention_backward(_flat(dout), _flat(q), _flat(k), _flat(v), _flat(out),
                                           lse.transpose(0, 1).reshape(H, B * T), cu_seqlens, cu_seqlens, T, T,
                                           dropout_p, True, *aux)
    return [g.reshape(B, T, -1, D).transpose(1, 2) for g in grads]


class VarlenAttention(torch.autograd.Function):
    """doc_mask on CUDA's flash kernel: every document of every row in one varlen call, and only each
    document's own causal work done."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, dropout_p):
        out, lse, aux = varlen_forward(q, k, v, cu_seqlens, dropout_p)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, *aux)
        ctx.dropout_p = dropout_p
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_seqlens, *aux = ctx.saved_tensors
        return *varlen_backward(dout, q, k, v, out, lse, cu_seqlens, ctx.dropout_p, aux), None, None


def grouped_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, enable_gqa: bool,
                               docs: Documents) -> torch.Tensor:
    """doc_mask where no varlen kernel runs (the CPU): the documents of all rows are gathered into
    groups of like length (Documents.buckets), and each group is one causal SDPA call: no mask is
    built, memory is about the unmasked call's, and the work is each document's length squared, so a
    row of many short documents costs less than a row of one."""
    buckets = docs.buckets(q.device)
    flat = [by_position(t) for t in (q, k, v)]  # (B*T, heads, D)
    results = [by_position(F.scaled_dot_product_attention(*(t[gather].transpose(1, 2) for t in flat), is_causal=True,
                                                          dropout_p=dropout_p, enable_gqa=enable_gqa))
               for gather in buckets.gathers]  # (documents x padded length, heads, D) each
    return buckets.regroup(results, q.shape[0])

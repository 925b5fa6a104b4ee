"""Ring attention (cp_mode: ring): each rank keeps its queries while the keys and values travel round
the context group, one rank's block a step; each step's partial result is merged into the running
one by the two log-sum-exps. At step s, rank r holds the block of rank (r - s) mod cp.

The zigzag layout (context_parallel.row_pieces: rank r holds chunks r and 2cp-1-r of the row's 2cp)
gives every rank the same causal work at every step:
  step 0, its own block: its queries against its keys, causal (its two chunks are in row order);
  a block of an earlier rank: all its queries against the block's first chunk, in full (the block's
    second chunk lies after both of its own);
  a block of a later rank: its second chunk's queries against the whole block, in full (its first
    chunk lies before both of the block's).
After step 0, each step is C x 2C query-key pairs on every rank (C: a chunk's tokens).
doc_mask: step 0 is causal attention within each document of the rank's own tokens, computed as
attention.document_attention computes it (on CUDA's flash kernel one varlen call, elsewhere documents
in groups of like length, right-padded, one kernel call a group); after it, each rectangle is cut into one per document (a document's queries against
the same document's keys: at most one document spans the gap between two chunks, so at most two
per row and step), each computed alone; a query none of whose keys is in a step's block sits that
step out. No mask is built.

Backward is exact: the forward keeps the merged output and log-sum-exp, and each step's kernel
backward runs with those (dS = P (dP - rowsum(dO O)), P from the final log-sum-exp), which gives each
block's exact share of dq and its exact dk, dv; those travel with their block and reach its owner
after cp passes. A recomputed forward (activation checkpointing) repeats the first bitwise: the same
kernels on the same blocks in the same order.

A sliding window shorter than the row (sliding_window) takes window_ring.py instead: a rank there
exchanges only the columns a window reaches, not the whole ring's blocks; at cp_size 1, where the
rank holds whole rows, the model's own windowed attention (attention.causal_attention) runs.

Kernels (attention_kernels.KERNELS): the fused flash kernels' own forward, which returns the log-sum-exp,
and backward, which takes it: the CPU's (fp32, bf16) and CUDA's flash (bf16, fp16; sm80 and later).
Grouped-query attention: the ring carries key/value heads only, repeated for the kernel where they are
used. Sinks (gpt-oss): each head's joins every row once, on the merged log-sum-exp after the last step
(attention_kernels.sink_merged); backward runs the kernels with that output and log-sum-exp.
"""
import numpy as np
import torch
import torch.distributed as dist

from fsdp_gpt.attention import (DocumentBuckets, Documents, by_position, causal_attention, varlen_backward,
                                 varlen_forward, varlen_runs)
from fsdp_gpt.distributed.precision import Chip
from fsdp_gpt.attention_kernels import KERNELS, sink_gradient, sink_merged
from fsdp_gpt.distributed.window_ring import WindowPlan, WindowRing, fold_heads, merge, repeat_heads


def ring_refusal(chip: Chip, dtype: torch.dtype) -> str | None:
    """Why the ring's kernels can't run on this device, or None."""
    if chip.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        return None
    if chip.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and chip.capability >= (8, 0):
        return None
    return (f"cp_mode: ring runs the flash kernel, which returns the log-sum-exp the ring merges: on CUDA in bf16 "
            f"or fp16 from sm80 (A100) on, on CPU in fp32 or bf16; here {chip.type} in {dtype} is not built "
            f"(use cp_mode: ulysses)")


def _steps(rank: int, cp: int, chunk: int) -> list[tuple[int, bool, tuple[int, int, int, int]]]:
    """Per step: the block's owner, causal or not, and the (q0, q1, k0, k1) rectangle of local query
    columns against the block's columns that the zigzag layout leaves to compute."""
    steps = []
    for step in range(cp):
        source = (rank - step) % cp
        if source == rank:
            steps.append((source, True, (0, 2 * chunk, 0, 2 * chunk)))
        elif source < rank:
            steps.append((source, False, (0, 2 * chunk, 0, chunk)))
        else:
            steps.append((source, False, (chunk, 2 * chunk, 0, 2 * chunk)))
    return steps


def _by_document(ids_q: np.ndarray, ids_k: np.ndarray) -> list[tuple[int, int, int, int]]:
    """(q0, q1, k0, k1) of each document that has queries in ids_q and keys in ids_k (both sorted)."""
    common = np.intersect1d(ids_q, ids_k)
    bounds = [np.searchsorted(ids, common, side) for ids in (ids_q, ids_k) for side in ("left", "right")]
    return [tuple(map(int, rect)) for rect in zip(*bounds)]


def _own_documents(run, q, k, v, groups: int, buckets: DocumentBuckets, scale: float | None):
    """Step 0 under doc_mask: causal attention within each document of the rank's own tokens, a
    kernel call per group of like length. Output and log-sum-exp like q's, and each call's aux."""
    q_, k_, v_ = (by_position(t) for t in (q, k, v))
    outs, lses, auxes = [], [], []
    for gather in buckets.gathers:
        out, lse, aux = run(q_[gather].transpose(1, 2), *(repeat_heads(t[gather].transpose(1, 2), groups) for t in (k_, v_)),
                            True, scale)
        outs.append(by_position(out))
        lses.append(by_position(lse))
        auxes.append(aux)
    return buckets.regroup(outs, q.shape[0]), buckets.regroup(lses, q.shape[0]), auxes


def _own_documents_backward(run_backward, dout, q, k, v, out, lse, groups: int, buckets: DocumentBuckets, auxes,
                            scale: float | None):
    """dq, dk, dv of step 0 under doc_mask, with the final output and log-sum-exp (padding's queries
    carry no gradient: its rows of dout are zeroed)."""
    dout_, q_, k_, v_, out_, lse_ = (by_position(t) for t in (dout, q, k, v, out, lse))
    grads = [], [], []
    for gather, real, aux in zip(buckets.gathers, buckets.reals, auxes):
        block = run_backward((dout_[gather] * real[..., None, None]).transpose(1, 2), q_[gather].transpose(1, 2),
                             *(repeat_heads(t[gather].transpose(1, 2), groups) for t in (k_, v_)),
                             out_[gather].transpose(1, 2), lse_[gather].transpose(1, 2), aux, True, scale)
        for kept, grad, fold in zip(grads, block, (1, groups, groups)):
            kept.append(by_position(fold_heads(grad, fold)))
    return [buckets.regroup(kept, q.shape[0]) for kept in grads]


def _own_forward(run, q, k, v, groups: int, own: Documents, scale: float | None):
    """Step 0 under doc_mask: on CUDA's flash kernel one varlen call over the rank's own documents,
    elsewhere a call per group of like length."""
    if varlen_runs(q):
        return varlen_forward(q, k, v, own.sequences(q.device), 0.0, scale=scale)
    return _own_documents(run, q, k, v, groups, own.buckets(q.device), scale)


def _own_backward(run_backward, dout, q, k, v, out, lse, groups: int, own: Documents, aux, scale: float | None):
    if varlen_runs(q):
        return varlen_backward(dout, q, k, v, out, lse, own.sequences(q.device), 0.0, aux, scale=scale)
    return _own_documents_backward(run_backward, dout, q, k, v, out, lse, groups, own.buckets(q.device), aux, scale)


class RingAttention:
    """The attention core of a rank of a context group in ring mode (attention.causal_attention's
    signature), one object for every layer. positions: each rank's columns' positions in the row."""

    def __init__(self, group, cp_rank: int, positions: list[torch.Tensor]):
        self.group, self.rank, self.cp = group, cp_rank, len(positions)
        self.positions = [p.numpy() for p in positions]
        self.row = sum(map(len, self.positions))  # a whole row's tokens
        if self.cp > 1:
            self.next, self.prev = (self.global_rank((cp_rank + shift) % self.cp) for shift in (1, -1))
        self._plan = (None, None)  # (docs, plan) of the latest forward: every layer's
        self._windows, self._masks = {}, (None, {})  # window -> WindowPlan; (docs, {window: masks}) of the latest

    def plan(self, docs: Documents | None) -> tuple[Documents | None, list[tuple[bool, list[tuple]]]]:
        """The rank's own tokens' documents (None without doc_mask), and per step: causal or not, and
        the (rows, q0, q1, k0, k1) rectangles to compute (step 0 under doc_mask: none, the documents
        are computed whole). The same for every layer of a forward and its backward: made once per Documents."""
        if self._plan[0] is not docs or self._plan[1] is None:
            chunk, mine = len(self.positions[self.rank]) // 2, self.positions[self.rank]
            own = None if docs is None else Documents(docs.ids[:, mine])
            ids = None if docs is None else docs.ids
            steps = []
            for source, causal, (q0, q1, k0, k1) in _steps(self.rank, self.cp, chunk):
                if docs is None:
                    rects = [(slice(None), q0, q1, k0, k1)]
                elif source == self.rank:
                    rects = []  # own.buckets
                else:
                    theirs = self.positions[source][k0:k1]
                    rects = [(slice(row, row + 1), q0 + a, q0 + b, k0 + c, k0 + d) for row in range(len(ids))
                             for a, b, c, d in _by_document(ids[row, mine[q0:q1]], ids[row, theirs])]
                steps.append((causal, rects))
            self._plan = (docs, (own, steps))
        return self._plan[1]

    def pass_on(self, t: torch.Tensor):
        """Send t to the next rank of the ring and receive the previous rank's: returns a function that
        waits for both and returns what came (a plain closure, freed when dropped: a class made here
        would sit in a reference cycle, holding both blocks until the garbage collector ran)."""
        sent = t.contiguous()
        received = torch.empty_like(sent)  # the layout of what is sent: empty_like(t) would keep t's strides
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, self.next, self.group),
                                        dist.P2POp(dist.irecv, received, self.prev, self.group)])

        def wait() -> torch.Tensor:
            for work in works:
                work.wait()
            return received
        return wait

    def global_rank(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank)

    def window_plan(self, window: int, docs: Documents | None, device: torch.device) -> tuple[WindowPlan, list]:
        """The exchanges and tiles of a window (made once), and its tiles' masks for these rows'
        documents (made once per forward: every layer of that window reads them)."""
        if window not in self._windows:
            self._windows[window] = WindowPlan(self.rank, self.positions, window)
        if self._masks[0] is not docs:
            self._masks = (docs, {})
        masks = self._masks[1]
        if window not in masks:
            masks[window] = self._windows[window].masks(None if docs is None else docs.ids, device)
        return self._windows[window], masks[window]

    @torch.compiler.disable  # host loops and point-to-point sends: eager inside a compiled block
    def __call__(self, q, k, v, dropout_p: float, enable_gqa: bool, docs: Documents | None = None,
                 window: int | None = None, scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        assert dropout_p == 0.0, "config_checks.validate refuses dropout with cp_mode: ring"
        if window is not None and window < self.row:  # shorter than a row
            if self.cp == 1:  # the whole row here: the model's own window (the flash kernel's on CUDA), no tiles
                return causal_attention(q, k, v, dropout_p, enable_gqa, docs, window, scale, sinks)
            return self.window_tiles(q, k, v, docs, window, scale, sinks)
        return _Ring.apply(q, k, v, self, *self.plan(docs), scale, sinks)

    def window_tiles(self, q, k, v, docs: Documents | None, window: int, scale: float | None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
        """A window shorter than the row over the context group: window_ring.py's exchanges and tiles."""
        plan, masks = self.window_plan(window, docs, q.device)
        return WindowRing.apply(q, k, v, self, plan, masks, q.shape[-1] ** -0.5 if scale is None else scale, sinks)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: RingAttention, own: Documents | None, plan: list, scale: float | None, sinks=None):
        run, _ = KERNELS[q.device.type]
        groups = q.shape[1] // k.shape[1]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # merged in fp32
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        kv, auxes = torch.stack((k, v)), []
        for step, (causal, rects) in enumerate(plan):
            incoming = ring.pass_on(kv) if step < ring.cp - 1 else None  # the next block travels meanwhile
            if step == 0 and own is not None:
                own_out, own_lse, own_auxes = _own_forward(run, q, k, v, groups, own, scale)
                out.copy_(own_out)
                lse.copy_(own_lse)
                auxes.append(own_auxes)
            for rows, q0, q1, k0, k1 in rects:
                block_out, block_lse, aux = run(q[rows, :, q0:q1], *(repeat_heads(t, groups) for t in kv[:, rows, :, k0:k1]),
                                                causal, scale)
                auxes.append(aux)
                if step == 0:  # every query attends to itself at step 0: the first result of each
                    out[rows, :, q0:q1] = block_out
                    lse[rows, :, q0:q1] = block_lse
                else:
                    merge(out[rows, :, q0:q1], lse[rows, :, q0:q1], block_out.float(), block_lse)
            if incoming is not None:
                kv = incoming()
        if sinks is not None:  # once, on the row's merged log-sum-exp
            out, lse = sink_merged(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *([] if sinks is None else [sinks]))
        ctx.ring, ctx.own, ctx.plan, ctx.auxes, ctx.scale = ring, own, plan, auxes, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        ring, groups = ctx.ring, q.shape[1] // k.shape[1]
        _, run_backward = KERNELS[q.device.type]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # the held block's, accumulated in fp32
        auxes = iter(ctx.auxes)
        for step, (causal, rects) in enumerate(ctx.plan):
            incoming = ring.pass_on(kv) if step < ring.cp - 1 else None
            if step == 0 and ctx.own is not None:
                own = _own_backward(run_backward, dout, q, k, v, out, lse, groups, ctx.own, next(auxes), ctx.scale)
                dq += own[0]
                dkv[0] += own[1]
                dkv[1] += own[2]
            for rows, q0, q1, k0, k1 in rects:
                local = (rows, slice(None), slice(q0, q1))
                dq_block, dk_block, dv_block = run_backward(
                    dout[local], q[local], *(repeat_heads(t, groups) for t in kv[:, rows, :, k0:k1]), out[local], lse[local],
                    next(auxes), causal, ctx.scale)
                dq[local] += dq_block
                dkv[0, rows, :, k0:k1] += fold_heads(dk_block, groups)
                dkv[1, rows, :, k0:k1] += fold_heads(dv_block, groups)
            if ring.cp > 1:  # the block's gradient goes on with it; after cp passes it is home
                dkv = ring.pass_on(dkv)()
            if incoming is not None:
                kv = incoming()
        dsinks = sink_gradient(dout, out, lse, sinks[0]) if sinks else None
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, dsinks

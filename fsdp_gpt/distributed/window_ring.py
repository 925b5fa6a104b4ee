"""Ring attention within a sliding window (cp_mode: ring, sliding_window shorter than a row): a rank
needs the keys of the few ranks whose columns lie within a window before its own, not the whole
ring's. So each rank sends each other rank only the columns of its keys and values that the other's
queries can reach (with a window no longer than a chunk of the zigzag layout: a chunk's end, to each
neighbour), receives the columns it needs the same way, and computes locally; backward sends each
received block's gradient back to its owner. Both exchanges are one round of point-to-point
sends, whatever cp_size.

The work is cut into tiles of a few hundred queries of one contiguous run of the rank's columns,
each against the keys within its reach (at most a tile and a window of them): linear in the row. A
tile's mask says which of its pairs the window holds (and, under doc_mask, which share a document).
The kernel is attention written out in fp32 matmuls (attention_kernels.masked_forward: TF32 on GPUs,
autocast off inside it): the output and its log-sum-exp, and the backward given the merged ones, as
the ring's flash kernels are used. No kernel takes an arbitrary mask and returns the log-sum-exp on
every device; this code runs alike on the CPU and CUDA. With sinks, each head's joins the merged row
once (attention_kernels.sink_merged).
"""
import numpy as np
import torch
import torch.distributed as dist

from fsdp_gpt.attention_kernels import masked_backward, masked_forward, sink_gradient, sink_merged


def reach(queries: np.ndarray, keys: np.ndarray, window: int) -> np.ndarray:
    """The indices of `keys` (sorted row positions) that some query at `queries` attends to within the window."""
    starts = np.searchsorted(keys, queries - window + 1, "left")
    ends = np.searchsorted(keys, queries, "right")
    hit = np.zeros(len(keys) + 1, dtype=np.int64)
    np.add.at(hit, starts, 1)
    np.add.at(hit, ends, -1)
    return np.flatnonzero(np.cumsum(hit)[:-1] > 0)


def runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """(first, end) index ranges of the contiguous runs of sorted positions."""
    cuts = np.flatnonzero(np.diff(positions) != 1) + 1
    bounds = [0, *cuts.tolist(), len(positions)]
    return list(zip(bounds, bounds[1:]))


TILE = (256, 512)  # queries a tile: at least the first (few launches for small windows), at most the second (memory)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """out, lse (views of the running fp32 result, from zeros and -inf) merged with a block's, in
    place, by the two log-sum-exps; a query without keys in either keeps its zeros."""
    total = torch.logaddexp(lse, block_lse)
    seen = total > float("-inf")
    total_ = torch.where(seen, total, 0.0).unsqueeze(-1)
    out.copy_(torch.where(seen.unsqueeze(-1), out * (lse.unsqueeze(-1) - total_).exp()
                          + block_out * (block_lse.unsqueeze(-1) - total_).exp(), out))
    lse.copy_(total)


class WindowPlan:
    """What a rank of a context group computes and exchanges for one window: the columns of its
    keys each other rank needs, the columns it receives, and its tiles. positions: each rank's
    columns' positions in the row (sorted); tile: queries a tile (default: the window, within TILE)."""

    def __init__(self, rank: int, positions: list[np.ndarray], window: int, tile: int | None = None):
        self.rank, self.window = rank, window
        tile = tile or min(max(window, TILE[0]), TILE[1])
        mine = positions[rank]
        # source -> the (first, end) range of its columns my queries reach; rank -> the range of mine it needs
        self.needs = {source: self._span(reach(mine, theirs, window)) for source, theirs in enumerate(positions)}
        self.needs = {source: span for source, span in self.needs.items() if span}
        self.gives = {other: self._span(reach(theirs, mine, window)) for other, theirs in enumerate(positions)
                      if other != rank}
        self.gives = {other: span for other, span in self.gives.items() if span}
        self.tiles = []  # (q0, q1, source, k0, k1): k0, k1 within the columns received from the source
        for first, end in runs(mine):
            for q0 in range(first, end, tile):
                q1 = min(q0 + tile, end)
                for source, (lo, hi) in self.needs.items():
                    keys = positions[source][lo:hi]
                    k0 = int(np.searchsorted(keys, mine[q0] - window + 1, "left"))
                    k1 = int(np.searchsorted(keys, mine[q1 - 1], "right"))
                    if k0 < k1:
                        self.tiles.append((q0, q1, source, k0, k1))
        self.positions = positions

    @staticmethod
    def block_shape(kv_shape, span: tuple[int, int]) -> tuple:
        """The shape of the (k, v) columns `span` of a rank's stacked k and v."""
        return (*kv_shape[:3], span[1] - span[0], kv_shape[-1])

    @staticmethod
    def _span(indices: np.ndarray) -> tuple[int, int] | None:
        return (int(indices[0]), int(indices[-1]) + 1) if len(indices) else None

    def masks(self, ids: np.ndarray | None, device: torch.device) -> list[torch.Tensor]:
        """Per tile, (rows or 1, 1, queries, keys): the pairs within the window (and, with ids (B, T),
        the row's document ids, of one document)."""
        mine, found = self.positions[self.rank], []
        for q0, q1, source, k0, k1 in self.tiles:
            lo = self.needs[source][0]
            pq, pk = mine[q0:q1, None], self.positions[source][lo + k0:lo + k1][None, :]
            mask = (pk <= pq) & (pq - pk < self.window)
            if ids is not None:
                mask = mask & (ids[:, mine[q0:q1], None] == ids[:, None, self.positions[source][lo + k0:lo + k1]])
            found.append(torch.from_numpy(np.ascontiguousarray(mask.reshape(-1, 1, *mask.shape[-2:]))).to(device))
        return found


def exchange(ring, blocks: dict[int, torch.Tensor], expect: dict[int, tuple], like: torch.Tensor) -> dict[int, torch.Tensor]:
    """One round of point-to-point sends: blocks[rank] to each rank, a block from each rank of
    `expect` ({rank: its shape}) received; returns those, by rank."""
    received = {rank: torch.empty(shape, dtype=like.dtype, device=like.device) for rank, shape in expect.items()}
    ops = [dist.P2POp(dist.isend, block.contiguous(), ring.global_rank(rank), ring.group) for rank, block in blocks.items()]
    ops += [dist.P2POp(dist.irecv, buffer, ring.global_rank(rank), ring.group) for rank, buffer in received.items()]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return received


def repeat_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated for the query heads each serves (grouped-query attention)."""
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def fold_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """A gradient with respect to repeated key/value heads, summed back onto each key/value head."""
    return t.unflatten(1, (-1, groups)).sum(2) if groups > 1 else t


class WindowRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, plan: WindowPlan, masks: list, scale: float, sinks=None):
        groups, rank = q.shape[1] // k.shape[1], plan.rank
        kv = torch.stack((k, v))
        others = {source: kv[:, :, :, lo:hi] for source, (lo, hi) in plan.gives.items()}
        blocks = exchange(ring, others, {s: plan.block_shape(kv.shape, span) for s, span in plan.needs.items()
                                         if s != rank}, kv)
        if rank in plan.needs:
            lo, hi = plan.needs[rank]
            blocks[rank] = kv[:, :, :, lo:hi]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        for (q0, q1, source, k0, k1), mask in zip(plan.tiles, masks):
            keys, values = (repeat_heads(t[:, :, k0:k1], groups) for t in blocks[source])
            merge(out[:, :, q0:q1], lse[:, :, q0:q1], *masked_forward(q[:, :, q0:q1], keys, values, mask, scale))
        if sinks is not None:  # once, on the row's merged log-sum-exp
            out, lse = sink_merged(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.sinks = sinks is not None
        ctx.save_for_backward(q, out, lse, *([] if sinks is None else [sinks]), *[t for block in blocks.values() for t in block])
        ctx.ring, ctx.plan, ctx.masks, ctx.scale, ctx.sources, ctx.kv_shape = ring, plan, masks, scale, list(blocks), kv.shape
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, *held = ctx.saved_tensors
        sinks = held.pop(0) if ctx.sinks else None
        plan, groups = ctx.plan, q.shape[1] // ctx.kv_shape[2]
        blocks = {source: torch.stack(held[2 * i:2 * i + 2]) for i, source in enumerate(ctx.sources)}
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dblocks = {source: torch.zeros(block.shape, dtype=torch.float32, device=q.device) for source, block in blocks.items()}
        for (q0, q1, source, k0, k1), mask in zip(plan.tiles, ctx.masks):
            local = (slice(None), slice(None), slice(q0, q1))
            keys, values = (repeat_heads(t[:, :, k0:k1], groups) for t in blocks[source])
            dq_tile, dk, dv = masked_backward(dout[local], q[local], keys, values, out[local], lse[local], mask, ctx.scale)
            dq[local] += dq_tile
            dblocks[source][0, :, :, k0:k1] += fold_heads(dk, groups)
            dblocks[source][1, :, :, k0:k1] += fold_heads(dv, groups)
        # each received block's gradient home to its owner; the gradients of my columns from the others
        back = exchange(ctx.ring, {s: g for s, g in dblocks.items() if s != plan.rank},
                        {other: plan.block_shape(ctx.kv_shape, span) for other, span in plan.gives.items()}, dq)
        dkv = torch.zeros(ctx.kv_shape, dtype=torch.float32, device=q.device)
        if plan.rank in dblocks:
            lo, hi = plan.needs[plan.rank]
            dkv[:, :, :, lo:hi] += dblocks[plan.rank]
        for other in sorted(back):  # a fixed order: the sum is the same bits every run
            lo, hi = plan.gives[other]
            dkv[:, :, :, lo:hi] += back[other]
        dsinks = None if sinks is None else sink_gradient(dout, out, lse, sinks)
        return dq.to(q.dtype), dkv[0].to(q.dtype), dkv[1].to(q.dtype), None, None, None, None, dsinks

"""Context parallelism through the linear layers (Gated DeltaNet, linear_attention.py): a rank holds
pieces of each row (context_parallel.row_pieces: one under ulysses, two under the ring's zigzag), and
each piece must start from the state, and the convolution's inputs, that the row before it ends with.

The convolution: every rank's pieces' last kernel - 1 inputs are all-gathered, and each piece takes
those of the piece before it in the row.

The rule: the delta rule is linear in the state it starts from. A piece that starts from S ends at
M S + E and outputs o + r S, where E and o are its run from zeros, and M and r (what each token reads
of the state before the piece) come from the same run with probe columns started at the identity
(linear_attention.chunked_delta_rule: each column of the state steps alone, the probes' with zero
values). So every rank runs its pieces at once, each from zeros and probes; one all-gather hands
every rank every piece's (M, E); each composes the states at the pieces' starts in row order
(S_{p+1} = M_p S_p + E_p, small matmuls) and adds r S to its outputs. Exact, in two collectives a
layer (backward: their reduce-scatters), with no rank waiting for another's pass: the price is the
probes' columns, key_dim beside value_dim in the state.

doc_mask: the pieces are cut further where documents start (segments, each a sequence padded to its
group's length with tokens that neither decay nor write, as attention's documents are grouped:
attention.Documents.buckets). A segment that starts a document starts from zeros, its convolution
from zeros; only a piece's first segment can continue a document from before the piece, and a
piece's state carries on only from its last segment (M is zero where the last segment starts a
document). Every rank learns the whole rows' documents once a forward (context_parallel.RowDocuments).
"""
import numpy as np
import torch

from fsdp_gpt.attention import Documents
from fsdp_gpt.compat import all_gather_autograd
from fsdp_gpt.linear_attention import GatedDeltaNet, chunked_delta_rule


class Segments:
    """Where the segments of a rank's pieces lie (the same for every layer of a forward: made once per
    Documents), on the device: the groups' gathers and real tokens (Documents.buckets over the rank's
    columns), and per segment (in the groups' order) whether it opens its piece and continues a document
    from before it; per piece (row-major, rows x pieces), the index of its last segment."""

    def __init__(self, ids: np.ndarray, piece: int, device: torch.device):
        rows, columns = ids.shape
        cut = np.zeros_like(ids, dtype=bool)
        cut[:, ::piece] = True  # every piece opens a segment
        cut[:, 1:] |= ids[:, 1:] != ids[:, :-1]  # and every document
        self.buckets = Documents(np.cumsum(cut, axis=1)).buckets(device)
        starts = torch.cat([gather[:, 0] for gather in self.buckets.gathers]).cpu().numpy()  # flat row * columns + column
        lengths = torch.cat([real.sum(1) for real in self.buckets.reals]).cpu().numpy()
        row, column = starts // columns, starts % columns
        pieces = row * (columns // piece) + column // piece  # each segment's piece, row-major
        ends = (column + lengths) % piece == 0  # its piece's last segment
        last = np.empty(rows * (columns // piece), dtype=np.int64)
        last[pieces[ends]] = np.flatnonzero(ends)
        self.opens, self.pieces, self.last = (torch.from_numpy(a).to(device) for a in (column % piece == 0, pieces, last))


class LinearPieces:
    """The core of every linear layer of a rank of a context group (linear_attention.delta_rule_rows'
    signature). pieces: each rank's (start, length) pieces of a row, in row order, all of one length."""

    def __init__(self, group, cp_rank: int, pieces: list[list[tuple[int, int]]]):
        self.group, self.rank, self.cp = group, cp_rank, len(pieces)
        self.length, self.row = pieces[0][0][1], sum(length for mine in pieces for _, length in mine)
        self.starts = [start for start, _ in pieces[cp_rank]]
        # every piece of a row in row order, as (rank, index among that rank's)
        self.order = [(r, i) for _, r, i in sorted((start, r, i) for r, mine in enumerate(pieces)
                                                   for i, (start, _) in enumerate(mine))]
        # for each piece of mine, the piece ending where it starts, as rank x pieces + index
        ends = {start + length: r * len(mine) + i for r, mine in enumerate(pieces) for i, (start, length) in enumerate(mine)}
        self.prior = [ends.get(start, 0) for start in self.starts]  # (the row's first piece: any, none of it kept)
        self._plan = (None, None)  # (docs, segments) of the latest forward

    def plan(self, docs: Documents | None, rows: int, reach: int, device: torch.device):
        """(segments, continues, keep) for these rows (made once per Documents: every layer's). continues
        (rows x pieces, row-major): whether a piece continues a document from before it; keep (rows,
        pieces, reach, 1): 1 where each of the `reach` inputs before a piece's start is of the document its
        first token is in (0 before the row's start, or in another document)."""
        if self._plan[0] is not docs or self._plan[1] is None:
            columns = np.concatenate([np.arange(start, start + self.length) for start in self.starts])
            ids = np.zeros((rows, self.row), dtype=np.int64) if docs is None else docs.ids
            keep = np.zeros((rows, len(self.starts), reach, 1), dtype=np.float32)
            for i, start in enumerate(self.starts):
                for j, position in enumerate(range(max(start - reach, 0), start), start=reach - min(start, reach)):
                    keep[:, i, j, 0] = ids[:, position] == ids[:, start]
            # the token just before a piece is of its first token's document
            continues = np.stack([ids[:, start - 1] == ids[:, start] if start else np.zeros(rows, dtype=bool)
                                  for start in self.starts], axis=1).ravel()
            self._plan = (docs, (Segments(ids[:, columns], self.length, device), torch.from_numpy(continues).to(device),
                                 torch.from_numpy(keep).to(device)))
        return self._plan[1]

    @torch.compiler.disable  # host bookkeeping and collectives: eager inside a compiled block
    def __call__(self, layer: GatedDeltaNet, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 docs: Documents | None = None) -> torch.Tensor:
        B, columns, channels = qkv.shape
        n, L, reach = len(self.starts), self.length, layer.conv1d.kernel_size[0] - 1
        dk, dv, heads = layer.key_dim, layer.value_dim, layer.value_heads
        segments, continues, keep = self.plan(docs, B, reach, qkv.device)
        # the convolution's inputs before each piece: the last `reach` of the piece before it, of its document
        tails = all_gather_autograd(qkv.view(B, n, L, channels)[:, :, L - reach:].contiguous(), self.group)
        tails = tails.view(self.cp, B, n, reach, channels).transpose(1, 2).flatten(0, 1)  # (every piece, B, ...)
        # (B, pieces, reach, channels); the row's first piece takes any and keeps none of it, so that every rank
        # uses what it gathered, and runs the backward's reduce-scatter as every other rank does
        before = tails[self.prior].transpose(0, 1) * keep.to(qkv.dtype)
        # each segment from zeros and, where it opens a piece that continues a document, probes at the identity
        flat = [t.flatten(0, 1) for t in (qkv, g, beta)]
        eye = torch.eye(dk, device=qkv.device)
        outputs, finals = [], []
        offset = 0
        for gather, real in zip(segments.buckets.gathers, segments.buckets.reals):
            count = gather.shape[0]
            opens, pieces = segments.opens[offset:offset + count], segments.pieces[offset:offset + count]
            left = torch.where(opens[:, None, None], before.flatten(0, 1)[pieces], 0.0)
            q, k, v = layer.heads(layer.convolved(flat[0][gather], left))
            live = real.unsqueeze(-1)  # padding neither decays nor writes: a segment's final state is its end's
            probes = (opens & continues[pieces]).float()[:, None, None, None] * eye.expand(count, heads, dk, dk)
            state = torch.cat([probes, eye.new_zeros(count, heads, dk, dv)], dim=-1)
            out, final = chunked_delta_rule(q, k, v, flat[1][gather] * live, flat[2][gather] * live, layer.chunk,
                                            state, final=True)
            outputs.append(out.flatten(0, 1))
            finals.append(final)
            offset += count
        out = segments.buckets.regroup(outputs, B).transpose(1, 2)  # (B, columns, heads, dk + dv)
        carry = torch.cat(finals)[segments.last].view(B, n, heads, dk, dk + dv)  # each piece's (M | E)
        carry = all_gather_autograd(carry, self.group).view(self.cp, B, n, heads, dk, dk + dv)
        starts, state = {}, carry.new_zeros(B, heads, dk, dv)
        for r, i in self.order:  # the state at each piece's start, in row order
            starts[r, i] = state
            state = carry[r, :, i, ..., :dk] @ state + carry[r, :, i, ..., dk:]
        # every piece's, stacked before this rank's are taken: every rank's output depends on what it gathered
        # (its backward runs on every rank), even where its own pieces start from zeros or from its own
        every = torch.stack([starts[r, i] for r in range(self.cp) for i in range(n)], dim=1)
        mine = every[:, self.rank * n:(self.rank + 1) * n]  # (B, pieces, heads, dk, dv)
        reads = out[..., :dk].unflatten(1, (n, L))
        out = out[..., dk:] + torch.einsum("bnlhk,bnhkv->bnlhv", reads, mine).flatten(1, 2)
        return out.to(qkv.dtype)

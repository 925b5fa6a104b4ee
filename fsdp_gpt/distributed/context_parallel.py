"""Context parallelism: each row's block_size tokens split over the cp_size ranks of a context-parallel
group, attention still seeing the whole row. Two ways (cp_mode), swapped into the model from outside
(model.py knows nothing of this):

ulysses: rank c of the group holds the row's consecutive slice c (tokens c*T/cp .. (c+1)*T/cp - 1).
One all-to-all turns q, k and v together from sequence-sharded (all heads, the slice's tokens) into
head-sharded (heads/cp, the whole row's tokens), the ordinary attention runs on whole rows, and a
second all-to-all turns the result back. Heads and key/value heads must divide by cp_size.

ring (ring_attention.py): each rank keeps its queries and the key/value blocks travel round the
group. The row is cut into 2 x cp chunks and rank c holds chunks c and 2cp-1-c (zigzag): an early
chunk, whose queries see little, with a late one, whose queries see much, so that every rank has the
same causal work. No head-count limit.

Everything but attention and the linear layers' rule and convolution works on a token alone, so it
runs on a rank's tokens as they are. A linear layer (Gated DeltaNet) takes, in either mode, the state
and the convolution's inputs that the pieces before each of the rank's pieces end with
(linear_context.py). The data-parallel ranks and the context ranks hold the same weights, and FSDP
shards them over both.
doc_mask: every rank learns where the whole rows' documents lie, once per forward (one all-gather of
the tokens that open them), and every layer's attention reads it.
"""
import contextlib

import torch
import torch.distributed as dist
# the functional collective: traced by torch.compile (torch.distributed.nn's raises under compile, and
# the blocks would fall back to eager)
from torch.distributed._functional_collectives import all_to_all_single_autograd

from fsdp_gpt.distributed.linear_context import LinearPieces
from fsdp_gpt.distributed.ring_attention import RingAttention
from fsdp_gpt.attention import Documents, causal_attention
from fsdp_gpt.linear_attention import GatedDeltaNet
from fsdp_gpt.model import GPT


def row_pieces(mode: str, cp_rank: int, cp_size: int, block_size: int) -> list[tuple[int, int]]:
    """The (start, length) pieces of every row that rank cp_rank of a context group computes, in
    row order."""
    if mode == "ulysses":
        length = block_size // cp_size
        return [(cp_rank * length, length)]
    chunk = block_size // (2 * cp_size)
    return [(cp_rank * chunk, chunk), ((2 * cp_size - 1 - cp_rank) * chunk, chunk)]


def swaps_attention(cp_mode: str, cp_size: int) -> bool:
    """Whether a rank's attention core is swapped: context parallelism, or the ring at any cp_size
    (at 1 its kernels alone, no passes; within a window, the model's own)."""
    return cp_size > 1 or cp_mode == "ring"


def positions_of(pieces: list[tuple[int, int]]) -> torch.Tensor:
    """Where each column of a rank holding these pieces of a row sits in the row."""
    return torch.cat([torch.arange(start, start + length) for start, length in pieces])


def row_positions(mode: str, cp_rank: int, cp_size: int, block_size: int) -> torch.Tensor:
    return positions_of(row_pieces(mode, cp_rank, cp_size, block_size))


def context_groups(world_size: int, cp_size: int):
    """This rank's context-parallel group: ranks [g*cp, (g+1)*cp) hold the same rows. Every rank
    makes every group (new_group is a collective), in the same order."""
    mine = None
    for first in range(0, world_size, cp_size):
        group = dist.new_group(list(range(first, first + cp_size)))
        if first <= dist.get_rank() < first + cp_size:
            mine = group
    return mine


def _to_tokens(y: torch.Tensor, group, cp: int) -> torch.Tensor:
    """y (B, heads/cp, T, D): my heads of every rank's tokens -> (B, heads, T/cp, D): every head of my
    tokens. Piece j (rank j's tokens) goes to rank j; the pieces received are rank j's heads."""
    pieces = torch.stack(y.chunk(cp, dim=2))  # (cp, ...): piece j for rank j, one contiguous copy
    received = all_to_all_single_autograd(pieces, None, None, group)
    return torch.cat(received.unbind(0), dim=1)


def _to_heads(tensors: tuple[torch.Tensor, ...], group, cp: int) -> list[torch.Tensor]:
    """Each t (B, heads_t, T/cp, D) of my tokens -> (B, heads_t/cp, T, D): my heads of every rank's
    tokens, all in one all-to-all (one collective a layer for q, k and v, not three; backward likewise)."""
    heads = [t.shape[1] // cp for t in tensors]
    # (cp, B, sum of heads/cp, T/cp, D): row j holds rank j's heads of every tensor
    pieces = torch.cat([t.unflatten(1, (cp, -1)).transpose(0, 1) for t in tensors], dim=2)
    received = all_to_all_single_autograd(pieces, None, None, group)  # row j: rank j's tokens
    return list(torch.cat(received.unbind(0), dim=2).split(heads, dim=1))


class UlyssesAttention:
    """The attention core over whole rows, for q, k, v of this rank's slice (attention.causal_attention's
    signature): heads split over the group for the attention itself (rank c of the group: the c-th
    heads/cp of them, and their sinks)."""

    def __init__(self, group, cp_size: int, cp_rank: int):
        self.group, self.cp, self.rank = group, cp_size, cp_rank

    def __call__(self, q, k, v, dropout_p: float, enable_gqa: bool, docs: Documents | None = None,
                 window: int | None = None, scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        # (B, heads, T/cp, D) -> (B, heads/cp, T, D): my heads, every rank's tokens
        q, k, v = _to_heads((q, k, v), self.group, self.cp)
        mine = None if sinks is None else sinks.chunk(self.cp)[self.rank]
        y = causal_attention(q, k, v, dropout_p, enable_gqa, docs, window, scale, mine)  # docs: the whole rows'
        return _to_tokens(y, self.group, self.cp)  # back: all heads, my tokens


class RowDocuments:
    """GPT.documents for a rank holding pieces of each row: the group's tokens that open a document,
    gathered and put back in row order, give the whole rows' documents (one all-gather a forward)."""

    def __init__(self, group, cp_size: int, mode: str, block_size: int, device: torch.device):
        self.group, self.cp = group, cp_size
        # the row position of each gathered column: rank 0's pieces, then rank 1's, ...
        self.order = torch.cat([row_positions(mode, rank, cp_size, block_size) for rank in range(cp_size)]).to(device)

    def __call__(self, opens: torch.Tensor) -> Documents:
        opens = torch.as_tensor(opens).to(self.order.device)  # the loader's host array: the collective's device
        pieces = [torch.empty_like(opens, dtype=torch.uint8) for _ in range(self.cp)]
        dist.all_gather(pieces, opens.to(torch.uint8), group=self.group)
        rows = torch.empty(opens.shape[0], len(self.order), dtype=torch.uint8, device=opens.device)
        rows[:, self.order] = torch.cat(pieces, dim=-1)
        return Documents.of_rows(rows.bool())


def apply_context_parallel(gpt: GPT, mode: str, group, cp_size: int, cp_rank: int, block_size: int,
                           device: torch.device) -> None:
    """The attention cores and the linear layers' (one object each, shared by every layer of its
    kind) and the documents' finder of a rank of a context group. The ring runs at cp_size 1 too:
    one rank, no passes, its kernels alone (a window shorter than the row: the model's own windowed
    attention); the linear layers' core is their own there."""
    attention = UlyssesAttention(group, cp_size, cp_rank) if mode == "ulysses" else RingAttention(
        group, cp_rank, [row_positions(mode, rank, cp_size, block_size) for rank in range(cp_size)])
    linear = LinearPieces(group, cp_rank, [row_pieces(mode, rank, cp_size, block_size) for rank in range(cp_size)]
                          ) if cp_size > 1 else GatedDeltaNet.plain_core
    for block in gpt.blocks:
        block.attn.core = linear if isinstance(block.attn, GatedDeltaNet) else attention
    if cp_size > 1:
        gpt.documents = RowDocuments(group, cp_size, mode, block_size, device)


@contextlib.contextmanager
def whole_rows(gpt: GPT):
    """Within: every rank computes whole sequences alone (multiple-choice items and text samples,
    whose lengths vary): the plain attention core and documents."""
    cores, documents = [block.attn.core for block in gpt.blocks], gpt.documents
    for block in gpt.blocks:
        block.attn.core = block.attn.plain_core
    gpt.documents = Documents.of_rows
    try:
        yield
    finally:
        for block, core in zip(gpt.blocks, cores):
            block.attn.core = core
        gpt.documents = documents

"""Context parallelism (Ulysses): each row's block_size tokens split over the cp_size ranks of a
context-parallel group, attention still seeing the whole row.

The ranks of a group hold consecutive slices of the same rows (rank c of the group: tokens
c*T/cp .. (c+1)*T/cp - 1). Everything but attention works on a token alone, so it runs on the slice
as it is. Attention's core is swapped from outside (model.py knows nothing of this): an all-to-all
turns q, k and v from sequence-sharded (all heads, the slice's tokens) into head-sharded (heads/cp,
the whole row's tokens), the ordinary causal attention runs on whole rows, and a second all-to-all
turns the result back. Two all-to-alls of activations per layer and direction, no weights: the
data-parallel ranks and the context ranks hold the same weights, and FSDP shards them over both.
Heads and key/value heads must divide by cp_size.
"""
import contextlib

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from fsdp_gpt.model import GPT, causal_attention


def context_groups(world_size: int, cp_size: int):
    """This rank's context-parallel group: ranks [g*cp, (g+1)*cp) hold the same rows. Every rank
    makes every group (new_group is a collective), in the same order."""
    mine = None
    for first in range(0, world_size, cp_size):
        group = dist.new_group(list(range(first, first + cp_size)))
        if first <= dist.get_rank() < first + cp_size:
            mine = group
    return mine


def _exchange(t: torch.Tensor, group, cp: int, split_dim: int, gather_dim: int) -> torch.Tensor:
    """t (B, heads, T, D): split along split_dim into cp pieces, piece j sent to rank j; the pieces
    received, in rank order, concatenated along gather_dim."""
    pieces = torch.stack(t.chunk(cp, dim=split_dim)).contiguous()  # (cp, ...): piece j for rank j
    # the functional collective: traced by torch.compile (torch.distributed.nn's raises under compile,
    # and the blocks would fall back to eager)
    received = all_to_all_single_autograd(pieces, None, None, group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class UlyssesAttention:
    """The attention core over whole rows, for q, k, v of this rank's slice (model.causal_attention's
    signature): heads split over the group for the attention itself."""

    def __init__(self, group, cp_size: int):
        self.group, self.cp = group, cp_size

    def __call__(self, q, k, v, dropout_p: float, enable_gqa: bool, opens: torch.Tensor | None = None) -> torch.Tensor:
        # (B, heads, T/cp, D) -> (B, heads/cp, T, D): my heads, every rank's tokens
        q, k, v = (_exchange(t, self.group, self.cp, split_dim=1, gather_dim=2) for t in (q, k, v))
        if opens is not None:  # where documents open in the whole row: every rank's slice of it
            pieces = [torch.empty_like(opens, dtype=torch.uint8) for _ in range(self.cp)]
            dist.all_gather(pieces, opens.to(torch.uint8), group=self.group)
            opens = torch.cat(pieces, dim=-1).bool()
        y = causal_attention(q, k, v, dropout_p, enable_gqa, opens)
        return _exchange(y, self.group, self.cp, split_dim=2, gather_dim=1)  # back: all heads, my tokens


def apply_context_parallel(gpt: GPT, group, cp_size: int) -> None:
    for block in gpt.blocks:
        block.attn.core = UlyssesAttention(group, cp_size)


@contextlib.contextmanager
def whole_rows(gpt: GPT):
    """Within: every rank computes whole sequences alone (multiple-choice items and text samples,
    whose lengths vary): the plain attention core."""
    cores = [block.attn.core for block in gpt.blocks]
    for block in gpt.blocks:
        block.attn.core = causal_attention
    try:
        yield
    finally:
        for block, core in zip(gpt.blocks, cores):
            block.attn.core = core

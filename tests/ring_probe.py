"""Run on N ranks by test_ring_attention.py: ring attention (each rank its zigzag pieces of the rows)
against the whole rows' attention in one process, on the same q, k, v: outputs and the gradients of
q, k and v at this rank's positions. Rank 0 prints, per case, the largest difference over every rank
as JSON, and the most objects a rank's ring left in reference cycles. Cases: plain causal; documents (several to a row, one spanning it, single-token ones, a row
opening with a separator, edges on and off the chunks' edges); grouped and multi-query heads; sliding
windows wider than a chunk (window_ring.py: columns from ranks beyond the neighbours), with documents;
attention sinks (gpt-oss's: their gradients too, summed over the ranks) through the ring and through
Ulysses (each rank a consecutive slice of the rows; 12 heads, which 2, 3 and 4 ranks divide).
"""
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_gpt.distributed.context_parallel import RowDocuments, UlyssesAttention, row_positions  # noqa: E402
from fsdp_gpt.distributed.launch import run_entry_point  # noqa: E402
from fsdp_gpt.distributed.ring_attention import RingAttention  # noqa: E402
from fsdp_gpt.attention import Documents, causal_attention  # noqa: E402

T = 48  # 2 x cp chunks for cp 2, 3 and 4: chunks of 12, 8 and 6 tokens
DOCUMENTS = ([5, 6, 7, 20, 30], [0, 12, 24, 47])
# (heads, key/value heads, where documents open in row 0 and row 1, or None: no documents; the
# sliding window, or None: causal over the row; the core: ring or ulysses; with sinks)
CASES = {"causal": (4, 4, None, None, "ring", False),
         "documents": (4, 4, DOCUMENTS, None, "ring", False),
         "one document a row": (2, 2, ([], [0]), None, "ring", False),
         "grouped heads, documents": (4, 2, ([1, 2, 3, 4, 5, 40], [23, 24, 25]), None, "ring", False),
         "one key/value head": (2, 1, None, None, "ring", False),
         "one key/value head, documents": (2, 1, ([9, 17, 33], [16, 32]), None, "ring", False),
         "window wider than a chunk": (4, 2, None, 20, "ring", False),
         "window wider than a chunk, documents": (4, 2, DOCUMENTS, 13, "ring", False),
         "sinks, grouped heads": (4, 2, None, None, "ring", True),
         "sinks, window wider than a chunk, documents": (4, 2, DOCUMENTS, 13, "ring", True),
         "ulysses, documents": (12, 12, DOCUMENTS, None, "ulysses", False),
         "ulysses, sinks, documents": (12, 12, DOCUMENTS, None, "ulysses", True),
         "ulysses, sinks, window": (12, 12, None, 20, "ulysses", True)}


def probe() -> None:
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(cp)))
    positions = {mode: [row_positions(mode, r, cp, T) for r in range(cp)] for mode in ("ring", "ulysses")}
    cores = {"ring": RingAttention(group, rank, positions["ring"]), "ulysses": UlyssesAttention(group, cp, rank)}
    report = {}
    for case, (heads, kv_heads, opens_at, window, mode, with_sinks) in CASES.items():
        g = torch.Generator().manual_seed(len(case))
        q, k, v, dout = (torch.randn(2, n, T, 16, generator=g) for n in (heads, kv_heads, kv_heads, heads))
        sinks = torch.randn(heads, generator=g) if with_sinks else None
        mine, core = positions[mode][rank], cores[mode]
        docs = None
        if opens_at is not None:
            opens = torch.zeros(2, T, dtype=torch.bool)
            for row, at in enumerate(opens_at):
                opens[row, at] = True
            docs = RowDocuments(group, cp, mode, T, torch.device("cpu"))(opens[:, mine])
            assert (docs.ids == Documents.of_rows(opens).ids).all()  # the whole rows' documents, gathered
        whole = [t.clone().requires_grad_() for t in (q, k, v) + ((sinks,) if with_sinks else ())]
        expected = causal_attention(*whole[:3], 0.0, heads != kv_heads, docs, window, None, *whole[3:])  # one process's
        expected.backward(dout)
        for attempt in ("first", "counted"):  # a first call's one-time imports and caches are not the ring's
            local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)] + [
                sinks.clone().requires_grad_() for _ in range(with_sinks)]
            gc.collect()
            gc.disable()  # what the ring leaves in reference cycles (blocks in flight held until a collection)
            got = core(*local[:3], 0.0, heads != kv_heads, docs, window, None, *local[3:])
            got.backward(dout[:, :, mine])
            cycles = gc.collect()
            gc.enable()
        diffs = [(got - expected[:, :, mine]).abs().max().item()]
        diffs += [(mine_t.grad - whole_t.grad[:, :, mine]).abs().max().item() for mine_t, whole_t in zip(local[:3], whole)]
        if with_sinks:  # each rank's share of the sinks' gradient: its own queries' (Ulysses: its own heads'), summed
            summed = local[3].grad.clone()
            dist.all_reduce(summed)
            diffs.append((summed - whole[3].grad).abs().max().item())
        gathered = [None] * cp
        dist.all_gather_object(gathered, (max(diffs), cycles))
        report[case] = [max(d for d, _ in gathered), max(c for _, c in gathered)]
    if rank == 0:
        print(json.dumps(report))
    dist.barrier()


run_entry_point(probe)

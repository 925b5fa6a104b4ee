"""Run on N ranks by test_ring_attention.py: ring attention (each rank its zigzag pieces of the rows)
against the whole rows' attention in one process, on the same q, k, v: outputs and the gradients of
q, k and v at this rank's positions. Rank 0 prints, per case, the largest difference over every rank
as JSON, and the most objects a rank's ring left in reference cycles. Cases: plain causal; documents (several to a row, one spanning it, single-token ones, a row
opening with a separator, edges on and off the chunks' edges); grouped and multi-query heads; sliding
windows wider than a chunk (window_ring.py: columns from ranks beyond the neighbours), with documents.
"""
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_gpt.distributed.context_parallel import RowDocuments, row_positions  # noqa: E402
from fsdp_gpt.distributed.launch import run_entry_point  # noqa: E402
from fsdp_gpt.distributed.ring_attention import RingAttention  # noqa: E402
from fsdp_gpt.attention import Documents, causal_attention  # noqa: E402

T = 48  # 2 x cp chunks for cp 2, 3 and 4: chunks of 12, 8 and 6 tokens
# (heads, key/value heads, where documents open in row 0 and row 1, or None: no documents; the
# sliding window, or None: causal over the row)
CASES = {"causal": (4, 4, None, None),
         "documents": (4, 4, ([5, 6, 7, 20, 30], [0, 12, 24, 47]), None),
         "one document a row": (2, 2, ([], [0]), None),
         "grouped heads, documents": (4, 2, ([1, 2, 3, 4, 5, 40], [23, 24, 25]), None),
         "one key/value head": (2, 1, None, None),
         "one key/value head, documents": (2, 1, ([9, 17, 33], [16, 32]), None),
         "window wider than a chunk": (4, 2, None, 20),
         "window wider than a chunk, documents": (4, 2, ([5, 6, 7, 20, 30], [0, 12, 24, 47]), 13)}


def probe() -> None:
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(cp)))
    positions = [row_positions("ring", r, cp, T) for r in range(cp)]
    ring = RingAttention(group, rank, positions)
    mine = positions[rank]
    report = {}
    for case, (heads, kv_heads, opens_at, window) in CASES.items():
        g = torch.Generator().manual_seed(len(case))
        q, k, v, dout = (torch.randn(2, n, T, 16, generator=g) for n in (heads, kv_heads, kv_heads, heads))
        docs = None
        if opens_at is not None:
            opens = torch.zeros(2, T, dtype=torch.bool)
            for row, at in enumerate(opens_at):
                opens[row, at] = True
            docs = RowDocuments(group, cp, "ring", T, torch.device("cpu"))(opens[:, mine])
            assert (docs.ids == Documents.of_rows(opens).ids).all()  # the whole rows' documents, gathered
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = causal_attention(*whole, 0.0, heads != kv_heads, docs, window)  # one process's
        expected.backward(dout)
        for attempt in ("first", "counted"):  # a first call's one-time imports and caches are not the ring's
            local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
            gc.collect()
            gc.disable()  # what the ring leaves in reference cycles (blocks in flight held until a collection)
            got = ring(*local, 0.0, heads != kv_heads, docs, window)
            got.backward(dout[:, :, mine])
            cycles = gc.collect()
            gc.enable()
        diffs = [(got - expected[:, :, mine]).abs().max().item()]
        diffs += [(mine_t.grad - whole_t.grad[:, :, mine]).abs().max().item() for mine_t, whole_t in zip(local, whole)]
        gathered = [None] * cp
        dist.all_gather_object(gathered, (max(diffs), cycles))
        report[case] = [max(d for d, _ in gathered), max(c for _, c in gathered)]
    if rank == 0:
        print(json.dumps(report))
    dist.barrier()


run_entry_point(probe)

"""Run on N ranks by test_linear_attention.py: a linear layer's core over a context group (each rank
its pieces of the rows: ulysses' one, the ring's two) against the whole rows' in one process, on the
same inputs: outputs and the gradients of the inputs at this rank's positions. Rank 0 prints, per
case, the largest difference (relative to the largest entry) over every rank as JSON. Cases: no
documents; documents (several to a row, some crossing pieces and ranks, single tokens, one opening the
row, edges on and off the pieces' edges, a document shorter than the convolution's reach before a
piece's edge)."""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_gpt.attention import Documents  # noqa: E402
from fsdp_gpt.distributed.context_parallel import RowDocuments, row_pieces, row_positions  # noqa: E402
from fsdp_gpt.distributed.launch import run_entry_point  # noqa: E402
from fsdp_gpt.distributed.linear_context import LinearPieces  # noqa: E402
from fsdp_gpt.model import GPT, GPTConfig  # noqa: E402

T = 96  # ring: 2 x cp chunks of 24, 16 and 12 tokens at cp 2, 3 and 4; ulysses: pieces of 48, 32, 24
CASES = {"no documents": None,
         "documents": ([0, 3, 4, 10, 11, 22, 23, 50, 95], [30, 46, 47, 60]),
         "one document a row": ([], [0])}


def probe() -> None:
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(cp)))
    torch.manual_seed(0)
    layer = GPT(GPTConfig(arch="llama", vocab_size=64, block_size=T, n_layer=1, n_head=4, n_embd=32,
                          attn_pattern=["linear"], linear_key_heads=2, linear_value_heads=4, linear_key_dim=8,
                          linear_value_dim=4, linear_chunk=8)).blocks[0].attn
    report = {}
    for mode in ("ulysses", "ring"):
        core = LinearPieces(group, rank, [row_pieces(mode, r, cp, T) for r in range(cp)])
        mine = row_positions(mode, rank, cp, T)
        for case, opens_at in CASES.items():
            g = torch.Generator().manual_seed(len(case))
            qkv, dout = torch.randn(2, T, sum(layer.widths), generator=g), torch.randn(2, T, 4, 4, generator=g)
            gates, beta = -torch.rand(2, T, 4, generator=g) * 3, torch.rand(2, T, 4, generator=g)
            docs = whole = None
            if opens_at is not None:
                opens = torch.zeros(2, T, dtype=torch.bool)
                for row, at in enumerate(opens_at):
                    opens[row, at] = True
                whole = Documents.of_rows(opens)
                docs = RowDocuments(group, cp, mode, T, torch.device("cpu"))(opens[:, mine])
            inputs = [t.clone().requires_grad_() for t in (qkv, gates, beta)]
            expected = layer.plain_core(layer, *inputs, whole)
            expected.backward(dout)
            local = [t[:, mine].clone().requires_grad_() for t in (qkv, gates, beta)]
            got = core(layer, *local, docs)
            got.backward(dout[:, mine])
            pairs = [(got, expected[:, mine])] + [(a.grad, b.grad[:, mine]) for a, b in zip(local, inputs)]
            diffs = [((a - b).abs().max() / b.abs().max()).item() for a, b in pairs]
            gathered = [None] * cp
            dist.all_gather_object(gathered, max(diffs))
            report[f"{mode}, {case}"] = max(gathered)
    if rank == 0:
        print(json.dumps(report))
    dist.barrier()


run_entry_point(probe)

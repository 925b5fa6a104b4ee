"""Run under torchrun by test_collectives.py: the real trainer, with FSDP's gradient collectives counted.

FSDP2 issues every gradient reduction through its _fsdp_collectives module; a counting stand-in
for that module's `dist` sees each one. Rank 0 prints the totals as JSON on its last line.
"""
import json
import os
import sys
from collections import Counter

import torch.distributed as dist
from torch.distributed.fsdp._fully_shard import _fsdp_collectives

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_fsdp  # noqa: E402
from fsdp_gpt.config_parse import parse_args  # noqa: E402
from fsdp_gpt.distributed.launch import run_entry_point  # noqa: E402

GRADIENT_COLLECTIVES = ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce")
counts = Counter()


class CountingDist:
    def __getattr__(self, name):
        attr = getattr(dist, name)
        if name not in GRADIENT_COLLECTIVES:
            return attr

        def counted(*args, **kwargs):
            counts[name] += 1
            return attr(*args, **kwargs)
        return counted


def probe(argv: list[str]) -> None:
    train_fsdp.train(parse_args(argv))
    if dist.get_rank() == 0:
        print(json.dumps(counts))


_fsdp_collectives.dist = CountingDist()
run_entry_point(lambda: probe(sys.argv[1:]))

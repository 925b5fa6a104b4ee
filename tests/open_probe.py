"""Run under torchrun by test_checkpoints.py: the real trainer, with the sharded checkpoint rank
files each rank opens counted (every torch.load of a file named like one). Rank 0 prints every
rank's list of opened ranks as JSON on its last line, in one write."""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_fsdp  # noqa: E402
from fsdp_gpt.checkpoint.ckpt_format import SHARD_RE  # noqa: E402
from fsdp_gpt.config_parse import parse_args  # noqa: E402
from fsdp_gpt.distributed.launch import run_entry_point  # noqa: E402

opened = []
real_load = torch.load


def counting_load(f, *args, **kwargs):
    if isinstance(f, (str, os.PathLike)) and (match := SHARD_RE.search(os.path.basename(f))):
        opened.append(int(match.group(2)))
    return real_load(f, *args, **kwargs)


def probe(argv: list[str]) -> None:
    torch.load = counting_load
    train_fsdp.train(parse_args(argv))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, opened)
    if dist.get_rank() == 0:
        sys.stdout.write(json.dumps(everyone) + "\n")


run_entry_point(lambda: probe(sys.argv[1:]))

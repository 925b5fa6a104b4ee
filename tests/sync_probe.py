"""Run under torchrun by test_collectives.py: the real trainer, with device-to-host syncs counted per step.

A TorchFunctionMode sees every call of the tensor methods that make the host wait for the device
(`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, a tensor's truth value). A step runs from one call
of `lr_at` to the next, so its log, eval and save count with it. Rank 0 prints {step: syncs} as
JSON on its last line.
"""
import json
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_fsdp  # noqa: E402
from fsdp_gpt.config_parse import parse_args  # noqa: E402
from fsdp_gpt.distributed.launch import run_entry_point  # noqa: E402

SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__}
syncs = Counter()
current_step = [0]  # 0: start-up and the step-0 eval


class CountSyncs(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCS:
            syncs[current_step[0]] += 1
        return func(*args, **(kwargs or {}))


real_lr_at = train_fsdp.lr_at


def lr_at_marking_the_step(cfg, step):
    current_step[0] = step
    return real_lr_at(cfg, step)


def probe(argv: list[str]) -> None:
    train_fsdp.lr_at = lr_at_marking_the_step
    with CountSyncs():
        train_fsdp.train(parse_args(argv))
    if dist.get_rank() == 0:
        print(json.dumps({step: syncs[step] for step in range(1, current_step[0] + 1)}))


run_entry_point(lambda: probe(sys.argv[1:]))

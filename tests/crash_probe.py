"""Run under torchrun by test_checkpoints.py: the real trainer, with an unexpected error on the last
rank alone at the first eval after training starts, while the other ranks wait in its collectives."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_fsdp  # noqa: E402
from fsdp_gpt.config_parse import parse_args  # noqa: E402
from fsdp_gpt.distributed.launch import run_entry_point  # noqa: E402

real_evaluate = train_fsdp.evaluate
calls = []


def failing_evaluate(*args):
    calls.append(1)
    if len(calls) == 2:  # the step-0 eval passes; the next fails here alone
        raise KeyError("injected: a rank's own failure")
    return real_evaluate(*args)


if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
    train_fsdp.evaluate = failing_evaluate
run_entry_point(lambda: train_fsdp.train(parse_args(sys.argv[1:])))

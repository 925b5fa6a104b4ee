"""Run by test_observe.py: the real trainer with a test's disturbance injected into the batches.

LATE_RANK and LATE_SECONDS: that rank waits so long before each of its micro-batches (a slow disk).
SPIKE_STEP: at that step every rank's batch is random tokens (a finite loss spike: the model has
learnt the corpus, not noise). NO_WANDB=1: `import wandb` fails, as where it is not installed."""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_gpt.data import loader  # noqa: E402
import train_fsdp  # noqa: E402
from fsdp_gpt.config_parse import parse_args  # noqa: E402
from fsdp_gpt.distributed.launch import run_entry_point  # noqa: E402

real_micro_batches = loader.BatchLoader.micro_batches
LATE = int(os.environ.get("RANK", 0)) == int(os.environ.get("LATE_RANK", -1))
SPIKE_STEP = int(os.environ.get("SPIKE_STEP", 0))


def disturbed_micro_batches(self, step):
    for x, y, opens in real_micro_batches(self, step):
        if LATE:
            time.sleep(float(os.environ["LATE_SECONDS"]))
        if step == SPIKE_STEP:
            noise = torch.randint(0, 256, (x.shape[0], x.shape[1] + 1), generator=torch.Generator().manual_seed(step))
            x, y = noise[:, :-1].to(x.device), noise[:, 1:].to(y.device)
        yield x, y, opens


loader.BatchLoader.micro_batches = disturbed_micro_batches
if os.environ.get("NO_WANDB"):
    sys.modules["wandb"] = None  # what makes `import wandb` raise ImportError
run_entry_point(lambda: train_fsdp.train(parse_args(sys.argv[1:])))

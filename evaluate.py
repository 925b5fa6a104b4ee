"""Validation loss: the sums the trainer reduces at every eval, and a standalone evaluation.

python evaluate.py CHECKPOINT [--data_path PATH] [--eval_iters N] [--micro_batch M] [--dtype D]

val/loss is the mean next-token loss over the first eval_iters * train_batch windows of
block_size tokens of val.bin (fewer if val.bin is shorter): the same tokens at any world
size, computed in the run's compute dtype, so a checkpoint evaluated here matches what its
run logged at that step.
"""
import argparse
import math
import sys

import torch
import torch.nn.functional as F

from config import UserError, exit_code
from data import prepare_data
from loader import BatchLoader
from ckpt_format import load_gpt
from precision import DTYPES, autocast, compute_dtype, pick_device


@torch.no_grad()
def val_loss_sums(model, loader: BatchLoader, n_windows: int) -> torch.Tensor:
    """(sum of per-window mean losses, number of windows) over this rank's share, float64."""
    total = torch.zeros(2, dtype=torch.float64, device=loader.device)
    for x, y, weight in loader.val_batches(n_windows):
        logits, _ = model(x)
        per_window = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view_as(y).mean(1)
        total += torch.stack([(per_window * weight).sum(), weight.sum()]).double()
    return total


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a full file, any rank's file of a sharded set, or a folder")
    parser.add_argument("--data_path", help="a prepared dataset (default: the run's)")
    parser.add_argument("--eval_iters", type=int, help="default: the run's; windows = eval_iters * train_batch")
    parser.add_argument("--micro_batch", type=int, help="sequences per forward (default: the run's)")
    parser.add_argument("--dtype", choices=DTYPES, help="compute dtype (default: the run's)")
    args = parser.parse_args(argv)
    device = pick_device()
    model, ckpt = load_gpt(args.checkpoint, device)
    run = ckpt["config"]
    dtype = compute_dtype(args.dtype or run["dtype"], device)
    data_path = args.data_path or run["data_path"]
    meta = prepare_data(data_path, None, run["tokenizer"])
    if meta["tokenizer"] != run["tokenizer"]:
        raise UserError(f"the dataset was tokenized with '{meta['tokenizer']}', the model trained on "
                        f"'{run['tokenizer']}': evaluate on data prepared with '{run['tokenizer']}'")
    micro_batch = args.micro_batch or run["micro_batch"]
    loader = BatchLoader(data_path, meta, model.config.block_size,
                         micro_batch, micro_batch, 0, 1, run["seed"], device)  # one rank, val windows only
    n_windows = (args.eval_iters or run["eval_iters"]) * run["train_batch"]
    with autocast(dtype, device, fsdp=False):
        loss_sum, windows = val_loss_sums(model, loader, n_windows).tolist()
    loss = loss_sum / windows
    print(f"step {ckpt['step']} | val loss {loss:.6f} | perplexity {math.exp(loss):.3f} "
          f"| {int(windows)} windows of {model.config.block_size} tokens | {str(dtype).removeprefix('torch.')}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(lambda: main(sys.argv[1:])))

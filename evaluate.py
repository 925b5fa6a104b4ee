"""Validation loss: the sums the trainer reduces at every eval, and a standalone evaluation.

python evaluate.py CHECKPOINT [--data_path PATH] [--eval_iters N] [--micro_batch M] [--dtype D] [--doc_mask B]
python evaluate.py CHECKPOINT --mc FILE [FILE ...]     # multiple-choice acc and acc_norm (mc_eval.py)

val/loss is the mean next-token loss over the first eval_iters * train_batch windows of
block_size tokens of val.bin (fewer if val.bin is shorter): the same tokens at any world
size, computed in the run's compute dtype, so a checkpoint evaluated here matches what its
run logged at that step. A mixture's run: each source's val loss on its share of the windows,
and their mean weighted by data_weights (val/loss/{name} and val/loss in TensorBoard).
"""
import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F

from config import UserError, exit_code, named_paths
from data import prepare_sources
from loader import BatchLoader
from mc_eval import accuracies, load_sets, mc_sums, truncated
from mixture import Segment
from ckpt_format import load_gpt
from precision import DTYPES, autocast, compute_dtype, pick_device


@torch.no_grad()
def val_loss_sums(model, loader: BatchLoader, n_windows: int, doc_mask: bool = False) -> torch.Tensor:
    """(sources, 2), float64: each source's (sum of per-window mean losses, number of windows) over
    this rank's share. Under context parallelism a rank holds 1/cp_size of each window: its share of
    the window's mean and count is 1/cp_size of its slice's. doc_mask: attention stops at the data's
    separator, as the run trained."""
    total = torch.zeros(len(loader.names), 2, dtype=torch.float64, device=loader.device)
    for k, x, y, weight in loader.val_batches(n_windows):
        logits, _ = model(x, start=loader.start, separator=loader.separator if doc_mask else None)
        per_window = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view_as(y).mean(1)
        total[k] += torch.stack([(per_window * weight).sum(), weight.sum()]).double() / loader.cp_size
    return total


def val_losses(total: torch.Tensor, loader: BatchLoader) -> tuple[float, dict[str, float]]:
    """The val loss and each source's, from every rank's sums: a mixture's val loss is its sources'
    mean weighted by data_weights (a source of weight 0 is measured, not counted)."""
    each = {name: s / n for name, (s, n) in zip(loader.names, total.tolist())}
    weights = dict(zip(loader.names, loader.val_weights))
    return sum(weights[name] * loss for name, loss in each.items()) / sum(weights.values()), each


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a full file, any rank's file of a sharded set, or a folder")
    parser.add_argument("--data_path", help="a prepared dataset (default: the run's)")
    parser.add_argument("--eval_iters", type=int, help="default: the run's; windows = eval_iters * train_batch")
    parser.add_argument("--micro_batch", type=int, help="sequences per forward (default: the run's)")
    parser.add_argument("--dtype", choices=DTYPES, help="compute dtype (default: the run's)")
    parser.add_argument("--doc_mask", choices=("true", "false"), help="attention stops at the separator between "
                        "documents (default: the run's doc_mask)")
    parser.add_argument("--mc", nargs="+", metavar="FILE", help="multiple-choice files (HellaSwag jsonl, "
                        "{context, choices, label} jsonl, llm.c .bin): acc and acc_norm instead of val loss")
    args = parser.parse_args(argv)
    device = pick_device()
    model, ckpt = load_gpt(args.checkpoint, device)
    run = ckpt["config"]
    dtype = compute_dtype(args.dtype or run["dtype"], device)
    if args.mc:
        return multiple_choice(model, ckpt["step"], named_paths(args.mc), run["tokenizer"],
                               args.micro_batch or run["micro_batch"], dtype, device)
    mix = None if args.data_path else run.get("data_mix")  # the run's data, a mixture's sources each
    sources = prepare_sources(mix, args.data_path or run["data_path"], None, run["tokenizer"])
    for name, (path, meta) in sources.items():
        if meta["tokenizer"] != run["tokenizer"]:
            raise UserError(f"{path} was tokenized with '{meta['tokenizer']}', the model trained on "
                            f"'{run['tokenizer']}': evaluate on data prepared with '{run['tokenizer']}'")
    micro_batch = args.micro_batch or run["micro_batch"]
    segment = None if mix is None else Segment(0, run["data_weights"], {})
    loader = BatchLoader(sources, model.config.block_size, micro_batch, micro_batch, 0, 1, run["seed"], device,
                         segment)  # one rank, val windows only
    n_windows = (args.eval_iters or run["eval_iters"]) * run["train_batch"]
    with autocast(dtype, device, fsdp=False):
        doc_mask = run.get("doc_mask", False) if args.doc_mask is None else args.doc_mask == "true"
        total = val_loss_sums(model, loader, n_windows, doc_mask)
    loss, per_source = val_losses(total, loader)
    each = "".join(f" | {name} {value:.6f}" for name, value in per_source.items()) if mix else ""
    print(f"step {ckpt['step']} | val loss {loss:.6f} | perplexity {math.exp(loss):.3f}{each} "
          f"| {int(total[:, 1].sum())} windows of {model.config.block_size} tokens | {str(dtype).removeprefix('torch.')}")
    return 0


def multiple_choice(model, step: int, paths: dict[str, str], tokenizer: str, items_per_forward: int,
                    dtype: torch.dtype, device: torch.device) -> int:
    block_size = model.config.block_size
    for name, items in load_sets(paths, tokenizer, model.config.vocab_size).items():
        start = time.perf_counter()
        with autocast(dtype, device, fsdp=False):
            scores = accuracies(mc_sums(model, items, block_size, items_per_forward, 0, 1, device))
        print(f"step {step} | {name} | acc {scores['acc']:.4f} | acc_norm {scores['acc_norm']:.4f} | {len(items)} "
              f"items, {truncated(items, block_size)} truncated to block_size {block_size} | "
              f"{str(dtype).removeprefix('torch.')} | {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(lambda: main(sys.argv[1:])))

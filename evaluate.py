"""Validation loss (or multiple-choice accuracy) of a checkpoint, in one process (no torchrun).

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

from fsdp_gpt.checkpoint.ckpt_format import load_gpt
from fsdp_gpt.config import UserError, exit_code, named_paths
from fsdp_gpt.data.loader import BatchLoader
from fsdp_gpt.data.mixture import Segment
from fsdp_gpt.data.prepare import prepare_sources
from fsdp_gpt.distributed.precision import DTYPES, Chip, autocast, compute_dtype, pick_device
from fsdp_gpt.evaluation.mc_eval import accuracies, load_sets, mc_sums, truncated
from fsdp_gpt.evaluation.val_loss import val_loss_sums, val_losses


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint",
                        help="a full file, any rank's file of a sharded set or its .complete marker, or a folder")
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
    dtype = compute_dtype(args.dtype or run["dtype"], Chip.of(device))
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
    segment = None if mix is None else Segment(0, micro_batch, run["data_weights"], {})
    doc_mask = run.get("doc_mask", False) if args.doc_mask is None else args.doc_mask == "true"
    loader = BatchLoader(sources, model.config.block_size, micro_batch, micro_batch, 0, 1, run["seed"], device,
                         segment, doc_mask=doc_mask)  # one rank, val windows only
    n_windows = (args.eval_iters or run["eval_iters"]) * run["train_batch"]
    with autocast(dtype, device):
        total = val_loss_sums(model, loader, n_windows)
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
        with autocast(dtype, device):
            scores = accuracies(mc_sums(model, items, block_size, items_per_forward, 0, 1, device))
        print(f"step {step} | {name} | acc {scores['acc']:.4f} | acc_norm {scores['acc_norm']:.4f} | {len(items)} "
              f"items, {truncated(items, block_size)} truncated to block_size {block_size} | "
              f"{str(dtype).removeprefix('torch.')} | {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(lambda: main(sys.argv[1:])))

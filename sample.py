"""Sample text from a checkpoint, in one process (no torchrun), on GPU when there is one.

python sample.py CHECKPOINT [--prompt TEXT] [--max_new_tokens N] [--temperature T] [--top_k K] [--seed S]

CHECKPOINT: a full file, any rank's file of a sharded set or its .complete marker, or a folder (its newest complete
checkpoint). Text is encoded and decoded with the tokenizer the data was prepared with.
"""
import argparse
import sys

import torch

from fsdp_gpt.checkpoint.ckpt_format import load_gpt
from fsdp_gpt.config import exit_code
from fsdp_gpt.data.tokenizer import get_tokenizer
from fsdp_gpt.distributed.precision import Chip, autocast, compute_dtype, pick_device
from fsdp_gpt.evaluation.generate import complete


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--prompt", default="")
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top_k", type=int, default=200, help="0: no top-k cut")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    device = pick_device()
    model, ckpt = load_gpt(args.checkpoint, device)
    tokenizer = get_tokenizer(ckpt["config"]["tokenizer"])
    with autocast(compute_dtype(ckpt["config"]["dtype"], Chip.of(device)), device):  # as the run computed
        text = complete(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_k or None,
                        args.seed, device)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(lambda: main(sys.argv[1:])))

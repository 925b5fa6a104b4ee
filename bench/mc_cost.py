"""What a multiple-choice eval costs: time per 1,000 items, and its FLOPs against a training step.

    python bench/mc_cost.py CHECKPOINT [--items 1000] [--out bench/runs/mc_items.jsonl]

Writes HellaSwag-format items made offline from the installed numpy package's source (context:
two consecutive lines of code; the right ending: the line that follows; three wrong ones: lines
from elsewhere), scores them as evaluate.py --mc does, in one process, and prints the time per
1,000 items and the eval's FLOPs (its forwards over padded rows, counted as the model counts a
training step's: 2 per weight per token plus attention) against one training step of the run.
"""
import argparse
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import numpy  # noqa: E402
from torch import nn  # noqa: E402

from fsdp_gpt.checkpoint.ckpt_format import load_gpt  # noqa: E402
from fsdp_gpt.config import exit_code  # noqa: E402
from fsdp_gpt.evaluation.mc_eval import accuracies, groups, load_sets, mc_sums, row, truncated  # noqa: E402
from fsdp_gpt.distributed.precision import Chip, autocast, compute_dtype, pick_device  # noqa: E402


def write_items(path: str, n: int, seed: int = 0) -> None:
    """n items in HellaSwag's jsonl format (ctx, endings, label) from numpy's source lines."""
    lines = []
    for folder, _, files in sorted(os.walk(os.path.dirname(numpy.__file__))):
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                lines += [line.strip() for line in f if 20 <= len(line.strip()) <= 80]
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            at = rng.randrange(2, len(lines))
            endings = [lines[at]] + [rng.choice(lines) for _ in range(3)]
            label = rng.randrange(4)
            endings[0], endings[label] = endings[label], endings[0]
            f.write(json.dumps({"ctx": " ".join(lines[at - 2:at]), "endings": endings, "label": label}) + "\n")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a full file, any rank's file of a sharded set, or a folder")
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "runs", "mc_items.jsonl"))
    args = parser.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_items(args.out, args.items)
    device = pick_device()
    model, ckpt = load_gpt(args.checkpoint, device)
    run, cfg = ckpt["config"], model.config
    items = load_sets({"items": args.out}, run["tokenizer"], cfg.vocab_size)["items"]
    per_forward = run["micro_batch"]
    dtype = compute_dtype(run["dtype"], Chip.of(device))
    start = time.perf_counter()
    with autocast(dtype, device):
        scores = accuracies(mc_sums(model, items, cfg.block_size, per_forward, 0, 1, device))
    seconds = time.perf_counter() - start
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    flops = 0
    for group in groups(items, per_forward):
        rows = [row(item, choice, cfg.block_size)[0] for item in group for choice in item.choices]
        width = max(map(len, rows)) - 1
        flops += len(rows) * width * (2 * weights + 4 * cfg.n_layer * width * cfg.n_embd)
    step_flops = run["train_batch"] * cfg.block_size * model.flops_per_token()
    print(f"{len(items)} items ({truncated(items, cfg.block_size)} truncated to block_size {cfg.block_size}), "
          f"{per_forward} per forward, {str(dtype).removeprefix('torch.')} on {device.type}: "
          f"acc {scores['acc']:.4f} acc_norm {scores['acc_norm']:.4f}")
    print(f"{seconds / len(items) * 1000:.2f} s per 1,000 items | eval FLOPs {flops:.3g} = "
          f"{flops / step_flops:.3f} training steps ({step_flops:.3g} FLOPs each)")
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(lambda: main(sys.argv[1:])))

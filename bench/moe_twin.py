"""A mixture against its dense twin at equal active parameters: the trainer's tokens/s of gpt-oss's layout
with experts, and of the same layout with one dense MLP as wide as a token's experts together, in
alternating runs on this machine; the ratio pair by pair.

    python bench/moe_twin.py [--rounds 3] [--experts 8] [--top_k 2] [--width 256]

Both are bench/speed.py's trainer runs (4 layers, block 128, batch 16, fp32, byte tokens, one process)
with gpt-oss's attention: sinks, a window of 64 on every other layer, biases, grouped key/value heads
(4 over 2), YaRN. The mixture's experts are `width` wide (gpt-oss's ratio: intermediate_size =
hidden_size), top_k of them a token, with their biases, through torch._grouped_mm where it runs; the
twin's MLP is top_k x width wide with its biases, the same clamped SwiGLU. Their active parameters
are printed beside: equal but for the routers (experts x width) and the experts' biases. What the
ratio measures is the mixture's own cost: routing, the sort and gather of the tokens, the grouped
matmuls against one matmul, and the experts' weights' memory (idle experts' too, in AdamW's step).
"""
import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from speed import in_turn, shape, trainer_rate  # noqa: E402

from fsdp_gpt.model import GPT, GPTConfig  # noqa: E402

# (the trainer reads each value as YAML: the list and the dict as Python writes them)
ATTENTION = dict(arch="gpt_oss", n_kv_head=2, sliding_window=64, window_pattern=["local", "global"],
                 rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32))


def sides(experts: int, top_k: int, width: int) -> dict[str, dict]:
    """{side: its config keys}: the mixture, and the dense twin of the same active width."""
    return {"mixture": ATTENTION | dict(moe_experts=experts, moe_top_k=top_k, moe_hidden=width),
            "dense twin": ATTENTION | dict(ffn_hidden=top_k * width)}


def active(keys: dict, width: int) -> tuple[int, int]:
    """(the parameters a token uses, its training FLOPs) of a side's model."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, **shape(width), **keys))
    return model.num_params() - model.idle_expert_params(), model.flops_per_token()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top_k", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    runs = sides(args.experts, args.top_k, args.width)
    print(f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {os.cpu_count()} CPU cores; {args.experts} "
          f"experts of {args.width}, top {args.top_k}, against a dense MLP of {args.top_k * args.width}; "
          f"{args.width} wide, 4 layers")
    rates = {side: [] for side in runs}
    workdirs = {side: os.path.join(ROOT, "bench", "runs", "moe_twin", side) for side in runs}
    for workdir in workdirs.values():
        os.makedirs(workdir, exist_ok=True)
    for round_ in range(args.rounds):  # alternate: drifts of a shared machine hit both sides alike
        got = in_turn(*(lambda side=side: trainer_rate(1, workdirs[side], width=args.width, **runs[side]) for side in runs),
                      round_)
        for side, rate in zip(runs, got):
            rates[side].append(rate)
        print("  " + ", ".join(f"{side} {rate:,.0f} tok/s" for side, rate in zip(runs, got)), flush=True)
    pairs = statistics.median(a / b for a, b in zip(*rates.values()))
    print("| model | active parameters | FLOPs a token | tok/s (median) |\n| --- | --- | --- | --- |")
    for side, keys in runs.items():
        params, flops = active(keys, args.width)
        print(f"| {side} | {params:,} | {flops / 1e6:.1f}M | {statistics.median(rates[side]):,.0f} |")
    print(f"mixture / dense twin: {pairs:.3f} (median of {args.rounds} alternating pairs' ratios)")


if __name__ == "__main__":
    main()

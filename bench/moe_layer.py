"""The cost of routing and dispatch: tokens/s of an MoE MLP's forward and backward against the dense
SwiGLU MLP of the same active width, in one process, at the demo's size by default.

    python bench/moe_layer.py [--width 128] [--hidden 512] [--experts 8] [--top_k 2] [--tokens 2048]

The mixture's experts are hidden / top_k wide, so a token's routed experts compute what the dense
MLP computes. Rows: the dense MLP; the mixture through torch._grouped_mm (where it runs here); the
mixture with a matmul per expert (torch 2.8-2.12 on a CPU, odd widths, fp32 on a GPU). Each the
median of --repeats timed rounds after a warm-up; ratios against the dense MLP in the same run.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fsdp_gpt.moe as moe_module  # noqa: E402
from fsdp_gpt.model import ACTIVATIONS, MLP, GPTConfig  # noqa: E402


def tokens_per_second(layer: torch.nn.Module, x: torch.Tensor, repeats: int) -> float:
    grad = torch.randn_like(x)
    times = []
    for round_ in range(repeats + 1):  # the first round warms up
        start = time.perf_counter()
        layer(x).backward(grad)
        if round_:
            times.append(time.perf_counter() - start)
    return x.shape[0] * x.shape[1] / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512, help="the dense MLP's hidden width (the demo's llama)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top_k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig(arch="llama", n_embd=args.width, n_head=1, ffn_hidden=args.hidden, moe_experts=args.experts,
                    moe_top_k=args.top_k)
    dense = MLP(cfg)
    moe = moe_module.MoE(cfg, ACTIVATIONS["swiglu"])
    for p in moe.experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    torch.nn.init.zeros_(moe.expert_bias)
    x = torch.randn(1, args.tokens, args.width, requires_grad=True)
    grouped = moe_module.grouped_mm_runs(x, moe.experts.c_fc)
    rows = {"dense MLP": tokens_per_second(dense, x, args.repeats)}
    if grouped:
        rows["MoE, grouped matmul"] = tokens_per_second(moe, x, args.repeats)
    moe_module.grouped_mm_runs = lambda *a: False
    rows["MoE, a matmul per expert"] = tokens_per_second(moe, x, args.repeats)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.tokens} tokens x {args.width}; "
          f"dense hidden {args.hidden}; {args.experts} experts of {cfg.moe_hidden}, top {args.top_k}")
    print("| layer | tokens/s (forward + backward) | against dense |\n| --- | --- | --- |")
    for name, rate in rows.items():
        print(f"| {name} | {rate:,.0f} | {rate / rows['dense MLP']:.2f}x |")


if __name__ == "__main__":
    main()

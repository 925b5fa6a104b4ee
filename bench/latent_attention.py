"""What multi-head latent attention costs against grouped-query attention of the same width and heads:
one attention layer (its projections, RoPE and the core), forward and backward over one row, its
activation memory and tokens a second.

    python bench/latent_attention.py [--row 4096] [--width 512] [--heads 8] [--pairs 3]

Grouped-query attention: `--heads` heads of d = width / heads over a key/value head per four (Llama's
and Qwen's kind). MLA at DeepSeek-V2-Lite's proportions (2,048 wide, 16 heads of d = 128: a latent of
width / 4 = 512, q and k heads of d + d/2 turned by RoPE, v heads of d), at the same width and heads: one
q matrix (V2-Lite's, Moonlight's), and q through a low rank of width / 2 (DeepSeek V3's: 1,536 of
7,168, with 128 heads of 128 + 64). Each case in a process of its own
(bench/peak_step.py), the cases in turn, `--pairs` times: each line's figures are the medians, the
ratios the median of each round's ratio to grouped-query attention's. Peak: the process's peak RSS
during the timed steps minus its RSS before them (what the step's activations and gradients take).
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from peak_step import in_own_process, peak_and_time  # noqa: E402


def configs(args) -> dict:
    """name -> the model keys of its layer."""
    head = args.width // args.heads
    mla = dict(arch="deepseek_v3", kv_lora_rank=args.width // 4, qk_nope_head_dim=head, qk_rope_head_dim=head // 2,
               v_head_dim=head, moe_experts=0)
    return {"grouped-query": dict(arch="llama", n_kv_head=args.heads // 4),
            "MLA": mla,
            "MLA, q through a low rank": mla | dict(q_lora_rank=args.width // 2)}


def layer_of(args, name: str):
    """(the layer, its config)."""
    from fsdp_gpt.model import ATTENTIONS, GPTConfig
    cfg = GPTConfig(vocab_size=256, block_size=args.row, n_layer=1, n_head=args.heads, n_embd=args.width,
                    **configs(args)[name])
    return ATTENTIONS[cfg.family.attention](cfg, 0), cfg


def case(args, name: str) -> None:
    """In a fresh process: print 'peak_mb step_s' of one layer's forward and backward."""
    import torch
    from fsdp_gpt.rope import rotaries
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    layer, cfg = layer_of(args, name)
    x = torch.randn(1, args.row, args.width, requires_grad=True)
    rope = rotaries(cfg, torch.arange(args.row))[0]
    dout = torch.randn(1, args.row, args.width)

    def step():
        torch.autograd.grad(layer(x, rope), [x, *layer.parameters()], dout)
    print(peak_and_time(step, args.steps, False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", type=int, default=4096)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps a process (the median is its figure)")
    parser.add_argument("--pairs", type=int, default=3, help="rounds of every case in turn")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--case", nargs=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        return case(args, args.case[0])
    names = list(configs(args))
    figures = {name: [] for name in names}  # per round: (peak MB, step s)
    for _ in range(args.pairs):
        for name in names:
            figures[name].append(in_own_process(__file__, name))
    print(f"{time.strftime('%Y-%m-%d')}, cpu ({os.cpu_count()} cores, {args.threads} threads), fp32; one attention "
          f"layer, {args.width} wide, {args.heads} heads, one row of {args.row:,} tokens, forward and backward; medians of "
          f"{args.pairs} rounds, the ratios each round's")
    print("| attention | parameters | activation peak MB | tokens/s | peak / grouped-query's | tokens/s / grouped-query's |")
    print("| --- | --- | --- | --- | --- | --- |")
    base = figures[names[0]]
    for name in names:
        peaks, times = zip(*figures[name])
        peak_ratio = statistics.median(p / b[0] for p, b in zip(peaks, base))
        speed_ratio = statistics.median(b[1] / t for t, b in zip(times, base))
        parameters = sum(p.numel() for p in layer_of(args, name)[0].parameters())
        print(f"| {name} | {parameters:,} | {statistics.median(peaks):.1f} | {args.row / statistics.median(times):,.0f} | "
              f"{peak_ratio:.2f} | {speed_ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()

"""What a sliding window buys: attention's time and peak memory as the row grows, full causal
against a fixed window, forward and backward of the attention core alone.

    python bench/window.py [--lengths 4096 8192 16384] [--window 512] [--steps 3]
    python bench/window.py --device cuda --dtype bfloat16 --heads 16 --lengths 8192 16384 32768

One row, `--heads` heads of 64 (grouped-query: a key/value head per two), each case in a process of
its own (glibc returns large blocks on free: MALLOC_MMAP_THRESHOLD_). Peak: on CPU the process's
peak RSS during the timed steps minus its RSS before them, on CUDA the peak allocated minus the
allocated before. Step time: the median of --steps steps after one untimed. The last columns divide
each figure by the row half as long's: 2 for linear growth, 4 for quadratic.
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from peak_step import in_own_process, peak_and_time  # noqa: E402


def case(args, T: int, window: int | None) -> None:
    """In a fresh process: print 'peak_mb step_s' of one case."""
    import torch
    from fsdp_gpt.attention import causal_attention
    torch.manual_seed(0)
    device, cuda, dtype = torch.device(args.device), args.device == "cuda", getattr(torch, args.dtype)
    q, k, v = (torch.randn(1, heads, T, 64, device=device, dtype=dtype, requires_grad=True)
               for heads in (args.heads, args.heads // 2, args.heads // 2))
    dout = torch.randn(1, args.heads, T, 64, device=device, dtype=dtype)

    def step():
        out = causal_attention(q, k, v, 0.0, True, window=window)
        torch.autograd.grad(out, (q, k, v), dout)
        if cuda:
            torch.cuda.synchronize()
    print(peak_and_time(step, args.steps, cuda))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--case", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        T, window = args.case
        return case(args, int(T), None if window == "None" else int(window))
    print(f"{time.strftime('%Y-%m-%d')}, {args.device} ({os.cpu_count()} cores), {args.dtype}; attention alone, one row, "
          f"{args.heads} heads of 64 over {args.heads // 2} key/value heads, forward and backward")
    print("| row tokens | attention | peak MB | step s | peak / the half row's | time / the half row's |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, window in (("full causal", None), (f"window {args.window}", args.window)):
        last = None
        for T in args.lengths:
            peak, seconds = in_own_process(__file__, str(T), str(window))
            growth = f"{peak / last[0]:.2f} | {seconds / last[1]:.2f}" if last else " | "
            print(f"| {T:,} | {name} | {peak:.1f} | {seconds:.4f} | {growth} |", flush=True)
            last = (peak, seconds)


if __name__ == "__main__":
    main()

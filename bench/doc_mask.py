"""doc_mask's cost: one process, one layer, long rows; peak memory and step time against no mask.

    python bench/doc_mask.py [--lengths 8192 16384] [--steps 3]
    python bench/doc_mask.py --device cuda --n_embd 1024 --n_head 16 --lengths 16384 32768   # a GPU, bf16

Each case runs in a process of its own (glibc returns large blocks on free: MALLOC_MMAP_THRESHOLD_),
a GPT of one layer, byte tokens, one row a step, forward and backward (on CPU in fp32, on CUDA under
bf16 autocast). Peak: on CPU the process's peak RSS during the timed steps minus its RSS before them,
on CUDA the peak allocated minus the allocated before (the step's activations and gradients; the
interpreter, torch and the weights are the same in every case). Step time: the median of --steps
steps after one untimed. Cases: no mask; doc_mask with the row one document; doc_mask with
documents of 2,048 and of 256 tokens (a separator every so many tokens).
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from peak_step import in_own_process, peak_and_time  # noqa: E402

CASES = {"no mask": None, "doc_mask, one document a row": 0, "doc_mask, documents of 2,048": 2048,
         "doc_mask, documents of 256": 256}


def case(args, T: int, spacing: int | None) -> None:
    """In a fresh process: print 'peak_mb step_s' of one case."""
    import torch
    from fsdp_gpt.model import GPT, GPTConfig
    torch.manual_seed(0)
    device, cuda = torch.device(args.device), args.device == "cuda"
    model = GPT(GPTConfig(vocab_size=256, block_size=T, n_layer=1, n_head=args.n_head, n_embd=args.n_embd)).to(device)
    x = torch.randint(1, 256, (1, T))
    if spacing:
        x[:, ::spacing] = 0  # separators: a document opens every `spacing` tokens
    opens = None if spacing is None else x == 0  # on the host, as the loader hands them
    x = x.to(device)

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, torch.bfloat16, enabled=cuda):
            loss = model(x, x, opens=opens)[1]
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
    print(peak_and_time(step, args.steps, cuda))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--n_embd", type=int, default=64)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--case", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        T, spacing = args.case
        return case(args, int(T), None if spacing == "None" else int(spacing))
    where = f"{os.cpu_count()} CPU cores, fp32" if args.device == "cpu" else "CUDA, bf16 autocast"
    print(f"{time.strftime('%Y-%m-%d')}, {where}; one layer, {args.n_embd} wide, {args.n_head} heads, one row a step")
    print("| row tokens | case | peak MB above the step's start | of no mask's | step s | of no mask's |")
    print("| --- | --- | --- | --- | --- | --- |")
    for T in args.lengths:
        base = None
        for name, spacing in CASES.items():
            peak, seconds = in_own_process(__file__, str(T), str(spacing))
            base = base or (peak, seconds)
            print(f"| {T:,} | {name} | {peak:.1f} | {peak / base[0]:.2f} | {seconds:.4f} | {seconds / base[1]:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()

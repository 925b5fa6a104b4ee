"""Does compiling take FSDP2's fixed cost away? One process, fixed_cost's model (bench/speed.py: 12
blocks of 32 wide, a 32-token row a micro-step, 2 micro-steps a step, fp32), FSDP2 (the whole model
one unit, as auto lays it out) against the unwrapped model, each way of compiling alike on both:

    python bench/fsdp_compile.py [--rounds 2] [--steps 100]

eager; the trainer's compile (each block alone, FSDP2's hooks between them: compile: true); the whole
model compiled with compiled autograd, the way FSDP2's hooks were once traced into the graphs. Each
(layout, way) runs in a process of its own, the order rotated each round; ms a step is the median of
--steps steps after 5 of warm-up, the ratio FSDP2's speed over the unwrapped model's, round by round.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
WAYS = ("eager", "per block (compile: true)", "whole model, compiled autograd")


def step_ms(fsdp: bool, way: str, steps: int) -> float:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdp_gpt.distributed.parallelize import compile_model
    from fsdp_gpt.model import GPT, GPTConfig
    from fsdp_gpt.optim.build import AdamWOnShards
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=12, n_head=2, n_embd=32, block_size=32, vocab_size=256, dropout=0.0))
    if way == WAYS[1]:
        compile_model(model, "default")
    if fsdp:
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    optimizer = AdamWOnShards(model.parameters(), lr=1e-4, fused=True)
    forward = model
    if way == WAYS[2]:
        torch._dynamo.config.compiled_autograd = True
        forward = torch.compile(model)
    x, y = torch.randint(0, 256, (1, 32)), torch.randint(0, 256, (1, 32))

    def one_step():
        for micro_step in range(2):
            if fsdp:  # one reduction a step, the whole model gathered through it (as the trainer does)
                model.set_requires_gradient_sync(micro_step == 1, recurse=False)
                model.set_reshard_after_backward(micro_step == 1, recurse=False)
            (forward(x, y)[1] / 2).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(5):
        one_step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--_one", nargs=2, help=argparse.SUPPRESS)  # a child: layout, way
    args = parser.parse_args()
    if args._one:
        print(step_ms(args._one[0] == "fsdp", args._one[1], args.steps))
        return
    runs = [(layout, way) for way in WAYS for layout in ("unwrapped", "fsdp")]
    ms = {run: [] for run in runs}
    for round_ in range(args.rounds):
        for layout, way in runs[round_ % len(runs):] + runs[:round_ % len(runs)]:
            out = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--_one", layout, way],
                                 capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"failed: {layout}, {way}\n{out.stderr[-2000:]}")
            ms[layout, way].append(float(out.stdout.split()[-1]))
    print(f"torch {torch.__version__}; dynamo can trace FSDP2's hooks: "
          f"{'yes' if hasattr(torch._dynamo.config, 'skip_fsdp_hooks') else 'no (they run under torch._dynamo.disable)'}")
    print("| compiled | unwrapped, ms a step | FSDP2, ms a step | FSDP2 / unwrapped, speed |\n| --- | --- | --- | --- |")
    for way in WAYS:
        plain, wrapped = ms["unwrapped", way], ms["fsdp", way]
        ratio = statistics.median(p / w for p, w in zip(plain, wrapped))
        print(f"| {way} | {statistics.median(plain):.1f} | {statistics.median(wrapped):.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()

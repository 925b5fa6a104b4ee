"""FSDP2's fixed cost in one process, by alternating steps: fixed_cost's model (bench/speed.py: 12
blocks of 32 wide, a 32-token row a micro-step, 2 micro-steps a step, fp32, one thread) unwrapped,
wrapped as `force_fsdp` wraps it under FULL_SHARD and under SHARD_GRAD_OP (the vectors left whole:
distributed/replicated.py), and under FULL_SHARD with every parameter sharded (as before
2026-11-29), a step of each in turn:

    python bench/fsdp_steps.py [--steps 400]

Each model is built by the trainer's build_model, with its optimizer, micro-step settings, forward
context and clipping. Steadier than whole runs on a noisy machine: a drift in its speed reaches the
three alike. Prints each one's forward and backward, clipping and optimizer, ms a step (medians
after 20 steps), and the wrapped steps' speed against the unwrapped one's, the median of the ratios
step by step.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from fsdp_gpt.config_parse import parse_args  # noqa: E402
from fsdp_gpt.distributed import parallelize  # noqa: E402
from fsdp_gpt.distributed.launch import Topology  # noqa: E402
from fsdp_gpt.model import GPTConfig  # noqa: E402
from fsdp_gpt.optim.build import build_optimizer  # noqa: E402
from fsdp_gpt.optim.clip import clip_gradients  # noqa: E402

MODEL = ["--n_layer=12", "--n_head=2", "--n_embd=32", "--block_size=32", "--micro_batch=1", "--train_batch=2",
         "--dtype=fp32", "--compile=false", "--vocab_size=256"]
# each layout's sharding_strategy (None: unwrapped)
LAYOUTS = {"unwrapped": None, "FULL_SHARD, vectors whole": "FULL_SHARD",
           "SHARD_GRAD_OP, vectors whole": "SHARD_GRAD_OP", "FULL_SHARD, every parameter sharded": "FULL_SHARD"}


def build(layout: str):
    """(model, optimizer, set_micro_step, forward context) of one layout."""
    strategy = LAYOUTS[layout]
    wrap = "fsdp" if strategy else "none"
    cfg = parse_args([os.path.join(ROOT, "config", "demo_cpu.yaml"), *MODEL, f"--force_fsdp={strategy is not None}",
                      *([f"--sharding_strategy={strategy}"] if strategy else [])])
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",)) if wrap == "fsdp" else None
    topo = Topology(0, 1, 0, 1, torch.device("cpu"), wrap, mesh)
    whole = parallelize.replicated_params
    if layout.endswith("every parameter sharded"):  # fp32: no autocast either way, only what FSDP2 shards differs
        parallelize.replicated_params = lambda *args: set()
    model = parallelize.build_model(cfg, GPTConfig(**cfg.model_config), topo)
    parallelize.replicated_params = whole
    return (model, build_optimizer(cfg, model, topo.device), parallelize.micro_steps(cfg, model),
            parallelize.forward_context(cfg, topo))


def timed_step(model, optimizer, set_micro_step, compute, x) -> tuple[float, float]:
    start = time.perf_counter()
    for micro_step in range(2):
        set_micro_step(model, micro_step == 1)
        with compute():
            _, loss = model(x, x)
        (loss / 2).backward()
    middle = time.perf_counter()
    clip_gradients(model, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return middle - start, time.perf_counter() - middle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    runs = {layout: build(layout) for layout in LAYOUTS}
    x = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    times = {layout: [] for layout in LAYOUTS}
    for step in range(args.steps):
        for layout, run in runs.items():
            if (result := timed_step(*run, x)) and step >= 20:
                times[layout].append(result)
    print(f"torch {torch.__version__}, one process, {args.steps - 20} steps each\n"
          "| layout | forward + backward, ms | clipping + optimizer, ms | speed / unwrapped |\n| --- | --- | --- | --- |")
    for layout in LAYOUTS:
        ratio = statistics.median(sum(a) / sum(b) for a, b in zip(times["unwrapped"], times[layout]))
        print(f"| {layout} | {1e3 * statistics.median(t[0] for t in times[layout]):.1f} | "
              f"{1e3 * statistics.median(t[1] for t in times[layout]):.1f} | {ratio:.3f}x |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Checkpoint cost: the training stall per save (sync vs async_save) and save/load throughput
against a plain torch.save/torch.load of the same tensors. One process, CPU or GPU.

    python bench/checkpoint_bench.py [--n_layer=8 --n_embd=512 ...]   # any config override
"""
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_gpt.config_parse import parse_args  # noqa: E402
from fsdp_gpt.checkpoint.fsdp_ckpt import CheckpointManager  # noqa: E402
from fsdp_gpt.model import GPTConfig  # noqa: E402
from fsdp_gpt.distributed.launch import init_distributed, run_entry_point  # noqa: E402
from fsdp_gpt.distributed.parallelize import build_model  # noqa: E402
from fsdp_gpt.distributed.shards import full_tensor  # noqa: E402
from fsdp_gpt.optim.build import build_optimizer  # noqa: E402

REPEATS = 3


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv):
    demo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config", "demo_cpu.yaml")
    cfg = parse_args([demo, "--n_layer=8", "--n_embd=512", "--n_head=8", "--vocab_size=256", "--dtype=fp32"] + argv)
    topo = init_distributed(cfg)
    model = build_model(cfg, GPTConfig(**cfg.model_config), topo)
    optimizer = build_optimizer(cfg, model, topo.device)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), device=topo.device)
    model(x, x)[1].backward()
    optimizer.step()  # optimizer state exists: a checkpoint's real size
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {n_params / 1e6:.1f}M parameters, checkpoint ~{3 * n_params * 4 / 1e6:.0f} MB (fp32 weights + 2 moments)")
    print(f"{'format':<8} {'mode':<6} {'stall/save s':>12} {'save MB/s':>10} {'load MB/s':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("full", "sharded"):
            for async_save in (False, True):
                cfg.checkpoint_type, cfg.async_save, cfg.checkpoint_dir = kind, async_save, os.path.join(tmp, kind)
                manager = CheckpointManager(cfg, topo)
                stalls, totals = [], []
                for step in range(1, REPEATS + 1):
                    stall = timed(lambda: manager.save(step, model, optimizer))
                    totals.append(stall + timed(manager.wait))
                    stalls.append(stall)
                size = sum(os.path.getsize(os.path.join(cfg.checkpoint_dir, n)) for n in os.listdir(cfg.checkpoint_dir)) / REPEATS
                name = "fsdp_cpt1.pth" if kind == "full" else "fsdp_sharded_cpt1_rank0.pth"
                load = statistics.median(timed(lambda: manager.resume(os.path.join(cfg.checkpoint_dir, name),
                                                                      model, optimizer)) for _ in range(REPEATS))
                print(f"{kind:<8} {'async' if async_save else 'sync':<6} {statistics.median(stalls):>12.3f} "
                      f"{size / 1e6 / statistics.median(totals):>10.0f} {size / 1e6 / load:>10.0f}")
        # the baseline: the same tensors, plain torch.save / torch.load
        plain = {"model": {k: full_tensor(v) for k, v in model.state_dict().items()},
                 "optimizer": {i: {k: full_tensor(v) for k, v in s.items()}
                               for i, s in enumerate(optimizer.state.values())}}
        path = os.path.join(tmp, "plain.pth")
        save = statistics.median(timed(lambda: torch.save(plain, path)) for _ in range(REPEATS))
        load = statistics.median(timed(lambda: torch.load(path, weights_only=True)) for _ in range(REPEATS))
        size = os.path.getsize(path)
        print(f"{'plain':<8} {'sync':<6} {save:>12.3f} {size / 1e6 / save:>10.0f} {size / 1e6 / load:>10.0f}")


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv):
        sys.exit(print(__doc__))
    run_entry_point(lambda: main(sys.argv[1:]))

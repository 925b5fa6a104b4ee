"""The smallest run that can abort at exit, ended three ways (launched by exit_bench.py --endings).

    torchrun --nproc_per_node=2 bench/exit_probe.py ENDING      # ENDING: none | destroy | entry_point

It builds the sharded tiny model and runs a few all-reduces on a tensor Python still holds,
then ends:
  none         returns to the interpreter as it is (the tests' probes before launch.py)
  destroy      barrier + destroy_process_group, then a normal interpreter exit (the trainer before)
  entry_point  launch.run_entry_point (what every entry point does now)
"""
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from fsdp_gpt.config_parse import parse_args  # noqa: E402
from fsdp_gpt.distributed.launch import init_distributed, run_entry_point  # noqa: E402
from fsdp_gpt.model import GPTConfig  # noqa: E402
from fsdp_gpt.distributed.parallelize import build_model  # noqa: E402

TINY = [os.path.join(ROOT, "config", "demo_cpu.yaml"), "--n_layer=2", "--n_head=2", "--n_embd=64",
        "--block_size=32", "--vocab_size=256"]


def body() -> None:
    cfg = parse_args(TINY)
    topo = init_distributed(cfg)
    build_model(cfg, GPTConfig(**cfg.model_config), topo)
    flag = torch.ones(4)
    for _ in range(5):
        dist.all_reduce(flag)


def main(ending: str) -> None:
    if ending == "entry_point":
        run_entry_point(body)
    body()
    if ending == "destroy":
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

"""Run under torchrun by test_init.py: build the sharded model and report what each rank held."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_gpt import model as model_module  # noqa: E402
from fsdp_gpt.config_parse import parse_args  # noqa: E402
from fsdp_gpt.checkpoint.ckpt_format import FULL_OPTIONS  # noqa: E402
from fsdp_gpt.distributed.shards import local_slice  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_model_state_dict  # noqa: E402
from fsdp_gpt.distributed.launch import init_distributed, run_entry_point  # noqa: E402
from fsdp_gpt.distributed.parallelize import build_model  # noqa: E402

materialised = []  # parameter counts of every whole model this rank initialised
real_init = model_module.GPT.init_weights


def spy(self):
    materialised.append(sum(p.numel() for p in self.parameters()))
    real_init(self)


model_module.GPT.init_weights = spy


def probe(out_dir: str, argv: list[str]) -> None:
    cfg = parse_args(argv)
    topo = init_distributed(cfg)
    gpt = build_model(cfg, model_module.GPTConfig(**cfg.model_config), topo)
    local = sum(local_slice(p)[0].numel() for p in gpt.parameters())
    full = get_model_state_dict(gpt, options=FULL_OPTIONS)
    if topo.is_main:
        torch.save(full, os.path.join(out_dir, f"weights_world{topo.world_size}.pt"))
    with open(os.path.join(out_dir, f"world{topo.world_size}_rank{topo.rank}.json"), "w") as f:
        json.dump({"materialised": materialised, "local": local, "total": sum(p.numel() for p in gpt.parameters())}, f)


run_entry_point(lambda: probe(sys.argv[1], sys.argv[2:]))

"""Run under torchrun by test_fp16.py: fp16 with gradient scaling, an overflow on one rank only."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_gpt.config_parse import parse_args  # noqa: E402
from fsdp_gpt.model import GPTConfig  # noqa: E402
from fsdp_gpt.distributed.launch import init_distributed, run_entry_point  # noqa: E402
from fsdp_gpt.distributed.parallelize import build_model, forward_context  # noqa: E402
from fsdp_gpt.distributed.replicated import gradient_reduction  # noqa: E402
from fsdp_gpt.distributed.shards import local_part  # noqa: E402
from fsdp_gpt.optim.build import build_optimizer  # noqa: E402


def probe(argv: list[str]) -> None:
    cfg = parse_args(argv + ["--dtype=fp16"])
    topo = init_distributed(cfg)
    model = build_model(cfg, GPTConfig(**cfg.model_config), topo)
    optimizer = build_optimizer(cfg, model, topo.device)
    scaler = torch.amp.GradScaler(topo.device.type)  # as the trainer makes it for fp16
    compute, reduce_whole_grads = forward_context(cfg, topo), gradient_reduction(model, topo)  # as the trainer
    report = []
    for overflow_on_rank0 in (True, False):
        x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=torch.Generator().manual_seed(0))
        with compute():
            loss = model(x, x)[1]
        scaler.scale(loss).backward()
        reduce_whole_grads()
        if overflow_on_rank0 and topo.rank == 0:
            model.blocks[0].mlp.c_fc.weight.grad.to_local()[0, 0] = float("inf")  # in rank 0's shard only
        before = [local_part(p.detach()).clone() for p in model.parameters()]
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        stepped = any(not torch.equal(b, local_part(p.detach())) for b, p in zip(before, model.parameters()))
        report.append({"stepped": stepped, "scale": scaler.get_scale()})
    # one write: both ranks share the pipe, and print's separate write of the newline (unbuffered,
    # as the tests run) let the two lines interleave into one
    sys.stdout.write(json.dumps({"rank": topo.rank, "steps": report}) + "\n")
    sys.stdout.flush()


run_entry_point(lambda: probe(sys.argv[1:]))

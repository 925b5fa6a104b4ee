"""Run under torchrun by test_moe.py: a mixture-of-experts model with its experts split over every
rank (expert_parallel.py, no FSDP) against the same model whole on one rank, on the same batch.

Each rank computes its share of the rows; the reference computes all of them. Rank 0 prints, per
routing case, the largest differences of the loss, the outputs and every gradient as JSON. Cases:
the router as trained; a selection bias that sends every token to expert 0 (top 1): every other
rank receives no row; every token to the last two experts: rank 0 receives none, and sends all.
"""
import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_gpt.distributed.expert_parallel import apply_expert_parallel  # noqa: E402
from fsdp_gpt.distributed.launch import run_entry_point  # noqa: E402
from fsdp_gpt.model import GPT, GPTConfig  # noqa: E402

CASES = {"routed": (2, None), "all to expert 0": (1, 0), "all to the last two": (2, -2)}


def model_for(top_k: int, favoured: int | None, experts: int) -> GPT:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(arch="llama", vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, moe_experts=experts,
                        moe_top_k=top_k, moe_shared=1))
    if favoured is not None:
        with torch.no_grad():
            for moe in gpt.moe_layers():
                moe.expert_bias[favoured:None if favoured < 0 else favoured + 1] = 100.0  # selection only
    return gpt


def grads(gpt: GPT, world: int, ep: bool) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as the whole batch's mean would give it."""
    out = {}
    for name, p in gpt.named_parameters():
        if p.grad is None:
            continue
        if ep and ".experts." in name:  # my experts' rows: every rank's tokens summed already
            out[name] = p.grad.to_local() / world
        else:
            g = p.grad.clone()
            if ep:
                dist.all_reduce(g)
                g /= world
            out[name] = g
    return out


def probe() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    experts = 2 * world
    x = torch.randint(0, 64, (2 * world, 16), generator=torch.Generator().manual_seed(1))
    y = (x + 1) % 64
    report = {}
    for case, (top_k, favoured) in CASES.items():
        whole = model_for(top_k, favoured, experts)
        split = copy.deepcopy(whole)
        apply_expert_parallel(split, mesh)
        mine = slice(2 * rank, 2 * rank + 2)
        with torch.no_grad():  # in eval mode: no routing figures recorded
            logits, my_logits = whole.eval()(x)[0], split.eval()(x[mine])[0]
        _, loss = whole.train()(x, y)
        loss.backward()
        _, my_loss = split.train()(x[mine], y[mine])
        my_loss.backward()
        total = my_loss.detach().clone()
        dist.all_reduce(total)
        expected, got = grads(whole, world, ep=False), grads(split, world, ep=True)
        per_expert = experts // world
        for name in expected:
            if ".experts." in name:
                expected[name] = expected[name][rank * per_expert:(rank + 1) * per_expert]
        diffs = {"loss": abs(total.item() / world - loss.item()),
                 "logits": (my_logits - logits[mine]).abs().max().item()}
        diffs |= {name: (got[name] - expected[name]).abs().max().item() for name in expected}
        routed = split.blocks[0].mlp.pending  # (experts + 2): this rank's tokens per expert, then two figures
        gathered = [None] * world
        dist.all_gather_object(gathered, diffs)
        report[case] = {"largest": max(max(d.values()) for d in gathered), "scale": loss.item(),
                        "counts": routed[:experts].tolist()}
    if rank == 0:
        print(json.dumps(report))
    dist.barrier()


run_entry_point(probe)

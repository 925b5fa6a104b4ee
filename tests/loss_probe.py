"""Run on 1 or 2 ranks by test_loss.py: the model as the trainer builds it (FSDP2 where wrapped,
context parallelism, compile, from the same --key=value arguments), one forward and backward with
the chunked loss (model(x, y)) and one with the whole logits and F.cross_entropy in fp32 (the
computation before loss.py) on the same micro-batch. Rank 0 prints, as JSON, the loss's relative
difference and each gradient's largest difference relative to its largest entry, over every rank.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_gpt import loss  # noqa: E402
from fsdp_gpt.config_parse import parse_args  # noqa: E402
from fsdp_gpt.distributed.context_parallel import row_positions  # noqa: E402
from fsdp_gpt.distributed.launch import init_distributed, run_entry_point  # noqa: E402
from fsdp_gpt.distributed.parallelize import build_model, forward_context  # noqa: E402
from fsdp_gpt.distributed.shards import full_tensor  # noqa: E402
from fsdp_gpt.model import GPTConfig  # noqa: E402


def whole_logits_loss(model, gpt, x, y, positions=None):
    """The loss as it was computed before loss.py: (B, T, vocab) logits, then cross-entropy in fp32
    (model: gpt, or its wrapper)."""
    logits, _ = model(x, positions=positions)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    if gpt.config.moe_aux_loss:
        balancing = gpt.config.moe_aux_loss * torch.stack([m.aux_loss for m in gpt.moe_layers()]).mean()
        loss = loss + (balancing - balancing.detach())
    return loss


def gradients(model, compute, loss_of) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with compute():
        loss = loss_of()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    full = {name: full_tensor(p.grad).float()
            for name, p in model.named_parameters() if p.grad is not None}
    return total.item(), full


def probe(argv: list[str]) -> None:
    cfg = parse_args(argv)
    loss.CHUNK_ELEMENTS["cpu"] = 8 * cfg.vocab_size  # chunks of 8 rows: several per micro-batch
    topo = init_distributed(cfg)
    model = build_model(cfg, GPTConfig(**cfg.model_config, moe_aux_loss=cfg.moe_aux_loss), topo)
    gpt = getattr(model, "module", model)
    compute = forward_context(cfg, topo)
    rows = torch.randint(0, cfg.vocab_size, (cfg.micro_batch * topo.dp_size, cfg.block_size + 1),
                         generator=torch.Generator().manual_seed(3))[topo.dp_rank::topo.dp_size]
    positions = row_positions(cfg.cp_mode, topo.cp_rank, topo.cp_size, cfg.block_size)
    x, y = rows[:, positions], rows[:, positions + 1]
    chunked, ours = gradients(model, compute, lambda: model(x, y, positions=positions)[1])
    whole, theirs = gradients(model, compute, lambda: whole_logits_loss(model, gpt, x, y, positions))
    report = {"loss": abs(chunked - whole) / abs(whole), "same gradients": sorted(ours) == sorted(theirs),
              "chunks": loss.chunk_count(x.numel(), cfg.vocab_size, "cpu")}
    report |= {name: ((ours[name] - theirs[name]).abs().max() / theirs[name].abs().max()).item() for name in theirs}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if topo.is_main:
        print(json.dumps({key: max(r[key] for r in gathered) for key in report}))


if __name__ == "__main__":  # (test_loss.py imports the reference above)
    run_entry_point(lambda: probe(sys.argv[1:]))

"""The optimizer a config names: AdamW, or Muon for the blocks' matrices beside AdamW for the rest."""
import torch

from fsdp_gpt.distributed.shards import local_part
from fsdp_gpt.model import GPT
from fsdp_gpt.moe import per_expert_dims
from fsdp_gpt.optim.muon import MuonWithAdamW, is_muon_matrix


def parameter_groups(gpt: GPT) -> tuple[dict, dict]:
    """{name: parameter} with weight decay (matmul and embedding weights), and without (biases,
    norms' weights, value_mix, attention sinks: every 1-D parameter, and a mixture's experts' biases, a
    vector an expert). Parameters without gradients (the experts' selection bias, moved by the loop)
    are no optimizer's."""
    decay, no_decay = {}, {}
    for name, p in gpt.named_parameters():
        if p.requires_grad:
            (no_decay if per_expert_dims(name, p.shape) < 2 else decay)[name] = p
    return decay, no_decay


class AdamWOnShards(torch.optim.AdamW):
    """torch's fused AdamW, its kernel handed each DTensor's local shard. The same arithmetic (AdamW
    is elementwise: DTensor would run it on the local shards too), the same state, still DTensors
    for checkpoints and resharding, without DTensor's dispatch of the kernel's six lists: 2 ms a step
    at 148 parameters on a CPU, FSDP's fixed cost (docs/sharding.md). Plain tensors pass as they are."""

    def _init_group(self, group, *lists):
        collected = [[] for _ in lists]  # params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps
        has_complex = super()._init_group(group, *collected)
        for into, tensors in zip(lists, collected):
            into.extend(local_part(t) for t in tensors)
        return has_complex


def adamw_optimizer(cfg, gpt: GPT, device: torch.device) -> torch.optim.AdamW:
    decay, no_decay = parameter_groups(gpt)
    # fused: one kernel over all parameters, on GPU and CPU alike
    return AdamWOnShards([{"params": list(decay.values()), "weight_decay": cfg.weight_decay},
                          {"params": list(no_decay.values()), "weight_decay": 0.0}],
                         lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=True)


def muon_optimizer(cfg, gpt: GPT, device: torch.device) -> MuonWithAdamW:
    """Muon for the blocks' 2-D weights; AdamW for embeddings, LM head, LayerNorms and biases."""
    decay, no_decay = parameter_groups(gpt)
    matrices = {name: p for name, p in decay.items() if is_muon_matrix(name, p.shape)}
    adamw = dict(muon=False, betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=True)
    return MuonWithAdamW([
        dict(params=list(matrices.values()), muon=True, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum),
        dict(params=[p for name, p in decay.items() if name not in matrices], weight_decay=cfg.weight_decay, **adamw),
        dict(params=list(no_decay.values()), weight_decay=0.0, **adamw)], lr=cfg.learning_rate, device=device,
        coefficients=cfg.muon_coefficients, cautious=cfg.cautious_weight_decay,
        normuon=cfg.beta2 if cfg.normuon else None)


OPTIMIZERS = {"adamw": adamw_optimizer, "muon": muon_optimizer}


def build_optimizer(cfg, gpt: GPT, device: torch.device) -> torch.optim.Optimizer:
    return OPTIMIZERS[cfg.optimizer](cfg, gpt, device)

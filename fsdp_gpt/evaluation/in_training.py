"""The eval a run does every eval_interval steps, on every rank: val loss, each multiple-choice
set's accuracy and a text sample, in the context training's forwards run in."""
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from fsdp_gpt.data.loader import BatchLoader
from fsdp_gpt.distributed.context_parallel import whole_rows
from fsdp_gpt.evaluation.generate import complete
from fsdp_gpt.distributed.launch import Topology, agree
from fsdp_gpt.evaluation.mc_eval import accuracies, load_sets, mc_sums, truncated
from fsdp_gpt.evaluation.val_loss import val_loss_sums, val_losses
from fsdp_gpt.model import GPT


def load_mc_sets(cfg, topo: Topology) -> dict:
    """The multiple-choice sets of mc_eval_path, read on every rank; a note for items longer than a row."""
    mc_sets = agree(lambda: load_sets(cfg.mc_eval_path or {}, cfg.tokenizer, cfg.vocab_size))
    for name, items in mc_sets.items():
        cut = truncated(items, cfg.block_size)
        if topo.is_main and cut:
            print(f"note: {cut} of {len(items)} items of {name} are longer than block_size {cfg.block_size}: their "
                  f"contexts lose their start", flush=True)
    return mc_sets


@torch.no_grad()
def evaluate(model, gpt: GPT, loader: BatchLoader, cfg, tokenizer, mc_sets: dict, compute) -> tuple[float, str, dict, dict]:
    """Mean loss over the first eval_iters * train_batch val windows (whatever the world size), a
    text sample, a mixture's loss per source, and each multiple-choice set's acc and acc_norm;
    `compute`: the context training's forwards run in."""
    model.eval()
    with compute():
        total = val_loss_sums(model, loader, cfg.eval_iters * cfg.train_batch)
        dist.all_reduce(total)
        mc = {}
        with whole_rows(gpt):  # items and samples of any length: every rank computes its own alone
            for name, items in mc_sets.items():  # a micro batch of items per forward, each rank a share
                right = mc_sums(model, items, cfg.block_size, cfg.micro_batch, dist.get_rank(), dist.get_world_size(),
                                loader.device)
                dist.all_reduce(right)
                mc[name] = accuracies(right)
            text = ""
            if cfg.sample_tokens:
                # every rank generates the same tokens: each forward's gathers are collectives; eager,
                # as compiled blocks would recompile for every new sequence length
                with torch.compiler.set_stance("force_eager"):
                    text = complete(gpt, tokenizer, "", cfg.sample_tokens, seed=cfg.seed, device=loader.device)
    # with no backward to follow, FSDP leaves units that skip resharding after forward (the
    # root, the last block, all under SHARD_GRAD_OP) gathered: free them, and let the
    # parameters seen by checkpoints be the sharded ones again
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    model.train()
    loss, per_source = val_losses(total, loader)
    return loss, text, per_source if loader.mixture else {}, mc

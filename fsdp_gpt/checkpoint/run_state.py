"""What a checkpoint holds, listed here and nowhere else (the files' two formats: ckpt_format.py; the
command that prints a checkpoint's: `python fsdp_ckpt.py PATH`).

Beside the tensors (`model` and `optimizer`, whole in a full file, a rank's slices in a sharded one),
every checkpoint holds header()'s fields: `step` (the state after that step), `world_size` (the ranks
that wrote it), `model_config` (the keys that define the model: model_keys.py's rule), `config` (the
run's resolved config) and `train_state`: `next_step` and `seed` (the batches and dropout masks are
functions of seed, step and rank), then one entry for each field of RunState, under the field's name
(the names older checkpoints hold).
"""
from dataclasses import dataclass

import torch

from fsdp_gpt.config import to_dict
from fsdp_gpt.data.loader import BatchLoader
from fsdp_gpt.observe.spikes import SpikeDetector
from fsdp_gpt.observe.wandb_log import WandbRunId
from fsdp_gpt.optim.expert_balance import ExpertBalance


@dataclass
class RunState:
    """The loop's owners of state beside the weights. Each offers state() (what to keep, alike on every
    rank) and load(state) (its part of the resumed checkpoint, None for a fresh run or a checkpoint
    written before it kept any); CheckpointManager.keep(**vars(run_state)) loads and saves them."""
    data: BatchLoader  # the tokens trained on so far; a mixture's segment and the rows each source supplied
    spikes: SpikeDetector  # the loss spike detector's window of recent losses
    moe: ExpertBalance  # the experts' loads and balancing biases after the last step
    wandb_run_id: WandbRunId  # the wandb run a resume continues (None while wandb is off)

    @classmethod
    def of(cls, cfg, loader: BatchLoader, gpt, device: torch.device) -> "RunState":
        """Fresh owners for a run (each loads its part of a resumed checkpoint in keep())."""
        return cls(data=loader, spikes=SpikeDetector(device, cfg.spike_zscore, cfg.spike_window),
                   moe=ExpertBalance(gpt, cfg.moe_bias_rate, device), wandb_run_id=WandbRunId(cfg))


def tokens_seen(ckpt: dict) -> tuple[int | None, str | None]:
    """(the tokens a checkpoint's run had trained on, how they were taken where it predates their count:
    its steps x its own train_batch x block_size, from its config; else None). None, None: it holds
    neither (written before checkpoints kept their config)."""
    step, config = ckpt["step"], ckpt.get("config", {})
    data = ckpt.get("train_state", {}).get("data") or {}
    if "tokens" in data:
        return data["tokens"], None
    if {"train_batch", "block_size"} <= config.keys():
        return (step * config["train_batch"] * config["block_size"],
                f"taken as {step} steps x train_batch {config['train_batch']} x block_size {config['block_size']}")
    return None, None


def resumed_train_state(ckpt: dict) -> dict:
    """What a resume's owners load from a checkpoint's header (CheckpointManager.keep): its train_state,
    the data's tokens seen filled in where it predates their count (data["tokens_taken_as"] says how)."""
    train_state = dict(ckpt.get("train_state", {}))
    tokens, how = tokens_seen(ckpt)
    if how:
        train_state["data"] = dict(train_state.get("data") or {}) | {"tokens": tokens, "tokens_taken_as": how}
    return train_state


def header(cfg, step: int, world_size: int, owners: dict) -> dict:
    """What a checkpoint of `step` holds beside its tensors; owners: {name: owner} (keep())."""
    kept = {name: owner.state() for name, owner in owners.items()}
    return {"step": step, "world_size": world_size, "model_config": cfg.model_config,
            "config": to_dict(cfg), "train_state": {"next_step": step + 1, "seed": cfg.seed} | kept}

"""Weights & Biases beside TensorBoard (optional: `pip install wandb`; not a dependency).

Rank 0 logs the same scalars as TensorBoard to the run `wandb_project` names. The run's id is kept
in every checkpoint, so a resumed run (a restart, --resume_from) continues the same wandb run.
WANDB_MODE=offline writes it to a local folder (wandb sync uploads it later). wandb's own settings
hold where the user gave them: WANDB_DIR (else the run's files go beside TensorBoard's, in
{tensorboard_dir}/wandb/) and WANDB_RUN_ID for a fresh run (a resumed one continues its checkpoint's).
"""
import os
import secrets

import torch.distributed as dist

from fsdp_gpt.config import UserError, to_dict


class WandbRunId:
    """The wandb run's id, which every checkpoint keeps (state, load): None while wandb is off."""

    def __init__(self, cfg):
        self.enabled, self.id = bool(cfg.wandb_project), None

    def load(self, saved: str | None) -> None:
        """The resumed checkpoint's id, or a new one, alike on every rank (a collective when wandb is on)."""
        if self.enabled:
            found = [saved or os.environ.get("WANDB_RUN_ID") or secrets.token_hex(4)]
            dist.broadcast_object_list(found, src=0)  # rank 0's choice, so every rank's checkpoint header agrees
            self.id = found[0]

    def state(self) -> str | None:
        return self.id


class WandbRun:
    """Opened on rank 0 only."""

    def __init__(self, cfg, run_id: str):
        try:
            import wandb
        except ImportError:
            raise UserError("wandb_project is set but wandb is not installed: pip install wandb (or unset "
                            "wandb_project)") from None
        # wandb.init's dir= overrides WANDB_DIR: given only where the user set no folder of their own
        folder = None if os.environ.get("WANDB_DIR") else cfg.tensorboard_dir
        if folder:
            os.makedirs(folder, exist_ok=True)
        # resume="allow": the run `run_id` continues if wandb has it, or starts under that id
        self.run = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity, name=cfg.wandb_name, id=run_id,
                              resume="allow", dir=folder, config=to_dict(cfg))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()

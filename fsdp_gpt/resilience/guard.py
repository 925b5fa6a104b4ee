"""Non-finite steps: a step whose loss or gradient is not finite changes nothing, on any rank.

The decision rests on the global gradient norm, which clipping has already computed and every rank
holds alike (FSDP2 returns it replicated; DDP's gradients are reduced before it): a non-finite
loss on one rank's data makes that rank's gradients, and so the norm, non-finite too. So the ranks
agree with no collective of their own, and the optimizers skip on the device: fused AdamW takes
`found_inf` (torch's own GradScaler uses it the same way: parameters, moments and step counts stay
as they were) and Muon selects its old values where it is set. Counting happens on the device too;
the host reads the counters on log steps only, where it waits for the loss anyway.
"""
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from fsdp_gpt.config import RunStopped


class NonFiniteGuard:
    def __init__(self, device: torch.device, limit: int):
        self.limit = limit
        self.skipped = torch.zeros((), device=device)  # steps skipped in the run so far
        self.streak = torch.zeros((), device=device)  # consecutive skipped steps up to now
        self.stopped_at = torch.zeros((), device=device)  # the step whose skip made the streak `limit` long

    def check(self, step: int, grad_norm: torch.Tensor, optimizer: torch.optim.Optimizer, scaler,
              also_skip: torch.Tensor | None = None) -> None:
        """Mark step `step` skipped when the gradient norm is not finite; `also_skip` (1: skip, a loss
        spike) skips the update too without counting here. Where fp16's GradScaler is on, it sets the
        optimizer's found_inf itself (an overflow is non-finite there too; spikes.py refuses also_skip)."""
        norm = grad_norm.to_local() if isinstance(grad_norm, DTensor) else grad_norm
        bad = (~torch.isfinite(norm)).float()
        if not scaler.is_enabled():
            # also_skip is on the device; with cpu_offload the norm (so `bad`) is on the host, where
            # the optimizer steps: a blocking copy there, not the optimizer's non_blocking one
            optimizer.found_inf = bad if also_skip is None else torch.maximum(bad, also_skip.to(bad.device))
        self.skipped += bad
        self.streak = (self.streak + 1) * bad
        self.stopped_at = torch.where((self.streak >= self.limit) & (self.stopped_at == 0), step, self.stopped_at)

    def skipped_steps(self) -> int:
        return int(self.skipped.item())

    def stop_if_too_many(self, position: str, last_saved: Callable[[], str | None]) -> None:
        """On log steps (a host sync): stop every rank alike, once `limit` steps in a row were skipped.
        last_saved: the newest checkpoint, a save in flight finished first (every rank stops here alike)"""
        step = int(self.stopped_at.item())
        if step:
            last_good = last_saved()
            raise RunStopped(f"{self.limit} consecutive steps up to step {step} had a non-finite loss or gradient "
                             f"norm and were skipped ({self.skipped_steps()} in all): stopped. Data position: "
                             f"{position}. Last good checkpoint: {last_good or 'none yet'}")

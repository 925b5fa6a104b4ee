"""Validation loss: the sums every rank computes over its share of the val windows, and the loss
from every rank's sums (the trainer all-reduces them between the two; evaluate.py runs both alone).

val/loss is the mean next-token loss over the first eval_iters * train_batch windows of block_size
tokens of val.bin: the same tokens at any world size. A mixture's run: each source's val loss on its
share of the windows, and their mean weighted by data_weights.
"""
import torch

from fsdp_gpt.data.loader import BatchLoader


@torch.no_grad()
def val_loss_sums(model, loader: BatchLoader, n_windows: int) -> torch.Tensor:
    """(sources, 2), float64: each source's (sum of per-window mean losses, number of windows) over
    this rank's share. Under context parallelism a rank holds 1/cp_size of each window: its share of
    the window's mean and count is 1/cp_size of its tokens'. A loader made with doc_mask hands the
    documents' openings: attention stops at the data's separator, as the run trained."""
    total = torch.zeros(len(loader.names), 2, dtype=torch.float64, device=loader.device)
    for k, x, y, opens, weight in loader.val_batches(n_windows):
        _, losses = model(x, y, positions=loader.positions, opens=opens, reduction="none")
        per_window = losses.mean(1)
        total[k] += torch.stack([(per_window * weight).sum(), weight.sum()]).double() / loader.cp_size
    return total


def val_losses(total: torch.Tensor, loader: BatchLoader) -> tuple[float, dict[str, float]]:
    """The val loss and each source's, from every rank's sums: a mixture's val loss is its sources'
    mean weighted by data_weights (a source of weight 0 is measured, not counted)."""
    each = {name: s / n for name, (s, n) in zip(loader.names, total.tolist())}
    weights = dict(zip(loader.names, loader.val_weights))
    return sum(weights[name] * loss for name, loss in each.items()) / sum(weights.values()), each

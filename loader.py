"""The deterministic batch loader: token windows from data.py's token files, as tensors on the device."""
import numpy as np
import torch

from config import UserError
from data import open_split


class BatchLoader:
    """Deterministic batches: the global batch of step s depends only on (seed, s).

    Step s draws train_batch start offsets from a generator seeded with (seed, s);
    data-parallel rank r takes rows [r * n, (r + 1) * n) of them, n = train_batch / dp,
    and cuts them into micro-batches. World size, micro batch and restarts change who
    computes which row, never which rows make up the step; nor does the same token
    sequence split into other files (llm.c shards).
    """

    def __init__(self, data_path: str, meta: dict, block_size: int, train_batch: int,
                 micro_batch: int, dp_rank: int, dp_size: int, seed: int, device: torch.device):
        self.block_size, self.train_batch, self.micro_batch = block_size, train_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed, self.device = dp_rank, dp_size, seed, device
        self.splits = {split: open_split(data_path, meta, split) for split in ("train", "val")}
        for split, tokens in self.splits.items():
            if len(tokens) <= block_size + 1:
                raise UserError(f"the {split} split of {data_path} holds {len(tokens)} tokens, fewer than "
                                f"block_size+1={block_size + 1}")

    def _rows(self, split: str, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, T = self.splits[split], self.block_size
        window = np.stack([tokens.window(int(s), T + 1) for s in starts]).astype(np.int64)
        xy = torch.from_numpy(window)
        if self.device.type == "cuda":
            xy = xy.pin_memory().to(self.device, non_blocking=True)
        return xy[:, :-1], xy[:, 1:]

    def micro_batches(self, step: int):
        """Yield (x, y) micro-batches of this rank's share of step `step`'s global batch."""
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.splits["train"]) - self.block_size - 1, size=self.train_batch)
        share = self.train_batch // self.dp_size
        mine = starts[self.dp_rank * share:(self.dp_rank + 1) * share]
        for i in range(0, share, self.micro_batch):
            yield self._rows("train", mine[i:i + self.micro_batch])

    def val_batches(self, n_windows: int):
        """Yield (x, y, weight) over the first n_windows consecutive val windows.

        Windows are dealt round-robin to ranks; every rank yields the same number of
        micro-batches (collectives inside forward must match), padding with weight 0.
        """
        available = (len(self.splits["val"]) - 1) // self.block_size
        n_windows = min(n_windows, available)
        mine = np.arange(self.dp_rank, n_windows, self.dp_size)
        per_rank = -(-n_windows // self.dp_size)
        n_micro = -(-per_rank // self.micro_batch)
        for i in range(n_micro):
            ids = mine[i * self.micro_batch:(i + 1) * self.micro_batch]
            weight = torch.zeros(self.micro_batch)
            weight[:len(ids)] = 1.0
            ids = np.concatenate([ids, np.zeros(self.micro_batch - len(ids), dtype=ids.dtype)])
            x, y = self._rows("val", ids * self.block_size)
            yield x, y, weight.to(x.device)

"""Loss spikes: a step whose loss lies more than `spike_zscore` noise levels above what the loss was
doing just before it, named at the next log line and counted in TensorBoard (train/spikes); with
`spike_skip`, its update is skipped on every rank.

"Just before" is robust and free of the trend: the level is the median of the last RECENT losses,
the noise the median absolute deviation of the step-to-step changes over the previous
`spike_window` losses (each change taken from their median, so a steady descent adds nothing).
The mean and standard deviation of the window (llm.c's and OLMo's test) missed spikes early in a
run: the window still held the steep descent, which inflated the deviation (bench/spike_z.py).

The loss tested is the global batch's (reduced across ranks every step), so every rank decides
alike with no collective of its own, and everything stays on the device: the window, the test, the
count, and the skip, handed to the optimizers as the non-finite guard hands its own (found_inf).
The host reads the step's flags at log steps only, where it waits for the loss anyway. The window
keeps every finite loss, spikes too: a lasting shift in the loss (new data) stops counting as a
spike once the window has seen it, instead of skipping every step after it.
"""
import torch

from fsdp_gpt.config import UserError

RECENT = 10  # the losses whose median is the level a step is judged against
MAD_TO_STD = 1.4826  # a normal distribution's standard deviation per median absolute deviation


def z_score(history: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """How many noise levels `loss` lies above the level of `history` (earlier losses, oldest first,
    NaN where a step's loss was not finite): 0-dim, NaN where history is too short to tell."""
    def median(t: torch.Tensor) -> torch.Tensor:
        # along a dimension: a kernel with no host sync on CUDA in every supported torch (the
        # whole-tensor form counted its NaNs on the host in some versions)
        return t.nanmedian(dim=0).values

    level = median(history[-RECENT:])
    changes = history[1:] - history[:-1]  # NaN next to a hole
    # a change is the difference of two noisy losses: its spread is sqrt(2) times one loss's
    noise = MAD_TO_STD * median((changes - median(changes)).abs()) / 2 ** 0.5
    return (loss - level) / noise


def check_skip(cfg, dtype: torch.dtype) -> None:
    """spike_skip hands the skip to the optimizers through found_inf, which fp16's GradScaler sets itself."""
    if cfg.spike_skip and dtype == torch.float16:
        raise UserError("spike_skip: true with dtype fp16 (also what dtype: auto picks on GPUs without bf16) is not "
                        "supported: fp16's loss scaling decides the skips itself; use bf16 or fp32, or spike_skip: false")


class SpikeDetector:
    def __init__(self, device: torch.device, zscore: float, window: int):
        self.zscore, self.window = zscore, window
        self.losses = torch.zeros(window, device=device)  # the last min(seen, window) losses, in a ring
        self.seen = 0  # steps seen: the next loss goes into slot seen % window
        self.count = torch.zeros((), device=device)  # spikes in the run so far
        self.no_spike = torch.zeros((), device=device)
        self.recent = []  # (step, spike, z) of the steps since the last log line

    def check(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """Whether step `step`'s global loss is a spike, as a 0-dim float tensor (1: a spike)."""
        if not self.zscore:  # off
            return self.no_spike
        n, spike, z = min(self.seen, self.window), self.no_spike, self.no_spike
        if n >= max(self.window // 2, 3):  # half a window of history before judging
            # oldest first (the ring's oldest slot is the next one written once it is full); a
            # non-finite loss (a step the guard skipped) is a NaN hole the medians pass over
            history = self.losses[:n] if self.seen < self.window else self.losses.roll(-(self.seen % self.window))
            z = z_score(torch.where(torch.isfinite(history), history, torch.nan), loss)
            # a NaN z (too few finite losses) is no spike, nor is a non-finite loss: the guard's
            spike = ((z > self.zscore) & torch.isfinite(loss)).float()
            self.count += spike
        self.losses[self.seen % self.window] = loss
        self.seen += 1
        self.recent.append((step, spike, z))
        return spike

    def since_last_log(self) -> list[tuple[int, float]]:
        """(step, z) of each spike since the last call: a host sync, for log steps."""
        if not self.recent:
            return []
        steps = [step for step, _, _ in self.recent]
        flags_and_zs = torch.stack([torch.stack([spike, z]) for _, spike, z in self.recent]).tolist()
        self.recent = []
        return [(step, z) for step, (flag, z) in zip(steps, flags_and_zs) if flag]

    def total(self) -> int:
        return int(self.count.item())

    def state(self) -> dict:
        """What a checkpoint keeps, so a resumed run judges its first steps as the uninterrupted run did."""
        return {"losses": self.losses.tolist(), "seen": self.seen, "count": self.total()}

    def load(self, state: dict | None) -> None:
        if state and len(state["losses"]) == self.window:  # another window size starts afresh
            self.losses.copy_(torch.tensor(state["losses"]))
            self.seen = state["seen"]
            self.count.fill_(state["count"])

"""Rank-0 progress reporting: console line, TensorBoard scalars, MFU and memory."""
import math
import os
import resource
import time

import torch
import torch.distributed as dist

from fsdp_ckpt import local_slice

# Dense bf16 peak FLOP/s per GPU (no sparsity), from the vendors' data sheets.
GPU_PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "A10G": 125e12, "L40S": 362e12,
    "L4": 121e12, "A6000": 155e12, "4090": 165e12, "3090": 71e12, "V100": 125e12, "T4": 65e12,
}


def device_peak_flops(device: torch.device) -> float:
    """Peak FLOP/s of one rank's device: the table for known GPUs, measured for a CPU."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((flops for key, flops in GPU_PEAK_FLOPS.items() if key in name), 312e12)
    n, repeats = 512, 10
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm up
    best = math.inf
    for _ in range(5):  # the fastest of a few rounds: other processes share the cores
        start = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 * repeats / best


def peak_memory_gb(device: torch.device) -> float:
    """Device memory on GPU; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB


def state_gb(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """This rank's parameters, gradients and optimizer state (its shards under FSDP)."""
    params = list(model.parameters())
    tensors = params + [p.grad for p in params if p.grad is not None] + [
        v for state in optimizer.state.values() for v in state.values() if v.dim()]
    local = (local_slice(t)[0] for t in tensors)
    return sum(t.numel() * t.element_size() for t in local) / 1e9


def per_rank_memory(model, optimizer, device: torch.device) -> torch.Tensor:
    """(world, 2): every rank's (peak GB, state GB). A collective: every rank calls it."""
    mine = torch.tensor([peak_memory_gb(device), state_gb(model, optimizer)], device=device)
    every = torch.empty(dist.get_world_size() * 2, device=device)
    dist.all_gather_single(every, mine)
    return every.view(-1, 2).cpu()


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    h, m = divmod(minutes, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class ProgressLog:
    """Created on every rank; only rank 0 prints and writes TensorBoard events."""

    def __init__(self, enabled: bool, tensorboard_dir: str, max_iters: int, tokens_per_step: int,
                 flops_per_token: int, peak_flops: float):
        self.enabled, self.max_iters = enabled, max_iters
        self.tokens_per_step, self.flops_per_token, self.peak_flops = tokens_per_step, flops_per_token, peak_flops
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter
            os.makedirs(tensorboard_dir, exist_ok=True)
            self.writer = SummaryWriter(log_dir=tensorboard_dir)
        self.mark_time, self.mark_step = time.perf_counter(), None

    def start(self, step: int) -> None:
        """Begin timing from `step` (after start-up, eval and resume)."""
        self.mark_time, self.mark_step = time.perf_counter(), step

    def train(self, step: int, loss: float, lr: float, grad_norm: float, memory: torch.Tensor) -> None:
        """memory: per_rank_memory(); the console shows the largest rank, TensorBoard every rank."""
        if not self.enabled:
            return
        now = time.perf_counter()
        step_time = (now - self.mark_time) / max(step - self.mark_step, 1)
        self.mark_time, self.mark_step = now, step
        tokens_per_sec = self.tokens_per_step / step_time
        mfu = tokens_per_sec * self.flops_per_token / self.peak_flops
        peak, state = memory.max(dim=0).values.tolist()
        scalars = {"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm, "perf/tokens_per_sec": tokens_per_sec,
                   "perf/mfu": mfu, "mem/peak_gb": peak, "mem/state_gb": state}
        for rank, (rank_peak, rank_state) in enumerate(memory.tolist()):
            scalars |= {f"mem/rank{rank}/peak_gb": rank_peak, f"mem/rank{rank}/state_gb": rank_state}
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        eta = _duration(step_time * (self.max_iters - step))
        print(f"step {step}/{self.max_iters} | loss {loss:.4f} | lr {lr:.2e} | {tokens_per_sec:,.0f} tok/s "
              f"| MFU {100 * mfu:.1f}% | mem {peak:.2f} GB | ETA {eta}", flush=True)

    def val(self, step: int, loss: float, sample: str) -> None:
        if self.enabled:
            self.writer.add_scalar("val/loss", loss, step)
            self.writer.add_scalar("val/perplexity", math.exp(loss), step)
            # indented: TensorBoard renders text as markdown, this keeps it verbatim
            if sample:
                self.writer.add_text("val/sample", "\n".join("    " + line for line in sample.splitlines()), step)
            print(f"step {step}/{self.max_iters} | val loss {loss:.4f} | perplexity {math.exp(loss):.2f}", flush=True)

    def close(self, memory: torch.Tensor) -> None:
        """memory: per_rank_memory() after the last step, eval and checkpoint."""
        if not self.enabled:
            return
        self.writer.close()
        peaks, states = (" ".join(f"{gb:.3f}" for gb in column) for column in memory.t().tolist())
        print(f"memory per rank, GB: peak {peaks} | parameters, gradients, optimizer state {states}", flush=True)

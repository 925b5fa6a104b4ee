"""Learning-rate schedules: linear warmup over steps 1..warmup_iters, then the table's schedule.

wsd (warmup-stable-decay) holds the peak until the last decay_fraction of max_iters and decays
from there to min_lr at max_iters: the rate of a stable-phase step does not depend on max_iters,
so a run resumed from a stable-phase checkpoint with a larger max_iters continues exactly as a run
planned that long would (docs/long_runs.md). cosine reaches min_lr at lr_decay_iters, however long
the run; constant stays at the peak.
"""
import math


def cosine(cfg, step: int) -> float:
    if step >= cfg.lr_decay_iters:
        return cfg.min_lr
    progress = (step - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def wsd(cfg, step: int) -> float:
    decay_steps = round(cfg.decay_fraction * cfg.max_iters)
    decay_start = cfg.max_iters - decay_steps
    if step <= decay_start:
        return cfg.learning_rate
    progress = (step - decay_start) / decay_steps  # (0, 1] over the decay
    fraction_left = 1.0 - progress if cfg.decay_shape == "linear" else 1.0 - math.sqrt(progress)
    return cfg.min_lr + fraction_left * (cfg.learning_rate - cfg.min_lr)


def constant(cfg, step: int) -> float:
    return cfg.learning_rate


SCHEDULES = {"cosine": cosine, "wsd": wsd, "constant": constant}


def lr_at(cfg, step: int) -> float:
    """The learning rate of step `step` (steps count from 1)."""
    if step <= cfg.warmup_iters:
        return cfg.learning_rate * step / cfg.warmup_iters
    return SCHEDULES[cfg.lr_schedule](cfg, step)

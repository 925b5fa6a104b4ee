"""Rank-0 progress reporting: console line, TensorBoard (and wandb) scalars and the same figures as
JSON lines (figures_file.py), MFU, memory, each rank's time."""
import glob
import math
import os
import resource
import statistics
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from fsdp_gpt.compat import all_gather_flat
from fsdp_gpt.distributed.shards import local_part
from fsdp_gpt.distributed.peak_flops import cpu_peak_flops, gpu_peak_flops
from fsdp_gpt.observe.figures_file import EARLIER, FiguresFile
from fsdp_gpt.observe.step_times import COLUMNS as TIME_COLUMNS
from fsdp_gpt.observe.wandb_log import WandbRun

def host_peak_gb() -> float:
    """Peak resident set size of this process (with cpu_offload, where the state lives).

    VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across fork and exec, so a rank
    started by a large parent (torchrun's agent, a notebook, pytest) reported at least the
    parent's size."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1e6  # kB
    except OSError:  # no /proc (macOS): ru_maxrss, in bytes there
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e9


def device_memory_gb(device: torch.device) -> tuple[float, float]:
    """(peak allocated, peak reserved) since the last call. Reserved is what the caching allocator
    holds, what an out-of-memory error is about. On CPU both are the process's peak RSS."""
    if device.type != "cuda":
        return host_peak_gb(), host_peak_gb()
    allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)  # each log line reports its own interval
    return allocated / 1e9, reserved / 1e9


def state_gb(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """This rank's parameters, gradients (when held) and optimizer state (its shards under FSDP).
    At log time the step's gradients are already freed: the figure is parameters + optimizer state."""
    return sum(state_parts_gb(model, optimizer).values())


def state_parts_gb(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """state_gb's parts: {"params", "grads", "optimizer"} GB of this rank's."""
    params = list(model.parameters())
    parts = {"params": params, "grads": [p.grad for p in params if p.grad is not None],
             "optimizer": [v for state in optimizer.state.values() for v in state.values() if v.dim()]}
    # local_part, not local_slice: its offsets cost 70 ms at 148 DTensors
    return {name: sum(local_part(t).numel() * local_part(t).element_size() for t in tensors) / 1e9
            for name, tensors in parts.items()}


MEMORY_COLUMNS = ("peak", "reserved", "host", "state")


def per_rank_stats(model, optimizer, device: torch.device, times: list[float] = ()) -> torch.Tensor:
    """(world, 4 + len(times)): every rank's GB as MEMORY_COLUMNS, then its `times` (StepTimes.row():
    seconds per step as TIME_COLUMNS). The log step's gather of every rank's own figures (a figure
    per rank rides it rather than adding a collective; a sum over the ranks needs its own all-reduce):
    every rank calls it."""
    mine = torch.tensor([*device_memory_gb(device), host_peak_gb(), state_gb(model, optimizer), *times], device=device)
    every = torch.empty(dist.get_world_size() * len(mine), device=device)
    all_gather_flat(every, mine)
    return every.view(-1, len(mine)).cpu()


class Slowest(NamedTuple):
    """The rank whose own time a step is the longest: its ratio to the median rank's, and its own time's parts."""
    rank: int
    ratio: float
    data_ms: float
    compute_ms: float


def slowest_rank(times: torch.Tensor) -> Slowest:
    """times: (world, TIME_COLUMNS) seconds per step. The rank whose own time (data + compute: not
    waiting for the others) is the longest."""
    column = dict(zip(TIME_COLUMNS, times.t().tolist()))
    own = [data + compute for data, compute in zip(column["data"], column["compute"])]
    rank = max(range(len(own)), key=own.__getitem__)
    return Slowest(rank, own[rank] / max(statistics.median(own), 1e-9), 1e3 * column["data"][rank],
                   1e3 * column["compute"][rank])


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    h, m = divmod(minutes, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def shown(form: str):
    """A console field that formats its figure's value alone."""
    return lambda value, line: form.format(value)


# The console line, field by field after "step s/max": (a figure, how it shows), in the line's order.
# Every figure a log step has reaches TensorBoard, wandb and metrics.jsonl (what programs read: the
# console line is for people, free to change); the console shows those named here,
# where the step has them (a form returning "" shows nothing). A figure a maintainer adds (an
# owner's scalars(), or one computed in ProgressLog.train) shows on the console by a row here and
# nowhere else. Beside the scalars a line has values of its own: "mfu" (None where the peak is
# unknown), "spikes" ((step, z) since the last line) and "slowest" (the lagging rank's Slowest;
# None where no rank lags).
CONSOLE = [
    ("train/loss", shown("loss {:.4f}")),
    ("train/lr", shown("lr {:.2e}")),
    ("perf/tokens_per_sec", shown("{:,.0f} tok/s")),
    ("mfu", lambda mfu, line: "MFU n/a" if mfu is None else f"MFU {100 * mfu:.1f}%"),
    # on CPU every memory column but state is the process's peak RSS: one figure is enough
    ("mem/peak_gb", lambda gb, line: f"mem {gb:.2f} GB" + (
        f" ({line['mem/reserved_gb']:.2f} reserved)" if line["mem/reserved_gb"] != gb else "")),
    ("perf/eta_s", lambda seconds, line: f"ETA {_duration(seconds)}"),
    ("train/skipped_steps", lambda skipped, line: f"skipped {skipped}" if skipped else ""),
    # the worst MoE layer's: docs/models.md
    ("moe/busiest", lambda busiest, line: f"experts busiest {busiest:.2f}x, idle {100 * line['moe/idle']:.0f}%"),
    ("spikes", lambda spikes, line: " | ".join(
        f"loss spike at step {step} (z {z:.1f}{', update skipped' if line['spike_skip'] else ''})" for step, z in spikes)),
    ("slowest", lambda lag, line: "" if lag is None else (
        f"slowest rank {lag.rank}: {lag.ratio:.2f}x the median (data {lag.data_ms:.0f} ms, compute "
        f"{lag.compute_ms:.0f} ms a step)")),
]


def console_fields(line: dict) -> str:
    """The console's fields of a log step's figures and values, " | " before each shown one."""
    fields = (form(line[tag], line) for tag, form in CONSOLE if tag in line)
    return "".join(f" | {field}" for field in fields if field)


def _alternatives(names) -> str:
    return "{" + ",".join(names) + "}"


class ProgressLog:
    """Created on every rank; only rank 0 prints and writes TensorBoard events and metrics.jsonl."""

    # the TensorBoard tags (metrics.jsonl's names) this logger writes of its own, {tag: meaning}; the loop's
    # owners declare theirs beside their scalars() (BatchLoader.TAGS, ExpertBalance.TAGS). docs/logging.md's
    # table is made of these (fsdp_gpt/doc_tables.py), and the tests refuse a tag a run writes undeclared
    TAGS = {
        "train/loss": "the global batch's mean loss (every rank's share reduced), at each log step",
        "train/lr": "the learning rate",
        "train/grad_norm": "the gradient's global norm, before clipping",
        "train/skipped_steps": "non-finite steps skipped so far (docs/long_runs.md)",
        "train/spikes": "loss spikes so far",
        "perf/tokens_per_sec": "training tokens a second since the last line (evals and saves left out)",
        "perf/mfu": "model FLOPs utilisation against the devices' peak (where the peak is known)",
        "perf/eta_s": "seconds to max_iters at that rate",
        f"mem/{_alternatives(MEMORY_COLUMNS)}_gb": "the largest rank's peak allocated, peak reserved, host peak RSS "
                                                    "and parameters + optimizer state, GB",
        "mem/rank{r}/{peak,state}_gb": "each rank's peak and its parameters + optimizer state, GB",
        f"time/{_alternatives(TIME_COLUMNS)}_ms/{{min,median,max}}": "over the ranks: each one's ms a step waiting "
                                                                     "for data, computing, and (on CPU) waiting for "
                                                                     "the others (every rank's time, below)",
        "time/slowest_rank": "the rank whose own time (data + compute) is the longest",
        "time/slowest_ratio": "its own time over the median rank's",
        "val/loss": "the val loss, at step 0, each eval_interval and the last step",
        "val/perplexity": "exp(val/loss)",
        "val/loss/{source}": "a mixture's: each source's val loss (docs/data.md)",
        "eval/{name}/{acc,acc_norm}": "each multiple-choice set's accuracy (mc_eval_path)",
        "val/sample": "text: sample_tokens tokens sampled at each eval",
    }

    def __init__(self, enabled: bool, cfg, tokens_per_step: int, flops_per_token: int, device: torch.device,
                 dtype: torch.dtype, world_size: int, resumed_at: int = 0, wandb_id: str | None = None):
        """resumed_at: the step a resumed run continues after. What an abandoned stretch of the run
        logged past it is purged from TensorBoard's view (purge_step), so each step shows once,
        with the resumed run's values; a fresh run into an earlier run's folder purges all of it (from
        step 0), said in a note. wandb_id: the wandb run to log to (wandb_log.run_id), or None."""
        self.enabled, self.max_iters, self.straggler_ratio = enabled, cfg.max_iters, cfg.straggler_ratio
        self.spike_skip = cfg.spike_skip
        self.tokens_per_step, self.flops_per_token, self.peak_flops = tokens_per_step, flops_per_token, None
        self.writer = self.wandb = self.figures = None
        if enabled:  # the other ranks neither log nor measure (a CPU's peak is measured, not looked up)
            from torch.utils.tensorboard import SummaryWriter
            os.makedirs(cfg.tensorboard_dir, exist_ok=True)
            earlier = not resumed_at and bool(glob.glob(os.path.join(cfg.tensorboard_dir, "events.*")))
            if earlier:
                print(f"note: {cfg.tensorboard_dir}/ holds an earlier run's TensorBoard events: this run replaces them "
                      f"in TensorBoard's view (purged from step 0; their files stay), and its metrics.jsonl moves to "
                      f"{EARLIER}; a tensorboard_dir of its own keeps both runs in view", flush=True)
            self.writer = SummaryWriter(log_dir=cfg.tensorboard_dir,
                                        purge_step=resumed_at + 1 if resumed_at else 0 if earlier else None)
            self.figures = FiguresFile(cfg.tensorboard_dir, resumed_at)
            self.wandb = wandb_id and WandbRun(cfg, wandb_id)
            if device.type == "cuda":
                peak = gpu_peak_flops(torch.cuda.get_device_name(device), dtype)
                if peak is None:
                    print(f"note: MFU unknown for GPU '{torch.cuda.get_device_name(device)}': add its dense peak "
                          f"FLOP/s to peak_flops.GPU_PEAK_FLOPS", flush=True)
            else:
                peak, how = cpu_peak_flops()
                print(f"note: MFU on the CPU is an estimate, against {peak / 1e9:.0f} GFLOP/s per rank, the larger of "
                      f"two figures: {how}", flush=True)
            self.peak_flops = peak and peak * world_size  # every rank's device alike
        self.mark_time, self.mark_step = time.perf_counter(), None
        self.run_peak = None  # every rank's memory peaks over the whole run (GPU peaks reset per log)

    def start(self, step: int) -> None:
        """Begin timing from `step` (after start-up, eval and resume)."""
        self.mark_time, self.mark_step = time.perf_counter(), step

    def _write(self, kind: str, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.figures.write(kind, step, scalars)
        if self.wandb:
            self.wandb.log(scalars, step)

    def train(self, step: int, loss: float, lr: float, grad_norm: float, per_rank: torch.Tensor, skipped: int,
              figures: dict[str, float], spikes: list[tuple[int, float]], spike_count: int) -> None:
        """per_rank: per_rank_stats() with step times; memory: the console shows the largest rank,
        TensorBoard every rank. skipped: non-finite steps skipped so far; figures: the scalars the
        loop's owners report (a mixture's data/{source}/..., the MoE layers' moe/...); spikes: (step,
        z) of the loss spikes since the last line, of spike_count in the run."""
        if not self.enabled:
            return
        now = time.perf_counter()
        step_time = (now - self.mark_time) / max(step - self.mark_step, 1)
        self.mark_time, self.mark_step = now, step
        tokens_per_sec = self.tokens_per_step / step_time
        memory, times = per_rank[:, :len(MEMORY_COLUMNS)], per_rank[:, len(MEMORY_COLUMNS):]
        self.run_peak = memory if self.run_peak is None else torch.maximum(self.run_peak, memory)
        largest = dict(zip(MEMORY_COLUMNS, memory.max(dim=0).values.tolist()))
        scalars = {"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm, "perf/tokens_per_sec": tokens_per_sec,
                   "train/skipped_steps": skipped, "train/spikes": spike_count} | figures
        scalars |= {f"mem/{column}_gb": gb for column, gb in largest.items()}
        for rank, row in enumerate(memory.tolist()):
            scalars |= {f"mem/rank{rank}/{column}_gb": gb for column, gb in zip(MEMORY_COLUMNS, row)
                        if column in ("peak", "state")}
        for column, values in zip(TIME_COLUMNS, times.t().tolist()):
            if not math.isnan(values[0]):
                scalars |= {f"time/{column}_ms/min": 1e3 * min(values), f"time/{column}_ms/median":
                            1e3 * statistics.median(values), f"time/{column}_ms/max": 1e3 * max(values)}
        slowest = slowest_rank(times)
        scalars |= {"time/slowest_rank": slowest.rank, "time/slowest_ratio": slowest.ratio}
        mfu = None
        if self.peak_flops:
            # a CPU's peak with no vector bound is a measurement, which a busy moment undercuts: what
            # the run itself reached is a peak too, so the figure never passes 100%
            self.peak_flops = max(self.peak_flops, tokens_per_sec * self.flops_per_token)
            mfu = scalars["perf/mfu"] = tokens_per_sec * self.flops_per_token / self.peak_flops
        scalars["perf/eta_s"] = step_time * (self.max_iters - step)
        self._write("train", scalars, step)
        lag = slowest if slowest.ratio > self.straggler_ratio else None
        line = scalars | {"mfu": mfu, "spikes": spikes, "slowest": lag, "spike_skip": self.spike_skip}
        print(f"step {step}/{self.max_iters}{console_fields(line)}", flush=True)

    def val(self, step: int, loss: float, sample: str, per_source: dict[str, float], mc: dict[str, dict]) -> None:
        """per_source: a mixture's val loss of each source (val/loss/{source}); mc: each multiple-choice
        set's {acc, acc_norm} (eval/{name}/...)."""
        if not self.enabled:
            return
        scalars = {"val/loss": loss, "val/perplexity": math.exp(loss)}
        scalars |= {f"val/loss/{name}": value for name, value in per_source.items()}
        scalars |= {f"eval/{name}/{metric}": value for name, scores in mc.items() for metric, value in scores.items()}
        self._write("val", scalars, step)
        # indented: TensorBoard renders text as markdown, this keeps it verbatim
        if sample:
            self.writer.add_text("val/sample", "\n".join("    " + line for line in sample.splitlines()), step)
        each = "".join(f" | {name} {value:.4f}" for name, value in per_source.items())
        each += "".join(f" | {name} acc {s['acc']:.4f} acc_norm {s['acc_norm']:.4f}" for name, s in mc.items())
        print(f"step {step}/{self.max_iters} | val loss {loss:.4f} | perplexity {math.exp(loss):.2f}{each}", flush=True)

    def close(self, per_rank: torch.Tensor) -> None:
        """per_rank: per_rank_stats() after the last step, eval and checkpoint."""
        if not self.enabled:
            return
        self.writer.close()
        self.figures.close()
        if self.wandb:
            self.wandb.close()
        memory = per_rank if self.run_peak is None else torch.maximum(self.run_peak, per_rank)
        columns = {name: " ".join(f"{gb:.3f}" for gb in column) for name, column in zip(MEMORY_COLUMNS, memory.t().tolist())}
        extra = "".join(f" | {name} {columns[name]}" for name in ("reserved", "host") if columns[name] != columns["peak"])
        print(f"memory per rank, GB: peak {columns['peak']} | parameters + optimizer state "
              f"{columns['state']}{extra}", flush=True)


# ---- reading the events back (tests, bench/compare_runs.py) ----
def _events(tb_dir: str) -> tuple[dict, dict]:
    """({tag: {step: value}} of the scalars, {tag: {step: text}} of the texts) of tb_dir's events, read as
    TensorBoard reads the folder: its files in order, a resumed or fresh run's purge hiding what an
    earlier one logged from its purge step on. Empty where there are no events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tb_logging
    if not glob.glob(os.path.join(tb_dir, "events.*")):
        return {}, {}
    acc = EventAccumulator(os.fspath(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    logger, level = tb_logging.get_logger(), tb_logging.get_logger().level
    logger.setLevel("ERROR")  # each purge's warning blames "a TensorFlow restart"
    try:
        acc.Reload()
    finally:
        logger.setLevel(level)
    tags = acc.Tags()
    return ({tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in tags["scalars"]},
            {tag.removesuffix("/text_summary"): {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)}
             for tag in tags["tensors"] if tag.endswith("/text_summary")})


def scalar_tags(tb_dir: str) -> set[str]:
    """Every scalar tag in tb_dir's events."""
    return set(_events(tb_dir)[0])


def read_scalars(tb_dir: str, tag: str) -> dict[int, float]:
    """{step: value} of one TensorBoard tag, as TensorBoard shows it."""
    return _events(tb_dir)[0].get(tag, {})


def text_tags(tb_dir: str) -> set[str]:
    """Every text tag in tb_dir's events."""
    return set(_events(tb_dir)[1])


def read_texts(tb_dir: str, tag: str) -> dict[int, str]:
    """{step: text} of one TensorBoard text tag."""
    return _events(tb_dir)[1].get(tag, {})

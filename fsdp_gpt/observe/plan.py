"""A dry run (--dry_run=NODESxGPUS, docs/scale_plan.md): the trainer's own start-up and one training step, as
rank 0 of that world runs them, in this one CPU process. The process group is torch's fake one (launch.simulated:
collectives send nothing), the weights fake tensors (shapes and dtypes, no storage, nothing computed), the
batches fake ones of a rank's shape (no data read), the decisions the device's (the compute dtype, FP8, the
units' layout) the planned GPU's (distributed/gpus.py). What it measures, it measures of the real code: the
memory of the step's every tensor (torch's memory tracker), each collective the step issues with its
bytes and its group, the state as mem/state_gb counts it, a save's files.

Here are the measuring instruments; plan_report.py makes the figures a team reads of what they found.
"""
import contextlib
import copy
import dataclasses
import io
import os
import sys
import time
import warnings

import numpy as np
import torch
from torch._subclasses import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from fsdp_gpt.config import UserError
from fsdp_gpt.distributed.context_parallel import positions_of, row_pieces
from fsdp_gpt.distributed.launch import Topology
from fsdp_gpt.observe.collectives import Collectives
from fsdp_gpt.observe.metrics import host_peak_gb, state_parts_gb
from fsdp_gpt.observe.plan_report import figures, screen, write

class StepTracker(MemTracker):
    """torch's memory tracker (every tensor's storage, by what it holds, over the step: its peak), counting the
    collectives it sees pass too: one mode over each of the step's operations, not two. Not its FSDP2 tracker:
    in torch 2.13 that one hooks each module of a unit of several blocks as a unit of its own, resharding after
    each, so the step it measures gathers more often and holds less than the run's."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.track_external(model, optimizer)
        self.collectives = Collectives()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.prim.device.default:  # a fake tensor's device, asked often: nothing to track
            return func(*args, **(kwargs or {}))
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.collectives.record(func, args, out)
        return out

    def _update_peak_stats(self, peak_state) -> None:
        # the step's peak alone: torch's also walks every module it has met at each operation for each one's own
        # peak, which the plan doesn't read and which made a step's cost grow as the square of its layers
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot["Total"]:
                self._peak_mem[device] = snapshot["Total"]
                self._peak_mem_snap[device] = copy.deepcopy(snapshot)

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True):
        # without its hooks on each parameter's gradient, which torch registers on every one a module holds and
        # which fail on a parameter without gradient (the experts' selection bias): a gradient is counted all the
        # same, as the tensor the backward makes
        return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

    def restart(self) -> None:
        """The peak and the collectives counted from now on (the peak as entering starts it), for another step
        under the same tracker."""
        self._peak_mem_snap = self.get_tracker_snapshot()
        self._peak_mem = {device: snapshot["Total"] for device, snapshot in self._peak_mem_snap.items()}
        self.reset_mod_stats()
        self.collectives = Collectives()

    def peak_gb(self, device: torch.device) -> dict[str, float]:
        """The step's peak: GB in all ("Total"), and of each kind of tensor at that moment (the tracker's names:
        "Parameter", "Gradient", "Activation", "Optstate", ...)."""
        return {getattr(kind, "value", kind): n / 1e9 for kind, n in self.get_tracker_snapshot("peak")[device].items()}


class FakeBatches:
    """The loader's micro-batches for a dry run: fake tensors of a rank's shape (its pieces of micro_batch rows
    under context parallelism), nothing read. doc_mask's documents: each row one (the data decides otherwise)."""

    def __init__(self, cfg, topo: Topology):
        self.pieces = row_pieces(cfg.cp_mode, topo.cp_rank, topo.cp_size, cfg.block_size)
        self.positions = positions_of(self.pieces).to(topo.device)
        self.device, self.rows, self.doc_mask = topo.device, cfg.micro_batch, cfg.doc_mask
        self.count = 1  # micro-batches a step: the step measured sets it

    def micro_batches(self, step: int):
        tokens = len(self.positions)
        opens = np.zeros((self.rows, tokens), dtype=bool) if self.doc_mask else None
        if opens is not None and self.pieces[0][0] == 0:
            opens[:, 0] = True
        for _ in range(self.count):
            x = torch.zeros(self.rows, tokens, dtype=torch.long, device=self.device)
            yield x, x, opens


@dataclasses.dataclass
class Measured:
    """What one measured step found."""
    peak: dict[str, float]  # GB: "Total", and each kind of tensor at the peak
    collectives: Collectives
    grads_gb: float  # this rank's gradients after backward (its shards: FSDP2 keeps them sharded)


def prime(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state as its first update makes it, from zero gradients."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class Measuring:
    """What a measured step calls: its micro-steps' setting (each micro-step's forward calls the modules again,
    which the tracker takes for a new step unless told: its per-module figures restart, the peak goes on), and
    after its backward (its gradients then exist)."""

    def __init__(self, tracker: StepTracker, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.tracker, self.model, self.optimizer, self.grads_gb = tracker, model, optimizer, 0.0

    def micro_steps(self, set_micro_step):
        def set_measured(model: torch.nn.Module, last: bool) -> None:
            self.tracker.reset_mod_stats()
            set_micro_step(model, last)
        return set_measured

    def after_backward(self) -> None:
        self.grads_gb = state_parts_gb(self.model, self.optimizer)["grads"]


class Tee(io.TextIOBase):
    """What is printed, printed and kept."""

    def __init__(self, stream):
        self.stream, self.kept = stream, []

    def write(self, text: str) -> int:
        self.kept.append(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


class DryRun:
    """The fake tensors the weights, the batches and the step live in, the step measured, the plan made."""

    def __init__(self, cfg, topo: Topology, accum_steps: int):
        if cfg.vocab_size is None:  # the run takes it from its data, which a dry run doesn't read
            raise UserError("a dry run reads no data: set vocab_size (the data's tokenizer's size, rounded up to 64)")
        if topo.wrap != "fsdp":
            raise UserError(f"a dry run plans FSDP2's ranks: {'one process runs unwrapped' if topo.wrap == 'none' else 'DDP'}"
                            f" is not planned (fsdp: true, at 2 ranks or more or with force_fsdp)")
        self.cfg, self.topo, self.accum_steps = cfg, topo, accum_steps
        self.start_up_lines, self.started = [], time.perf_counter()
        # fake tensors stand for every tensor made inside; the few plain ones a forward meets (a host array's
        # documents) become fake where they meet
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        with self.fake:
            self.batches = FakeBatches(cfg, topo)
        self.steps = {}  # activation checkpointing (True, False) -> Measured

    def measure(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step, set_micro_step) -> None:
        """step(micro_steps, set_micro_step, after_backward) measured with activation checkpointing as configured
        (every micro-step of the run's step), and the other way (two micro-steps, or one: the peak of the
        micro-steps past the second is the second's, which holds what the first's backward left unreduced), the
        optimizer's state primed first, as every step after the first holds it."""
        gpt = getattr(model, "module", model)
        with self.fake:
            prime(optimizer)
        configured = self.cfg.activation_checkpointing
        with self.fake, StepTracker(model, optimizer) as tracker, warnings.catch_warnings():
            # the CPU's rms_norm, bf16 rows beside a norm's fp32 weight (FSDP2 leaves vectors unwrapped): it says it
            # can't fuse, which the planned GPU's kernel does
            warnings.filterwarnings("ignore", "Mismatch dtype between input and weight")
            for checkpointing, micro_steps in ((configured, self.accum_steps), (not configured, min(self.accum_steps, 2))):
                gpt.activation_checkpointing = checkpointing
                self.batches.count = micro_steps
                tracker.restart()
                measuring = Measuring(tracker, model, optimizer)
                step(micro_steps, measuring.micro_steps(set_micro_step), measuring.after_backward)
                self.steps[checkpointing] = Measured(tracker.peak_gb(self.topo.device), tracker.collectives,
                                                     measuring.grads_gb)
        gpt.activation_checkpointing = configured

    @contextlib.contextmanager
    def start_up(self):
        """Around start-up's own prints (the parameters, the units' layout, FP8's line): kept for the plan."""
        tee = Tee(sys.stdout)
        with contextlib.redirect_stdout(tee):
            yield
        self.start_up_lines += "".join(tee.kept).splitlines()

    def report(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> dict:
        """The plan printed and written (dry_run_out, or plan.json in the checkpoint folder); returned."""
        gpt = getattr(model, "module", model)
        cost = {"seconds": time.perf_counter() - self.started, "host_peak_gb": host_peak_gb()}
        plan = figures(self.cfg, self.topo, gpt, gpt.num_params(), self.accum_steps, state_parts_gb(model, optimizer),
                       self.steps, saved, self.start_up_lines, cost)
        path = self.cfg.dry_run_out or os.path.join(self.cfg.checkpoint_dir, "plan.json")
        write(plan, path)
        print(screen(plan), flush=True)
        print(f"plan written to {path}", flush=True)
        return plan

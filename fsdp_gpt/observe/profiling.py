"""Traces and memory snapshots of chosen steps, on every rank.

profile_steps: [first, last]: torch.profiler records those steps (CPU ops; CUDA kernels on GPUs;
shapes and allocations) and writes one Chrome trace per rank into {tensorboard_dir}/profile/, named
as torch.profiler.tensorboard_trace_handler names them (rank{r}.{first step}.pt.trace.json) so that
TensorBoard's profiler plugin reads the folder; Perfetto (ui.perfetto.dev) opens each file.

memory_snapshot_steps: [first, last], CUDA only: the caching allocator's history (every allocation
with its stack) over those steps, dumped to {tensorboard_dir}/profile/memory_rank{r}.{first}.pickle
for pytorch.org/memory_viz. On CUDA an out-of-memory error dumps a snapshot too (with history when
inside the window, the allocator's segments otherwise) before the run exits. On CPU there is no
allocator history: profile_steps' trace carries the allocations instead (profile_memory).

Outside the windows a step costs two integer comparisons.
"""
import contextlib
import os
from typing import Callable

import torch

HISTORY_ENTRIES = 200_000  # allocations kept by the recorder: a few steps of a large model


class Profiling:
    def __init__(self, cfg, rank: int, device: torch.device, before_write: Callable[[str], None]):
        """before_write(what): called before a trace or snapshot is written (the watchdog gives the
        write start-up's bound: a large model's trace takes minutes, not a step's time)."""
        self.before_write = before_write
        self.trace_window = cfg.profile_steps
        self.memory_window = cfg.memory_snapshot_steps if device.type == "cuda" else None
        self.cuda, self.rank, self.dir = device.type == "cuda", rank, os.path.join(cfg.tensorboard_dir, "profile")
        self.profiler, self.recording = None, None  # the first step of the window being recorded
        if cfg.memory_snapshot_steps and not self.cuda and rank == 0:
            print("note: memory_snapshot_steps records CUDA's allocator: on CPU it is off; profile_steps' trace "
                  "holds the allocations instead", flush=True)

    def begin(self, step: int) -> None:
        """At the top of step `step` (a resumed run starts a window it resumed inside)."""
        if self.trace_window and self.profiler is None and self.trace_window[0] <= step <= self.trace_window[1]:
            activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * self.cuda
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
            self.profiler.start()
            self.traced_from = step
        if self.memory_window and self.recording is None and self.memory_window[0] <= step <= self.memory_window[1]:
            # Python stacks: C++ frames make the dump minutes long (symbolised when written)
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")
            self.recording = step

    def end(self, step: int) -> None:
        """After step `step`'s update: a window ending here is written."""
        if self.profiler is not None and step >= self.trace_window[1]:
            self._write_trace()
        if self.recording is not None and step >= self.memory_window[1]:
            self._write_history()

    def close(self) -> None:
        """After the loop: a window the run stopped inside is written as far as it got."""
        if self.profiler is not None:
            self._write_trace()
        if self.recording is not None:
            self._write_history()

    def _write_trace(self) -> None:
        self.before_write(f"writing the profile from step {self.traced_from}")
        self.profiler.stop()
        os.makedirs(self.dir, exist_ok=True)
        self.profiler.export_chrome_trace(os.path.join(self.dir, f"rank{self.rank}.{self.traced_from}.pt.trace.json"))
        self.profiler = None

    def _write_history(self) -> None:
        self.before_write(f"writing the memory snapshot from step {self.recording}")
        self._dump(f"memory_rank{self.rank}.{self.recording}.pickle")
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = None

    def _dump(self, name: str) -> str:
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, name)
        torch.cuda.memory._dump_snapshot(path)
        return path

    @contextlib.contextmanager
    def out_of_memory_snapshot(self):
        """Around the training loop: on CUDA, an out-of-memory error leaves a snapshot of this rank's
        memory behind it."""
        try:
            yield
        except torch.OutOfMemoryError:
            if self.cuda:
                print(f"rank {self.rank}: out of memory: snapshot in {self._dump(f'memory_rank{self.rank}.oom.pickle')}",
                      flush=True)
            raise

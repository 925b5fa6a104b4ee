"""Where each rank's step time goes, so that one slow rank is seen even though collectives make
every rank's wall time equal (the others wait for it inside them).

Per step, on each rank: `data`, the wall time its main thread waited for its batches (a slow disk or
loader; on CUDA the host's part alone: reading the rows, pinning them and starting their copy);
`compute`, the work the rank did itself: on CPU the main thread's CPU time (a thread blocked in a
gloo collective uses none), on CUDA the time between events recorded on the compute stream at the
step's start and end; `wait`, on CPU, the rest of the step's wall time (waiting for other ranks in
collectives, or for a core). On CUDA `wait` is not told apart: the GPU's queue runs behind the host,
so host time says nothing of it, and the compute stream's events include its own waits for FSDP's
collectives (a GPU slower than its peers then shows in every rank's compute, not in its own) and
for its batches' host-to-device copies (the loader's side stream: a slow copy shows in compute).

Nothing here waits for the device: CUDA events are only recorded during steps and read at log
steps, after the loss's .item() has waited for the device anyway.
"""
import time

import torch

COLUMNS = ("data", "compute", "wait")


class StepTimes:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._clear()

    def _clear(self) -> None:
        self.steps, self.sums, self.events = 0, dict.fromkeys(COLUMNS, 0.0), []

    def begin(self) -> None:
        """At the top of a step."""
        self.wall, self.cpu, self.data = time.perf_counter(), time.thread_time(), 0.0
        if self.cuda:
            self.events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self.events[-1][0].record()

    def batches(self, batches):
        """The step's (x, y) micro-batches, the wait for each one timed."""
        iterator = iter(batches)
        while True:
            wall, cpu = time.perf_counter(), time.thread_time()
            batch = next(iterator, None)
            self.data += time.perf_counter() - wall
            self.cpu += time.thread_time() - cpu  # the loader's own CPU time is data's, not compute's
            if batch is None:
                return
            yield batch

    def end(self) -> None:
        """After the step's update."""
        self.steps += 1
        self.sums["data"] += self.data
        if self.cuda:
            self.events[-1][1].record()
            return
        compute = time.thread_time() - self.cpu
        self.sums["compute"] += compute
        self.sums["wait"] += max(time.perf_counter() - self.wall - self.data - compute, 0.0)

    def row(self) -> list[float]:
        """This rank's mean seconds per step of each of COLUMNS since the last row (NaN: not told
        apart); called at log steps only."""
        if self.cuda and self.events:
            self.events[-1][1].synchronize()
            self.sums["compute"] = sum(start.elapsed_time(end) for start, end in self.events) / 1e3
            self.sums["wait"] = float("nan")
        steps = max(self.steps, 1)
        row = [self.sums[column] / steps for column in COLUMNS]
        self._clear()
        return row

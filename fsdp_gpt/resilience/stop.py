"""Stopping on request: SIGTERM (what schedulers send before preemption) and Ctrl-C (SIGINT).

The first of either asks every rank to stop with a checkpoint at a step boundary; a second signal
stops at once, without one (but for SIGTERM after SIGTERM). One line each, no traceback. Exit
codes: 0 after SIGTERM (the job is done as far as a scheduler is concerned), 130 after Ctrl-C
(128 + SIGINT, the shell's "interrupted").

Ranks see a signal at different moments, so they agree through a collective, at no cost to the
step: at every step boundary each rank starts an all-reduce (MAX) of its flag on a gloo group of
its own, without waiting for it, and reads the result of the one started a step earlier. Every
rank reads the same value at the same boundary, so all stop after the same step: the step after
the one the signal arrived in at the latest. No GPU sync, no wait on the host: the exchange is
long done when its result is read.
"""
import ctypes
import os
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist

REQUESTS = {1: ("SIGTERM", 0), 2: ("Ctrl-C", 130)}  # what the ranks exchange: (the name, the exit code)


def follow_the_agent() -> None:
    """Under torchrun only the agent sees Ctrl-C (each worker has a session of its own): it passes the
    first on as SIGINT and the second as SIGTERM. A worker whose agent dies without passing it on
    (a third Ctrl-C, a crash) gets SIGINT from the kernel (PR_SET_PDEATHSIG, Linux): so no worker
    outlives its launch."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGINT)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: a second Ctrl-C leaves the workers to finish their save
        pass


class StopRequest:
    def __init__(self):
        self.received = None  # "SIGTERM" or "Ctrl-C": the first request
        self.group = self.flag = self.work = self.agreed_on = None
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        if "TORCHELASTIC_RUN_ID" in os.environ:
            follow_the_agent()

    def _on_signal(self, signum, frame) -> None:
        name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        # a second signal stops at once (torchrun's agent turns a second Ctrl-C into SIGTERM), but a
        # repeated SIGTERM, which schedulers send to every process of a job, does not
        if self.received and "Ctrl-C" in (self.received, name):
            if os.environ.get("RANK", "0") == "0":
                sys.stderr.write(f"{name} after {self.received}: stopped at once, without a checkpoint "
                                 f"(--resume_from=latest continues from the last one)\n")
            sys.stderr.flush()
            os._exit(130)
        self.received = self.received or name

    def listen(self, timeout) -> None:
        """Right before the first step, on every rank (collectives): the exchange of what start-up
        received is read after the first step. `timeout`: the process group's (a new group would
        take torch's 30-minute default). Under NCCL the exchange needs gloo to reach every node too
        (GLOO_SOCKET_IFNAME where the default interface does not)."""
        # one process agrees with itself: no group, whose gloo thread would wake 100 times a second
        if dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo", timeout=timeout)
        self._exchange()

    def _exchange(self) -> None:
        mine = next((code for code, (name, _) in REQUESTS.items() if name == self.received), 0)
        # a host buffer the all-reduce writes into, read as numpy: never a wait on the GPU
        self.flag = np.array([mine], dtype=np.int32)
        if self.group is not None:
            self.work = dist.all_reduce(torch.from_numpy(self.flag), op=dist.ReduceOp.MAX, group=self.group,
                                        async_op=True)

    def agreed(self) -> str | None:
        """At a step boundary, on every rank: the request every rank agreed on ("SIGTERM" or
        "Ctrl-C"; None: go on), from the exchange started at the previous boundary."""
        if self.work is not None:
            self.work.wait()
        self.agreed_on = REQUESTS.get(int(self.flag[0]))
        self._exchange()
        return self.agreed_on and self.agreed_on[0]

    def close(self) -> int:
        """Finish the exchange in flight (every rank started as many); the exit code: the agreed
        request's, 0 for a run that ran to its end."""
        if self.work is not None:
            self.work.wait()
        return self.agreed_on[1] if self.agreed_on else 0

"""Run by test_failures.py and test_checkpoints.py: the real trainer, with one rank that hangs at the start of a chosen step
of the first attempt (HANG=stop|deadlock|io, HANG_RANK, HANG_STEP): SIGSTOPped, deadlocked on a
lock, or blocked reading a pipe nobody writes; or (HANG=slow) takes half a second more for every
step from that one on (a slow run to interrupt)."""
import os
import signal
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_fsdp  # noqa: E402
from fsdp_gpt.config_parse import parse_args  # noqa: E402
from fsdp_gpt.distributed.launch import run_entry_point  # noqa: E402


def hang(mode: str) -> None:
    if mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif mode == "deadlock":
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()
    else:
        pipe = os.path.join(tempfile.mkdtemp(), "pipe")
        os.mkfifo(pipe)
        with open(pipe) as f:  # blocks until a writer comes: none does
            f.read()


real_lr_at = train_fsdp.lr_at


def lr_at(cfg, step):
    if os.environ["HANG"] == "slow" and step >= int(os.environ["HANG_STEP"]):
        time.sleep(0.5)
    elif step == int(os.environ["HANG_STEP"]):
        hang(os.environ["HANG"])
    return real_lr_at(cfg, step)


if os.environ.get("RANK", "0") == os.environ["HANG_RANK"] and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    train_fsdp.lr_at = lr_at
run_entry_point(lambda: train_fsdp.train(parse_args(sys.argv[1:])))

"""A rank that stops costs minutes and names itself.

The loop tells the watchdog which phase it enters (start-up, a training step, an eval, a save) and
how long that phase may take: `init_timeout` for start-up, evals and saves, `collective_timeout` for
every training step but a compiled run's first (its blocks compile between its collectives, and a
rank still compiling keeps the others waiting in them: `init_timeout`); start-up says which. A
thread on every rank wakes each second; when its rank's phase overruns, or another rank has said in
the store that its own did, it

1. says in the store that a hang is being reported (every rank's thread looks each second: ranks
   a step apart at a boundary report together), and where its main thread is: waiting in a
   collective (the innermost torch.distributed frame, or the stop exchange, and the trainer's
   lines that led there) or stuck elsewhere;
2. waits a few seconds for the other ranks' answers; the lowest rank that answered prints one
   line: the step, the phase, who waits in which collective, who did not arrive (stuck at a line,
   or no answer: stopped, dead or unreachable);
3. writes every thread's Python stack (faulthandler) to CHECKPOINT_DIR/hang/, and on NCCL the
   flight recorder's last collectives beside them, giving the filesystem a few seconds (the
   hang may be the filesystem's: the line is out first);
4. leaves with exit 1, so that torchrun stops the others and, with --max-restarts, restarts the
   job (--resume_from=latest continues from the newest checkpoint).

The watchdog talks to the store through a connection of its own that gives up in seconds (the
store's host may be the rank that stopped). The process group's own timeout (NCCL's watchdog,
gloo's) is a backstop set past every phase's bound: the reporting thread fires first. On NCCL a
waiting rank may sit at its next host sync rather than inside the collective's call: its line
then reads "stuck at" that sync, and the flight recorder names the collective.
"""
import faulthandler
import os
import sys
import tempfile
import threading
import time
from datetime import timedelta

import torch

from fsdp_gpt.compat import flight_recorder_buffer_variable

FIRED = threading.Event()  # set while a hang is reported: the process ends through the watchdog, not its main thread
TICK = 1.0  # seconds between the thread's looks at the clock (and at the store's "fired" key)
ANSWER_WAIT = 10.0  # seconds a rank waits for the others' answers before it reports
STORE_TIMEOUT = timedelta(seconds=5)  # the watchdog's own store connection gives up after this
WRITE_WAIT = 5.0  # seconds the stacks' writes may take before the process leaves without them
BACKSTOP = 60  # seconds past the longest bound at which the process group's own timeout fires
# the trainer's own code: the package and the entry points beside it (lines are named from here)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCH_DISTRIBUTED = os.path.join(os.path.dirname(torch.__file__), "distributed")
STOP_EXCHANGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stop.py")


def process_group_timeout(cfg) -> timedelta:
    """The backstop: collectives and the store give up past every phase's bound."""
    return timedelta(seconds=max(cfg.init_timeout, cfg.collective_timeout) + BACKSTOP)


def nccl_failure_settings(run_dir: str) -> dict[str, str]:
    """Environment for NCCL's process group, read when it is made: a timeout tears the process down
    (so torchrun restarts the job), and the flight recorder keeps each rank's last 2000 collectives
    and dumps them into the run's folder on a timeout (the dump file by its old and new names; the
    buffer by the one name this torch reads without a warning)."""
    prefix = os.path.join(os.path.abspath(run_dir), "hang", "flight_recorder_rank")
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            flight_recorder_buffer_variable(): "2000",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix, "TORCH_FR_DUMP_TEMP_FILE": prefix}


def where(frame) -> str:
    """Where a thread is, in words: in which collective (and the trainer's lines that led there,
    innermost first), or the innermost line of the trainer's own code."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    ours = [f for f in frames if f.f_code.co_filename.startswith(ROOT)]
    lines = [f"{os.path.relpath(f.f_code.co_filename, ROOT)}:{f.f_lineno}" for f in ours[:3]]
    collective = next((f.f_code.co_name for f in frames if f.f_code.co_filename.startswith(TORCH_DISTRIBUTED)), None)
    if any(f.f_code.co_filename == STOP_EXCHANGE for f in frames):
        collective = "the stop exchange's all_reduce"  # a wait on its gloo work: no Python frame of torch's
    if collective is not None:
        return f"waits in {collective} ({' < '.join(lines)})"
    if not ours:
        return "stuck outside the trainer's code"
    return f"stuck at {lines[0]} in {ours[0].f_code.co_name}"


def own_store(store):
    """A connection of the watchdog's own to the group's store, that gives up in seconds: the main
    thread may hold the group's, and the store's host may be the rank that stopped. A process
    group of one has its store in this process."""
    if "MASTER_ADDR" not in os.environ:
        return store
    import torch.distributed as dist
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=STORE_TIMEOUT, wait_for_workers=False)


class Watchdog:
    def __init__(self, topo, cfg):
        self.rank, self.world, self.device = topo.rank, topo.world_size, topo.device
        self.init_timeout, self.collective_timeout = cfg.init_timeout, cfg.collective_timeout
        self.compiles = cfg.compile  # the first step compiles each block (and the loss) on its way
        self.dir, self.attempt = os.path.join(cfg.checkpoint_dir, "hang"), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.store = own_store(topo.store)
        self.prefix = f"watchdog/{self.attempt}/"
        self.phase = None  # (what, bound in seconds, its config key, started at)
        self.main = threading.main_thread().ident
        self._stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="watchdog").start()

    def arm(self, what: str) -> None:
        """Enter a phase bounded by init_timeout: start-up, the resume, an eval, a save."""
        self.phase = (what, self.init_timeout, "init_timeout", time.monotonic())

    def arm_step(self, step: int, first: bool) -> None:
        """Enter a training step: bounded by collective_timeout, but the first of a compiled run
        (init_timeout: compilation between its collectives)."""
        self.phase = (f"step {step}", *((self.init_timeout, "init_timeout") if first and self.compiles
                                        else (self.collective_timeout, "collective_timeout")), time.monotonic())

    def bounds(self) -> str:
        """The start-up line: after how long a hang in each phase is named."""
        steps = (f"in a training step, init_timeout={self.init_timeout:g} s in the first (its blocks compile between "
                 f"its collectives)," if self.compiles else
                 f"in any training step (the first included: nothing compiles), init_timeout={self.init_timeout:g} s")
        return f"watchdog: a hang is named after collective_timeout={self.collective_timeout:g} s {steps} in " \
               f"start-up, an eval or a save"

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(TICK):
            phase = self.phase
            if phase and (time.monotonic() - phase[3] > phase[1] or self._another_fired()):
                self._report(*phase[:3])

    def _another_fired(self) -> bool:
        try:
            return self.store.check([f"{self.prefix}fired"])
        except Exception:  # noqa: BLE001 - the store unreachable: this rank's own bound still holds
            return False

    def _report(self, what: str, bound: float, key: str) -> None:
        FIRED.set()  # peers that leave first break this rank's collectives: its main thread stays quiet
        try:
            self._say(what, bound, key)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    def _say(self, what: str, bound: float, key: str) -> None:
        with tempfile.TemporaryFile("w+") as f:  # local: the stacks as they are now
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.seek(0)
            stacks = f.read()
        mine = where(sys._current_frames().get(self.main))
        answers = self._gather(mine)
        if answers is not None:  # the lowest rank that answered speaks for all
            waiting = [r for r, a in answers.items() if a.startswith("waits")]
            stuck = {r: a for r, a in answers.items() if not a.startswith("waits")}
            silent = [r for r in range(self.world) if r not in answers]
            parts = [f"rank {r} {answers[r]}" for r in waiting[:4]] + (["..."] if len(waiting) > 4 else [])
            parts += [f"rank {r} did not arrive: {a}" for r, a in stuck.items()]
            if silent:
                parts.append(f"{'rank' if len(silent) == 1 else 'ranks'} {', '.join(map(str, silent))} did not "
                             f"arrive: no answer (stopped, dead or unreachable)")
            if not stuck and not silent:
                parts.append("every rank waits: mismatched collectives (each rank's stack shows its own)")
            sys.stderr.write(f"error: {what} overran {key}={bound:g} s: {'; '.join(parts)}. Stacks: "
                             f"{self.dir}/stacks_rank*_attempt{self.attempt}.txt\n")
            sys.stderr.flush()
        writer = threading.Thread(target=self._write, args=(stacks,), daemon=True)
        writer.start()
        writer.join(WRITE_WAIT)

    def _write(self, stacks: str) -> None:
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(self.dir, f"stacks_rank{self.rank}_attempt{self.attempt}.txt"), "w") as f:
            f.write(stacks)
        self._dump_flight_recorder()

    def _gather(self, mine: str) -> dict[int, str] | None:
        """Post where this rank is and wait up to ANSWER_WAIT for the others. The lowest rank that
        answered gets {rank: where it is} of every rank that did; the others get None. When the
        store is gone (its host, rank 0 outside torchrun, was the one that stopped), each rank
        speaks for itself."""
        prefix = self.prefix
        keys = {r: f"{prefix}{r}" for r in range(self.world)}
        try:
            self.store.set(f"{prefix}fired", "")  # the others report now, wherever their own bounds are
            self.store.set(keys[self.rank], mine)
            answered, deadline = set(), time.monotonic() + ANSWER_WAIT
            while len(answered) < self.world and time.monotonic() < deadline:
                answered |= {r for r, k in keys.items() if r not in answered and self.store.check([k])}
                time.sleep(0.2)
            if min(answered) != self.rank:
                self.store.set(f"{prefix}done/{self.rank}", "")  # the speaker may leave (and take the store)
                return None
            answers = {r: self.store.get(keys[r]).decode() for r in answered}
            deadline = time.monotonic() + ANSWER_WAIT
            done = [f"{prefix}done/{r}" for r in answered if r != self.rank]
            while done and not self.store.check(done) and time.monotonic() < deadline:
                time.sleep(0.1)
            return answers
        except Exception:  # noqa: BLE001 - the store's host is gone: report what this rank knows
            return {self.rank: mine}

    def _dump_flight_recorder(self) -> None:
        """NCCL's last collectives on this rank (CUDA builds only), beside the stacks."""
        dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
        if self.device.type == "cuda" and dump is not None:
            try:
                # the name NCCL's own dump takes (nccl_failure_settings), which torch's fr_trace reads
                with open(os.path.join(self.dir, f"flight_recorder_rank{self.rank}"), "wb") as f:
                    f.write(dump())
            except Exception:  # noqa: BLE001 - best effort: the line and the stacks are out already
                pass

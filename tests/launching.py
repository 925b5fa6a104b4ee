"""How the tests start the trainer and other scripts: forked from a zygote (tests/zygote.py) that
imported torch once, as torchrun would start ranks; or, where what is tested is the interpreter or
torchrun's handling of its workers, as fresh processes."""
import atexit
import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import zygote
from zygote import free_port  # noqa: F401 - the tests' name for it

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = os.path.join(ROOT, "train_fsdp.py")


def trainer_cmd(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, TRAINER]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            TRAINER]


_zygote = {}
ZYGOTE = os.path.join(ROOT, "tests", "zygote.py")


# Variables a process reads once, at its start or at its first use of a library, whose reading its
# forks inherit: glibc's allocator settings (MALLOC_*), the instruction set of ATen's own kernels
# (ATEN_CPU_CAPABILITY, at the first kernel ATen dispatches), MKL's code branch (MKL_CBWR, at its
# first call) and the zygote's own WITHOUT_TORCHAO (tests/without_torchao.py, before it imports
# anything). Each set of them gets a zygote started with them.
READ_ONCE = ("MALLOC_", "ATEN_CPU_CAPABILITY", "MKL_CBWR", "WITHOUT_TORCHAO")


def zygote_socket(read_once: tuple = ()) -> str:
    """The socket of this test process's zygote (tests/zygote.py) for these READ_ONCE settings,
    started on first use."""
    if read_once not in _zygote:
        path = os.path.join(tempfile.mkdtemp(prefix="zygote"), "socket")
        # its stdin a pipe nothing writes to: its end of file, when this process ends however, ends the zygote
        process = subprocess.Popen([sys.executable, ZYGOTE, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True,
                                   env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                                            PYTHONUNBUFFERED="1", **dict(read_once)))
        assert process.stdout.readline().strip() == "ready"
        # it holds an imported torch (~200 MB): left running, each test session's zygotes piled up
        # until the machine ran out of memory
        atexit.register(process.kill)
        atexit.register(shutil.rmtree, os.path.dirname(path), ignore_errors=True)  # its socket's folder
        _zygote[read_once] = (process, path)
    return _zygote[read_once][1]


def zygote_python() -> dict:
    """The environment under which `$PYTHON SCRIPT ARGS` runs the script forked from this test process's
    zygote (tests/zygote_python), for programs that start python themselves."""
    return dict(PYTHON=os.path.join(ROOT, "tests", "zygote_python"), ZYGOTE_INTERPRETER=sys.executable,
                ZYGOTE_SOCKET=zygote_socket())


def torchrun_forking_workers() -> tuple[list[str], dict]:
    """torchrun's options and environment under which it starts each worker as a fork of this test
    process's zygote (`--no-python tests/zygote_python`), not as a fresh interpreter that imports torch
    again (~6 CPU-seconds a worker): for tests of what torchrun does across launches (rendezvous, the
    ranks' variables). A worker's client passes SIGTERM and SIGINT on and takes its rank with it when
    killed, but a SIGSTOP stops the client alone: tests of stopped or killed workers start real ones."""
    env = zygote_python()
    return ["--no-python", env["PYTHON"]], env


def zygote_socket_for(env: dict) -> str:
    """The socket of the zygote started with env's READ_ONCE settings."""
    return zygote_socket(tuple(sorted((k, v) for k, v in env.items() if k.startswith(READ_ONCE))))


def run_in_zygote(argv: list[str], cwd: str, env: dict, nproc: int, timeout: float) -> subprocess.CompletedProcess:
    """`python argv...` on nproc ranks, forked by the zygote started with env's READ_ONCE settings."""
    reply = zygote.request(zygote_socket_for(env), argv, str(cwd), env, nproc, free_port(), timeout)
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(argv, timeout, reply["stdout"], reply["stderr"])
    return subprocess.CompletedProcess(argv, reply["returncode"], reply["stdout"], reply["stderr"])


def run_env(env: dict | None) -> dict:
    """This process's environment with a run's one thread and unbuffered output, and `env` over it
    (a value of None unsets that variable)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1") | (env or {})
    return {name: value for name, value in env.items() if value is not None}


class Spawned:
    """`python argv...` as one process forked from the zygote, for tests of what signals do to a run,
    used as a subprocess.Popen is (pid, poll, send_signal, kill, wait; as a context manager, killed if
    still running at its end). Its stdout and stderr go into the file `output` as they are written."""

    def __init__(self, argv: list[str], cwd, output, env: dict | None = None, timeout: float = 300):
        env = run_env(env)
        with open(output, "wb") as f:
            self.launched = zygote.Launched(zygote_socket_for(env), argv, str(cwd), env, 1, free_port(), timeout,
                                            fds=(f.fileno(), f.fileno()))
        self.argv, self.output, self.timeout = argv, Path(output), timeout
        self.pid, self.returncode = self.launched.pids[0], None

    def printed(self) -> str:
        return self.output.read_text(errors="replace")

    def poll(self) -> int | None:
        """Its exit code once it has ended (negative for a signal), else None."""
        if self.returncode is None and select.select([self.launched.connection], [], [], 0)[0]:
            with self.launched:
                reply = self.launched.reply()
            if reply["timed_out"]:
                raise subprocess.TimeoutExpired(self.argv, self.timeout, self.printed())
            self.returncode = reply["returncode"]
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # as Popen: nothing once it has ended, or ended and not yet answered for
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not select.select([self.launched.connection], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(self.argv, timeout, self.printed())
        return self.poll()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()
        self.wait()


def launch(argv: list[str], cwd, nproc: int = 1, env: dict | None = None, timeout: float = 300,
           launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """`python argv...` on nproc ranks: through a zygote, which starts ranks as torchrun would
    without importing torch for each, unless an explicit `launcher` command (a fresh interpreter, which
    imports the script's own package: an older worktree's, test_run_state.py) or the GPUs (which the
    zygote hides) are asked for. An `env` value of None unsets that variable."""
    env = run_env(env)
    if launcher is None and env.get("CUDA_VISIBLE_DEVICES") == "":
        return run_in_zygote(argv, str(cwd), env, nproc, timeout)
    assert "WITHOUT_TORCHAO" not in env, "only a zygote hides torchao (tests/without_torchao.py)"
    cmd = (launcher or trainer_cmd(nproc)[:-1]) + argv
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)

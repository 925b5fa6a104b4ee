"""A launcher for the tests that starts ranks without importing torch again for each of them.

Importing torch, FSDP, DCP and the trainer is ~6 CPU-seconds per process, most of a tiny test run's
cost. This server imports them once (nothing else: no thread, no collective, no CUDA), then serves
launches: for each request it forks a launcher, which forks one process per rank with the
environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), all ranks writing to one stdout and one stderr as under torchrun (the client's own,
passed with the request, or captured and sent back), and runs the script as `python script.py args`
would. When a rank fails, the others get a few seconds to notice, then are stopped, as torchrun's
agent does; when the client is gone, at once. What torchrun does to its workers (restarts, a stopped
or killed worker) is tested with torchrun's own; conftest.run_trainer uses this otherwise.

A request is one JSON line, the client's stdout and stderr attached or not; the launcher answers with
a line of the ranks' pids, then, when they have ended, a line of the reply.

    python tests/zygote.py SOCKET_PATH                          # serve
    python tests/zygote.py --run SOCKET_PATH NPROC SCRIPT ARGS  # a client that is `python SCRIPT ARGS`:
        # the ranks print into its stdout and stderr, get its SIGTERM and SIGINT, die with it, and it
        # exits as they do (tests/zygote_python: test_docs.py's python and torchrun, torchrun's workers)
"""
import contextlib
import gc
import json
import os
import runpy
import select
import shutil
import signal
import socket
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
torch = None  # imported by serve() alone: a client stays light


def run_rank(request: dict, rank: int, out_fd: int, err_fd: int) -> None:
    """In a forked process: become rank `rank` of the request's run, then run its script."""
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    for fd in {out_fd, err_fd} - {1, 2}:
        os.close(fd)
    nproc = request["nproc"]
    env = request["env"] | ({} if nproc == 1 else dict(
        RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(request["port"])))
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", os.cpu_count())))  # the OpenMP pool was sized at import
    os.chdir(request["cwd"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` sets it
    try:
        runpy.run_path(script, run_name="__main__")  # entry points leave through os._exit
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code == 1 and not isinstance(e.code, int):  # sys.exit("message"): python prints it
            print(e.code, file=sys.stderr)
    except BaseException as e:  # noqa: BLE001 - printed as the interpreter would, exit 1
        import traceback
        traceback.print_exc()
        code = 1
        if isinstance(e, KeyboardInterrupt):  # python then ends by the SIGINT itself
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def send(connection: socket.socket, message: dict) -> None:
    """A line to the client, which may be gone."""
    with contextlib.suppress(OSError):
        connection.sendall(json.dumps(message).encode() + b"\n")


def gone(connection: socket.socket) -> bool:
    """Whether the client closed its end: it has ended."""
    try:
        return bool(select.select([connection], [], [], 0)[0]) and connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:  # ECONNRESET: a client killed before it read all that was sent to it
        return True


def launch(request: dict, fds: list[int], connection: socket.socket) -> dict:
    """Fork the ranks (their pids sent to the client at once), wait for them, and return the exit code
    torchrun (or python, for one rank) would give, with what they printed unless they printed into the
    client's own `fds` (stdout, stderr). The other ranks are stopped a few seconds after one fails,
    as torchrun's agent does, and at once when the client is gone, as a killed agent's workers die."""
    with contextlib.ExitStack() as files:
        captured = [] if fds else [files.enter_context(tempfile.TemporaryFile()) for _ in range(2)]
        out, err = fds or [f.fileno() for f in captured]
        pids = []
        for rank in range(request["nproc"]):
            pid = os.fork()
            if pid == 0:
                connection.close()  # the client's end sees its close when the launcher's comes, not the ranks'
                run_rank(request, rank, out, err)
            pids.append(pid)
        for fd in fds:
            os.close(fd)  # the ranks hold them: the client's reader sees its end when theirs comes
        send(connection, {"pids": pids})
        codes, deadline, failed_at = {}, time.time() + request["timeout"], None
        while len(codes) < len(pids):
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] != 0 and failed_at is None:
                    failed_at = time.time()
                continue
            now = time.time()
            if now > deadline or (failed_at is not None and now > failed_at + 5) or gone(connection):
                for p in pids:
                    if p not in codes:
                        os.kill(p, signal.SIGKILL)
            time.sleep(0.01)
        timed_out = time.time() > deadline
        ordered = [codes[p] for p in pids]
        failures = [c for c in ordered if c != 0]
        code = ordered[0] if len(pids) == 1 else (1 if failures else 0)
        for f in captured:
            f.seek(0)
        printed = [f.read().decode(errors="replace") for f in captured] or ["", ""]
        return {"returncode": code, "stdout": printed[0], "stderr": printed[1], "timed_out": timed_out}


def request(path: str, argv: list[str], cwd: str, env: dict, nproc: int, port: int, timeout: float) -> dict:
    """Send one launch to the zygote at `path` and wait for its reply (what the ranks printed in it)."""
    with Launched(path, argv, cwd, env, nproc, port, timeout) as launched:
        return launched.reply()


def request_line(argv: list[str], cwd: str, env: dict, nproc: int, port: int, timeout: float) -> bytes:
    """A launch as the zygote reads it: one JSON line."""
    return json.dumps(dict(argv=[os.path.abspath(argv[0])] + argv[1:], cwd=cwd, env=env, nproc=nproc, port=port,
                           timeout=timeout)).encode() + b"\n"


class Launched:
    """A launch sent to the zygote at `path`: its ranks' pids at once (to signal them), its reply
    when they end. Given `fds` (stdout, stderr), the ranks print into them as they go."""

    def __init__(self, path: str, argv: list[str], cwd: str, env: dict, nproc: int, port: int, timeout: float,
                 fds: tuple[int, int] | tuple = ()):
        self.connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.connection.connect(path)
        socket.send_fds(self.connection, [request_line(argv, cwd, env, nproc, port, timeout)], list(fds))
        # unbuffered where the reply is short (nothing printed in it): what select() says of the socket
        # is then all there is to read, no line read ahead into a buffer
        self.replies = self.connection.makefile("rb", buffering=0 if fds else -1)
        self.pids = json.loads(self.replies.readline())["pids"]

    def reply(self) -> dict:
        return json.loads(self.replies.readline())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.replies.close()
        self.connection.close()


def received(connection: socket.socket) -> tuple[dict, list[int]]:
    """A request line and the file descriptors sent with it (none, or the client's stdout and stderr)."""
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 2)
    while data and not data.endswith(b"\n"):
        more = connection.recv(1 << 16)
        if not more:
            break
        data += more
    return json.loads(data), fds


def serve(path: str) -> None:
    global torch
    sys.path.insert(0, ROOT)
    if os.environ.get("WITHOUT_TORCHAO") == "1":
        from without_torchao import hide_torchao
        hide_torchao()
    import train_fsdp  # noqa: F401 - the imports every rank needs, done once here
    import torch
    import torch.utils.tensorboard  # noqa: F401 - rank 0's, imported when it logs: 0.28 CPU-seconds a run
    from fsdp_gpt.compat import float8_training
    from fsdp_gpt.distributed.float8 import torchao_float8
    try:  # fp8's torchao where it runs: 1.6 CPU-seconds a rank otherwise (a run without fp8 never reads it)
        torchao_float8() if float8_training() else None
    except ImportError:
        pass
    # what was imported, in the permanent generation: a full collection in a rank (the garbage
    # collector's own, or gc.collect) walked all of it, 0.2 s each, and touching it copied the pages
    gc.freeze()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    print("ready", flush=True)
    while True:
        if sys.stdin in select.select([server, sys.stdin], [], [])[0]:  # nothing is written: its end of file
            # the test process that started it has ended, however (killed, its atexit never run): a
            # zygote outliving it would hold its imported torch, ~200 MB, for good
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
            os._exit(0)
        connection, _ = server.accept()
        if os.fork() == 0:  # the launcher: one per request, so requests may overlap
            server.close()
            devnull = os.open(os.devnull, os.O_RDONLY)  # the ranks' stdin, not the test process's pipe
            os.dup2(devnull, 0)
            os.close(devnull)
            request, fds = received(connection)
            send(connection, launch(request, fds, connection))  # the pids, then the reply
            os._exit(0)
        connection.close()
        while True:  # reap finished launchers
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


def client(path: str, nproc: int, argv: list[str]) -> int:
    """The ranks of `python SCRIPT ARGS` as this process: they print into its stdout and stderr, get the
    SIGTERM and SIGINT it gets (torchrun's agent stops its workers so), die with it, and it ends as they do."""
    pids, early = [], []  # the ranks', and the signals that came before they were known

    def forward(signum, _frame):
        if not pids:
            early.append(signum)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
    for signum in (signal.SIGTERM, signal.SIGINT):  # before the launch: a rank may print at once
        signal.signal(signum, forward)
    launched = Launched(path, argv, os.getcwd(), dict(os.environ), nproc, free_port(), timeout=600, fds=(1, 2))
    pids.extend(launched.pids)
    for signum in early:
        forward(signum, None)
    reply = launched.reply()
    if reply["timed_out"]:
        return 124
    if reply["returncode"] < 0:  # a rank's death by a signal: this process's too, as python's exit status says
        signal.signal(-reply["returncode"], signal.SIG_DFL)
        os.kill(os.getpid(), -reply["returncode"])
    return reply["returncode"]


if __name__ == "__main__":
    if sys.argv[1] == "--run":
        sys.exit(client(sys.argv[2], int(sys.argv[3]), sys.argv[4:]))
    serve(sys.argv[1])

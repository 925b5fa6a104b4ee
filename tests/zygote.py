"""A launcher for the tests that starts ranks without importing torch again for each of them.

Importing torch, FSDP and DCP is ~2.2 CPU-seconds per process, about three quarters of a tiny
test run's cost. This server imports them once (nothing else: no thread, no collective, no CUDA),
then serves launches: for each request it forks a launcher, which forks one process per rank with
the environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), all ranks writing to one stdout and one stderr as under torchrun, and
runs the script as `python script.py args` would. When a rank fails, the others get a few seconds
to notice, then are stopped, as torchrun's agent does. What torchrun itself does (restarts,
rendezvous across launches) is tested with torchrun; conftest.run_trainer uses this otherwise.

    python tests/zygote.py SOCKET_PATH                        # serve: one JSON request per connection
    python tests/zygote.py --run SOCKET_PATH NPROC SCRIPT ARGS  # a client, as `python SCRIPT ARGS` would be
                                                                # (test_docs.py's python and torchrun)
"""
import contextlib
import gc
import json
import os
import runpy
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
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, exit 1
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch(request: dict, started=lambda pids: None) -> dict:
    """Fork the ranks (`started` told their pids), wait for them (stopping the others a few seconds
    after one fails), and return what they printed and the exit code torchrun (or python, for one
    rank) would give. A request's `output` file takes stdout and stderr as they are written instead."""
    with contextlib.ExitStack() as files:
        if request.get("output"):
            out = err = files.enter_context(open(request["output"], "wb"))
        else:
            out, err = (files.enter_context(tempfile.TemporaryFile()) for _ in "12")
        pids = []
        for rank in range(request["nproc"]):
            pid = os.fork()
            if pid == 0:
                run_rank(request, rank, out.fileno(), err.fileno())
            pids.append(pid)
        started(pids)
        codes, deadline, failed_at = {}, time.time() + request["timeout"], None
        while len(codes) < len(pids):
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] != 0 and failed_at is None:
                    failed_at = time.time()
                continue
            now = time.time()
            if now > deadline or (failed_at is not None and now > failed_at + 5):
                for p in pids:
                    if p not in codes:
                        os.kill(p, signal.SIGKILL)
            time.sleep(0.01)
        timed_out = time.time() > deadline
        ordered = [codes[p] for p in pids]
        failures = [c for c in ordered if c != 0]
        code = ordered[0] if len(pids) == 1 else (1 if failures else 0)
        printed = ["", ""]
        if not request.get("output"):
            for f in (out, err):
                f.seek(0)
            printed = [f.read().decode(errors="replace") for f in (out, err)]
        return {"returncode": code, "stdout": printed[0], "stderr": printed[1], "timed_out": timed_out}


def request(path: str, argv: list[str], cwd: str, env: dict, nproc: int, port: int, timeout: float) -> dict:
    """Send one launch to the zygote at `path` and wait for its reply."""
    with Launched(path, argv, cwd, env, nproc, port, timeout) as launched:
        return launched.reply()


class Launched:
    """A launch sent to the zygote at `path`: its ranks' pids at once (to signal them), its reply
    when they end. With an `output` file, the ranks print into it as they go."""

    def __init__(self, path: str, argv: list[str], cwd: str, env: dict, nproc: int, port: int, timeout: float,
                 output: str | None = None):
        self.connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.connection.connect(path)
        self.stream = self.connection.makefile("rwb")
        self.stream.write(json.dumps(dict(argv=[os.path.abspath(argv[0])] + argv[1:], cwd=cwd, env=env, nproc=nproc,
                                          port=port, timeout=timeout, output=output)).encode() + b"\n")
        self.stream.flush()
        self.pids = json.loads(self.stream.readline())["pids"]

    def reply(self) -> dict:
        return json.loads(self.stream.readline())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stream.close()
        self.connection.close()


def serve(path: str) -> None:
    global torch
    sys.path.insert(0, ROOT)
    if os.environ.get("WITHOUT_TORCHAO"):
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
        connection, _ = server.accept()
        if os.fork() == 0:  # the launcher: one per request, so requests may overlap
            server.close()
            with connection, connection.makefile("rwb") as stream:
                def send(message):
                    stream.write(json.dumps(message).encode() + b"\n")
                    stream.flush()
                send(launch(json.loads(stream.readline()), started=lambda pids: send({"pids": pids})))
            os._exit(0)
        connection.close()
        while True:  # reap finished launchers
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


def client(path: str, nproc: int, argv: list[str]) -> int:
    with socket.socket() as s:  # a free port for the ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reply = request(path, argv, os.getcwd(), dict(os.environ), nproc, port, timeout=600)
    sys.stdout.write(reply["stdout"])
    sys.stderr.write(reply["stderr"])
    return 124 if reply["timed_out"] else reply["returncode"]


if __name__ == "__main__":
    if sys.argv[1] == "--run":
        sys.exit(client(sys.argv[2], int(sys.argv[3]), sys.argv[4:]))
    serve(sys.argv[1])

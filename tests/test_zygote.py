"""The tests' launcher (tests/zygote.py) stands in for python: a script run through tests/zygote_python
prints as it goes, gets the SIGTERM and SIGINT its launcher gets, dies with it, and ends as python
would, so torchrun's workers and the docs' commands can be forks of the zygote."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import zygote
from conftest import zygote_python

# python's own dispositions, set here: a shell that starts the suite in the background (`&`) has its
# children ignore SIGINT, which python then keeps
SCRIPT = """import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
if sys.argv[1] == "handles":
    signal.signal(signal.SIGTERM, lambda *_: (print("SIGTERM handled", flush=True), os._exit(3)))
print(os.getpid(), flush=True)
time.sleep(60)
"""


def signalled(python: str, script, mode: str, signum: int) -> tuple[int, str, str, bool]:
    """`python script mode`, sent `signum` once it has printed its pid: (exit code, stdout after the pid,
    stderr's last line, whether the process that printed the pid has ended)."""
    proc = subprocess.Popen([python, str(script), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **zygote_python()))
    pid = int(proc.stdout.readline())
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=30)
    return proc.returncode, out, (err.strip().splitlines() or [""])[-1], ended(pid)


def ended(pid: int) -> bool:
    """Whether the process ends within 10 s (the launcher polls for a client that is gone; a loaded
    machine delays it)."""
    deadline = time.time() + 10
    while running(pid) and time.time() < deadline:
        time.sleep(0.05)
    return not running(pid)


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("mode, signum", [("handles", signal.SIGTERM), ("default", signal.SIGTERM),
                                          ("default", signal.SIGINT), ("default", signal.SIGKILL)])
def test_a_forked_script_ends_as_python_would(mode, signum, tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SCRIPT)
    forked = signalled(zygote_python()["PYTHON"], script, mode, signum)
    assert forked == signalled(sys.executable, script, mode, signum)
    assert forked[3]  # no rank left behind, also when its client was killed outright


def test_a_forked_script_exits_as_python_would(tmp_path):
    script = tmp_path / "exits.py"
    script.write_text("import sys\nprint('before', flush=True)\n"
                      "sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])\n")
    for argument in ("a message", "3"):
        forked, plain = (subprocess.run([python, str(script), argument], capture_output=True, text=True, timeout=60,
                                        env=dict(os.environ, **zygote_python()))
                         for python in (zygote_python()["PYTHON"], sys.executable))
        assert (forked.returncode, forked.stdout, forked.stderr) == (plain.returncode, plain.stdout, plain.stderr)


def test_a_client_gone_with_its_lines_unread_leaves_no_rank(tmp_path):
    # a client killed before it read the pids line resets the connection (ECONNRESET, not an end of
    # file): the launcher must take that as gone too, and stop the rank
    script = tmp_path / "sleeper.py"
    script.write_text("import os, pathlib, time\npathlib.Path('pid.part').write_text(str(os.getpid()))\n"
                      "os.replace('pid.part', 'pid')\ntime.sleep(60)\n")
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(zygote_python()["ZYGOTE_SOCKET"])
    client.sendall(zygote.request_line([str(script)], str(tmp_path), dict(os.environ), nproc=1, port=0, timeout=60))
    deadline = time.time() + 30
    while not (tmp_path / "pid").exists() and time.time() < deadline:
        time.sleep(0.05)
    pid = int((tmp_path / "pid").read_text())
    client.close()  # the pids line unread
    assert ended(pid)


def test_a_zygote_ends_with_the_test_process_that_started_it():
    # killed outright (an xdist worker lost), its atexit never runs: the zygote, ~200 MB, must not stay
    started = subprocess.run([sys.executable, "-c", "import os, signal, launching\n"
                              "socket = launching.zygote_socket()\n"
                              "print(launching._zygote[()][0].pid, socket, flush=True)\n"
                              "os.kill(os.getpid(), signal.SIGKILL)"],
                             cwd=os.path.dirname(__file__), capture_output=True, text=True, timeout=120)
    pid, socket_path = started.stdout.split()
    assert started.returncode == -signal.SIGKILL
    assert ended(int(pid)) and not os.path.exists(os.path.dirname(socket_path))

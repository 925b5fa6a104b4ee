"""The tests' launcher (tests/zygote.py) stands in for python: a script run through tests/zygote_python
prints as it goes, gets the SIGTERM and SIGINT its launcher gets, dies with it, and ends as python
would, so torchrun's workers and the docs' commands can be forks of the zygote."""
import os
import signal
import subprocess
import sys
import time

import pytest

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
    stderr's last line, whether the process that printed the pid still runs a moment later)."""
    proc = subprocess.Popen([python, str(script), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **zygote_python()))
    pid = int(proc.stdout.readline())
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=30)
    time.sleep(0.2)  # the launcher's poll of a client that is gone
    return proc.returncode, out, (err.strip().splitlines() or [""])[-1], running(pid)


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
    assert not forked[3]  # no rank left behind, also when its client was killed outright

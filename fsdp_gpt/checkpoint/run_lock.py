"""One run per checkpoint folder: rank 0 holds CHECKPOINT_DIR/run.lock while the run lives.

The lock is a small JSON file (host, pid, start, torchrun's run id and restart count, a token)
created atomically (a hard link: never two holders), and renewed by touching it every
RENEW_EVERY seconds from a thread of its own. A second run finds it and is refused in one line
naming the holder, before it reads or writes anything else in the folder.

A holder that died (SIGKILL, a lost node, a requeue, a torchrun restart) must not block the next
attempt. A hold is stale when
- its host is this one and its pid is gone (a killed process on this machine: at once);
- it is an earlier restart of this same torchrun job (torchrun stops every worker of an attempt
  before it starts the next: at once);
- it was not renewed for STALE_AFTER seconds. Age is measured on the folder's filesystem: the
  lock's modification time against that of a file just written beside it, both stamped by the
  same (file server's) clock, so hosts whose clocks differ still agree. A hold younger than that
  is watched until it is renewed (a live run: refused) or ages past STALE_AFTER (taken over).
"""
import atexit
import datetime
import json
import os
import socket
import sys
import threading
import time
import uuid

from fsdp_gpt.config import UserError

NAME = "run.lock"
RENEW_EVERY = 10.0  # seconds between the holder's touches
STALE_AFTER = 60.0  # seconds without a touch after which a holder on another host counts as dead


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except OSError:
        return True


class RunLock:
    def __init__(self, directory: str, renew_every: float = RENEW_EVERY, stale_after: float = STALE_AFTER):
        # absolute: the renewing thread keeps to this folder whatever the process's working directory becomes
        self.path = os.path.abspath(os.path.join(directory, NAME))
        self.renew_every, self.stale_after = renew_every, stale_after
        run = os.environ.get("TORCHELASTIC_RUN_ID", "")
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex,
                   "since": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
                   "run": "" if run == "none" else run, "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}
        self._stop = threading.Event()

    def acquire(self) -> str | None:
        """Hold the folder, or raise UserError naming the live holder. Returns a note when a stale
        hold was taken over."""
        note = None
        while True:
            if self._create():
                atexit.register(self.release)
                threading.Thread(target=self._renew, daemon=True, name="run-lock").start()
                return note
            holder = self._read()
            if holder is None:  # removed meanwhile, or not a lock this code wrote
                if os.path.exists(self.path) and self._unreadable_for(self.stale_after):
                    holder = {"host": "?", "pid": "?", "since": "?", "token": None}
                    reason = f"unreadable for {self.stale_after:.0f} s"
                else:
                    continue
            else:
                reason = self._stale(holder) or self._watch(holder)
            aside = f"{self.path}.stale.{self.me['token']}"
            try:  # set the stale hold aside (one taker wins the rename), then try again
                os.rename(self.path, aside)
            except FileNotFoundError:
                continue
            if (self._read(aside) or {}).get("token") != holder["token"]:
                os.link(aside, self.path)  # another taker's fresh lock, renamed by mistake: put it back
                os.remove(aside)
                continue
            os.remove(aside)
            note = (f"took over {self.path} from a dead run (host {holder['host']}, pid {holder['pid']}, since "
                    f"{holder['since']}): {reason}")

    def release(self) -> None:
        self._stop.set()
        holder = self._read()
        if holder and holder["token"] == self.me["token"]:
            os.remove(self.path)

    def _create(self) -> bool:
        tmp = f"{self.path}.{self.me['token']}"
        with open(tmp, "w") as f:
            json.dump(self.me, f)
        try:
            os.link(tmp, self.path)  # atomic, and fails where the name exists: one holder
            return True
        except FileExistsError:
            return False
        finally:
            os.remove(tmp)

    def _read(self, path: str | None = None) -> dict | None:
        try:
            with open(path or self.path) as f:
                holder = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        return holder if isinstance(holder, dict) and {"host", "pid", "since", "token"} <= holder.keys() else None

    def _unreadable_for(self, seconds: float) -> bool:
        """A file at the lock's name that is no lock (made by hand, or cut short) and stays so."""
        time.sleep(min(1.0, seconds))
        age = self._age()
        return age is not None and age > seconds and self._read() is None

    def _age(self) -> float | None:
        """Seconds since the lock was last touched, by the folder's own clock (None: it is gone)."""
        probe = f"{self.path}.probe.{self.me['token']}"
        with open(probe, "w"):
            pass
        try:
            return os.stat(probe).st_mtime - os.stat(self.path).st_mtime
        except FileNotFoundError:
            return None
        finally:
            os.remove(probe)

    def _stale(self, holder: dict) -> str | None:
        """Why the hold is stale at once, or None."""
        if holder["host"] == self.me["host"] and not _pid_alive(holder["pid"]):
            return f"its process {holder['pid']} on this host is gone"
        if self.me["run"] and holder["run"] == self.me["run"] and holder["attempt"] < self.me["attempt"]:
            return f"it was attempt {holder['attempt']} of this torchrun job, now at attempt {self.me['attempt']}"
        age = self._age()
        if age is not None and age > self.stale_after:
            return f"not renewed for {age:.0f} s"
        return None

    def _watch(self, holder: dict) -> str:
        """A young hold: a live holder renews it within RENEW_EVERY (refused), a dead one ages out."""
        try:
            touched = os.stat(self.path).st_mtime
        except FileNotFoundError:
            return "it was released"
        while True:
            time.sleep(min(1.0, self.renew_every / 4))
            try:
                if os.stat(self.path).st_mtime != touched or self._read() != holder:
                    raise UserError(f"{os.path.dirname(self.path) or '.'}/ is held by a live run: host "
                                    f"{holder['host']}, pid {holder['pid']}, since {holder['since']} ({self.path}); "
                                    f"stop that run or give this one another --checkpoint_dir")
            except FileNotFoundError:
                return "it was released"
            age = self._age()
            if age is None or age > self.stale_after:
                return f"not renewed for {self.stale_after:.0f} s"

    def _renew(self) -> None:
        while not self._stop.wait(self.renew_every):
            holder = self._read()
            if holder is None and not self._stop.is_set():  # removed by hand: hold the folder again
                self._create()
            elif holder is not None and holder["token"] != self.me["token"]:
                # taken over after this process stalled past STALE_AFTER: another run writes here now
                sys.stderr.write(f"error: {self.path} was taken over by host {holder['host']}, pid {holder['pid']} "
                                 f"while this run stalled: this run stops so that one run writes there\n")
                sys.stderr.flush()
                os._exit(1)
            else:
                os.utime(self.path)  # now, by the filesystem's clock

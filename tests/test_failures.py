"""Runs that go wrong (docs/reliability.md): a rank that stops, deadlocks or blocks costs a bound and
names itself; one run per checkpoint folder; a full disk during a save; Ctrl-C; a lost node."""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from fsdp_gpt.checkpoint import run_lock
from conftest import (DEMO, RESTARTED, ROOT, TINY, Spawned, figures, free_port, launch, overrides, run_env, run_trainer,
                      scalars, trainer_cmd)
from fsdp_gpt.config import TrainConfig, UserError
from fsdp_gpt.resilience.watchdog import Watchdog

PROBE = os.path.join(ROOT, "tests", "hang_probe.py")


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


# ---- a rank that stops, deadlocks or blocks ----
@pytest.mark.slow
@pytest.mark.parametrize("mode, step, named", [
    ("stop", 5, "rank 1 did not arrive: no answer (stopped, dead or unreachable)"),
    ("deadlock", 5, "rank 1 did not arrive: stuck at tests/hang_probe.py:"),
    # the first step of a run that compiles nothing falls under collective_timeout too
    ("io", 1, "rank 1 did not arrive: stuck at tests/hang_probe.py:")])
def test_a_hung_rank_is_named_and_every_rank_leaves(mode, step, named, corpus, tmp_path):
    started = time.monotonic()
    result = run_trainer(str(tmp_path), nproc=2, script=PROBE, check=False, timeout=120, collective_timeout=3,
                         max_iters=20, save_interval=2, env=dict(HANG=mode, HANG_RANK="1", HANG_STEP=str(step)),
                         **corpus)
    assert result.returncode == 1, result.stderr[-3000:]
    assert time.monotonic() - started < 3 + 60
    assert ("watchdog: a hang is named after collective_timeout=3 s in any training step (the first included: nothing "
            "compiles), init_timeout=900 s in start-up, an eval or a save") in result.stdout
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert errors[0].startswith(f"error: step {step} overran collective_timeout=3 s: rank 0 waits in "), errors[0]
    assert named in errors[0]
    hang = tmp_path / "ckpt" / "hang"
    stacks = sorted(os.listdir(hang))
    assert stacks == (["stacks_rank0_attempt0.txt"] if mode == "stop" else
                      ["stacks_rank0_attempt0.txt", "stacks_rank1_attempt0.txt"])
    assert "train_fsdp.py" in (hang / "stacks_rank0_attempt0.txt").read_text()  # every thread's stack
    if mode != "stop":  # the stuck rank's own stack shows where it is
        assert "in hang" in (hang / "stacks_rank1_attempt0.txt").read_text()


@pytest.mark.slow
def test_a_stopped_rank_under_torchrun_restarts_from_latest_and_finishes(uninterrupted, corpus, tmp_path):
    """SIGSTOP on rank 1 at step 7 of the first attempt: the watchdog ends it, torchrun restarts the
    job, which resumes from the step-6 checkpoint and ends as the run without the hang does."""
    run = corpus | RESTARTED | dict(collective_timeout=3)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "--max-restarts=1", PROBE]
    settings = TINY | run | dict(resume_from="latest", checkpoint_dir=str(tmp_path / "ckpt"),
                                 tensorboard_dir=str(tmp_path / "tb"))
    result = subprocess.run(launcher + [DEMO] + overrides(**settings), cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1", HANG="stop", HANG_RANK="1",
                                                  HANG_STEP="7"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "error: step 7 overran collective_timeout=3 s" in result.stderr
    assert f"resumed from {tmp_path / 'ckpt' / 'fsdp_cpt6.pth'} at step 6" in result.stdout
    expected = scalars(os.path.join(uninterrupted, "tb"), "train/loss")
    assert scalars(str(tmp_path / "tb"), "train/loss")[12] == expected[12]


def test_the_first_step_of_a_compiled_run_alone_is_bounded_by_init_timeout(tmp_path):
    """Its blocks compile between its collectives: a rank still compiling keeps the others waiting."""
    topo = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"), store=None)
    for compiles, first_bound in ((False, (300.0, "collective_timeout")), (True, (900.0, "init_timeout"))):
        watchdog = Watchdog(topo, TrainConfig(compile=compiles, checkpoint_dir=str(tmp_path)))
        watchdog.arm_step(1, first=True)
        assert watchdog.phase[1:3] == first_bound
        watchdog.arm_step(2, first=False)
        assert watchdog.phase[1:3] == (300.0, "collective_timeout")
        watchdog.close()
        assert ("init_timeout=900 s in the first (its blocks compile between its collectives)," in watchdog.bounds()) \
            == compiles


# ---- one run per checkpoint folder ----
def hold(directory, **holder) -> None:
    """A lock file as another run would have left it."""
    me = dict(host=socket.gethostname(), pid=os.getpid(), token="other", since="2026-11-24 08:00:00 UTC", run="",
              attempt=0) | holder
    with open(os.path.join(directory, run_lock.NAME), "w") as f:
        json.dump(me, f)


def test_a_live_holder_is_refused_naming_it(tmp_path):
    holder = run_lock.RunLock(str(tmp_path), renew_every=0.2)
    assert holder.acquire() is None
    with pytest.raises(UserError, match=rf"{tmp_path}/ is held by a live run: host {socket.gethostname()}, pid "
                                        rf"{os.getpid()}, since .* UTC"):
        run_lock.RunLock(str(tmp_path), renew_every=0.2, stale_after=30).acquire()
    holder.release()
    assert not os.listdir(tmp_path)
    second = run_lock.RunLock(str(tmp_path))
    assert second.acquire() is None  # released: taken at once
    second.release()


def test_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    hold(tmp_path, pid=int(dead.stdout))
    started = time.monotonic()
    lock = run_lock.RunLock(str(tmp_path), stale_after=30)
    note = lock.acquire()
    assert time.monotonic() - started < 2
    assert f"its process {dead.stdout.strip()} on this host is gone" in note
    lock.release()


def test_an_earlier_attempt_of_the_same_torchrun_job_is_taken_over_at_once(tmp_path, monkeypatch):
    hold(tmp_path, host="node-7", run="job42", attempt=0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    lock = run_lock.RunLock(str(tmp_path), stale_after=30)
    assert "it was attempt 0 of this torchrun job" in lock.acquire()
    lock.release()


def test_a_holder_on_another_host_is_judged_by_its_renewals(tmp_path):
    """Age on the folder's own clock: an old hold is taken at once; a young one is watched, and taken
    once it ages past stale_after without a renewal."""
    hold(tmp_path, host="node-7")
    old = time.time() - 100
    os.utime(tmp_path / run_lock.NAME, (old, old))
    lock = run_lock.RunLock(str(tmp_path), stale_after=60)
    assert "not renewed for 100 s" in lock.acquire()
    lock.release()  # (a lock removed under a live holder is made again: released, it is not)
    hold(tmp_path, host="node-7")
    started = time.monotonic()
    lock = run_lock.RunLock(str(tmp_path), stale_after=2)
    assert "not renewed for 2 s" in lock.acquire()
    assert 1 < time.monotonic() - started < 5
    lock.release()


@pytest.mark.slow
def test_a_second_run_into_a_held_folder_is_refused_before_it_reads_anything(corpus, tmp_path):
    (tmp_path / "ckpt").mkdir()
    # renewed every half second: the trainer refuses once it sees a renewal (a holder at the default
    # RENEW_EVERY=10 s is refused the same way, 10 s later)
    holder = run_lock.RunLock(str(tmp_path / "ckpt"), renew_every=0.5)
    holder.acquire()
    result = run_trainer(str(tmp_path), check=False, resume_from="latest", **corpus)
    holder.release()
    assert result.returncode == 2
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and f"{tmp_path / 'ckpt'}/ is held by a live run: host {socket.gethostname()}" in errors[0]
    assert os.listdir(tmp_path / "ckpt") == [] and "resumed" not in result.stdout


# ---- a failed write during a save ----
@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 3 MB (root, as on the CI machine): room for a few tiny checkpoints, not more."""
    folder = tmp_path / "disk"
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(folder)], check=True)
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=True)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_a_full_disk_during_a_save_keeps_training_and_loses_nothing_saved(kind, small_disk, corpus, tmp_path):
    """Each failed save: one line with the file, the OS's reason, the bytes needed and free; no temporary
    or partial file left; the run trains on, and its last save failing stops it (exit 1). Once space is
    freed, latest resumes from the newest complete checkpoint."""
    settings = dict(checkpoint_dir=str(small_disk), checkpoint_type=kind, max_iters=10, save_interval=2, **corpus)
    result = run_trainer(str(tmp_path), nproc=2, check=False, **settings)
    assert result.returncode == 1, result.stderr[-3000:]
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warning: writing checkpoint")]
    assert warnings and all("No space left on device (errno 28): it needs about" in w and "MB free there" in w
                            and "training goes on and the next save tries again" in w for w in warnings), warnings
    assert "the run's last save failed" in error_lines(result.stderr)[0]
    assert "Traceback" not in result.stderr
    left = sorted(os.listdir(small_disk))
    assert not [name for name in left if name.endswith(".tmp")]
    saved = sorted(int(name.split("cpt")[1].split(".")[0].split("_")[0]) for name in left
                   if name.endswith(".pth" if kind == "full" else ".complete"))
    assert saved and saved[-1] < 10
    if kind == "sharded":  # no rank file of a failed set stays behind
        assert {name.split("_rank")[0] for name in left if "_rank" in name} == {f"fsdp_sharded_cpt{s}" for s in saved}
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    resumed = run_trainer(str(tmp_path), nproc=2, resume_from="latest", tensorboard_dir=str(tmp_path / "tb2"), **settings)
    assert f"at step {saved[-1]}" in resumed.stdout.split("resumed from ")[1].splitlines()[0]


def test_a_damaged_file_is_named_with_torchs_whole_reason(tmp_path):
    """8 bytes flipped near a checkpoint's start: torch's zip reader names the record it failed on, which the
    refusal gives whole (it was cut at 120 characters: the clue may lie past them)."""
    import torch
    from fsdp_gpt.checkpoint import ckpt_format
    path = str(tmp_path / "fsdp_cpt1.pth")
    ckpt_format.save_atomically({"model": {"w": torch.randn(1000, 100)}, "step": 1}, path)
    data = bytearray(open(path, "rb").read())
    for i in range(len(data) // 1000, len(data) // 1000 + 8):
        data[i] ^= 0xFF
    open(path, "wb").write(data)
    with pytest.raises(RuntimeError) as torchs:
        torch.load(path, weights_only=True, mmap=True)
    reason = str(torchs.value).splitlines()[0]  # ~350 characters on torch 2.13 (miniz's words), 98 on 2.8
    assert "failed reading file" in reason
    with pytest.raises(ckpt_format.CorruptCheckpoint) as refused:
        ckpt_format.read_verified(path, mmap=True)
    assert str(refused.value) == f"checkpoint {path} is corrupt or truncated ({reason}); resume from an earlier checkpoint"


def test_the_os_reason_of_a_failed_write_is_named(tmp_path):
    """A file size limit (EFBIG) stands for quotas and I/O errors: the OS's reason, no temp file."""
    from fsdp_gpt.checkpoint import ckpt_format
    # in a process of its own (the limit stays with it), forked from the zygote, where torch is imported
    (tmp_path / "writer").mkdir()
    script = tmp_path / "writer" / "write.py"
    script.write_text(f"import resource, sys, torch; sys.path.insert(0, {ROOT!r}); from fsdp_gpt.checkpoint import ckpt_format\n"
                      f"resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))\n"
                      f"ckpt_format.save_atomically({{'w': torch.zeros(100_000)}}, {str(tmp_path / 'fsdp_cpt1.pth')!r})")
    result = launch([str(script)], tmp_path, timeout=60)
    assert f"WriteFailed: writing checkpoint {tmp_path / 'fsdp_cpt1.pth'} failed: File too large (errno 27)" in result.stderr
    assert os.listdir(tmp_path) == ["writer"]
    assert issubclass(ckpt_format.WriteFailed, UserError)


# ---- Ctrl-C ----
def interrupted(tmp_path, nproc: int, presses: int) -> tuple[int, str, float]:
    """The trainer (steps made slow from step 3) interrupted by `presses` Ctrl-C at step 4, as a
    terminal sends them: to torchrun's agent, or to the one process (forked from the zygote). (exit
    code, output, seconds from the first press to the end)."""
    settings = TINY | dict(max_iters=100, lr_decay_iters=100, checkpoint_dir=str(tmp_path / "ckpt"),
                           tensorboard_dir=str(tmp_path / "tb"))
    argv, hang = [PROBE, DEMO] + overrides(**settings), dict(HANG="slow", HANG_RANK="0", HANG_STEP="3")
    log = tmp_path / "output.txt"
    with contextlib.ExitStack() as stack:
        if nproc == 1:
            proc = stack.enter_context(Spawned(argv, tmp_path, log, env=hang))
        else:
            proc = subprocess.Popen(trainer_cmd(nproc)[:-1] + argv, cwd=tmp_path, stdout=stack.enter_context(open(log, "w")),
                                    stderr=subprocess.STDOUT, env=run_env(hang))
        deadline = time.time() + 120
        while 4 not in figures(str(tmp_path / "tb"), "train/loss") and time.time() < deadline:
            time.sleep(0.05)
        pressed = time.monotonic()
        for _ in range(presses):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.2)
        code = proc.wait(timeout=60)
    # torchrun's workers that outlive their agent would still be running now (the one process has
    # ended: wait() saw it, and a zygote's fork is not named after its script)
    time.sleep(0.5)
    assert not [line for line in subprocess.run(["pgrep", "-af", PROBE], capture_output=True, text=True).stdout.splitlines()
                if str(tmp_path) in line], "workers outlived the launch"
    return code, log.read_text(), time.monotonic() - pressed


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_ctrl_c_saves_the_step_and_stops_every_rank(nproc, corpus, tmp_path):
    code, output, _ = interrupted(tmp_path, nproc, presses=1)
    assert code == (130 if nproc == 1 else 1), output[-3000:]  # torchrun's agent exits 1 after its own SIGINT
    stopped = [line for line in output.splitlines() if line.startswith("Ctrl-C: stopped after step")]
    assert len(stopped) == 1, output[-3000:]
    step = int(stopped[0].split()[4])
    # pressed once step 4 is logged: the ranks agree one step after the signal's (steps take 0.5 s here;
    # the slack is the test's own polling on a loaded machine), long before the run's end at 100
    assert 4 <= step <= 10 and os.listdir(tmp_path / "ckpt") == [f"fsdp_cpt{step}.pth"]
    for noise in ("KeyboardInterrupt", "Connection closed by peer", "error:"):
        assert noise not in output
    if nproc == 1:
        assert "Traceback" not in output


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_second_ctrl_c_stops_at_once(nproc, corpus, tmp_path):
    code, output, seconds = interrupted(tmp_path, nproc, presses=2)
    assert code != 0 and seconds < 5, output[-3000:]
    second = "SIGTERM" if nproc > 1 else "Ctrl-C"  # torchrun's agent passes a second Ctrl-C on as SIGTERM
    assert output.count(f"{second} after Ctrl-C: stopped at once, without a checkpoint") == 1, output[-3000:]
    assert "Ctrl-C: stopped after step" not in output
    # no checkpoint; the run lock stays (no exit handler ran), stale at once for the next launch on this host
    assert os.listdir(tmp_path / "ckpt") == [run_lock.NAME]
    for noise in ("KeyboardInterrupt", "Connection closed by peer"):
        assert noise not in output


# ---- a lost node ----
@pytest.mark.slow
def test_a_lost_node_costs_the_steps_since_the_last_save(uninterrupted, corpus, tmp_path):
    """Two loopback "nodes" of one rank each (elastic: --nnodes=1:2, c10d rendezvous); the second is
    killed, agent and worker, after a checkpoint. The first restarts at world size 1, resumes from the
    newest checkpoint and finishes as the run without the loss does (within the parity tolerance)."""
    run = corpus | RESTARTED | dict(checkpoint_dir=str(tmp_path / "ckpt"))
    port = free_port()
    # dead nodes leave the rendezvous after 2 missed keep-alives of 1 s, and a round closes 2 s after its last join
    conf = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1", "--max-restarts=2",
                "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=lost-node", f"--rdzv_conf={conf}",
                PROBE, DEMO] + overrides(**(TINY | run | dict(resume_from="latest", tensorboard_dir=str(tmp_path / "tb"))))
    env = dict(os.environ, OMP_NUM_THREADS="1", HANG="slow", HANG_RANK="0", HANG_STEP="1")  # slow first attempt
    logs = [open(tmp_path / f"node{n}.txt", "w") for n in (0, 1)]
    nodes = []
    for log in logs:
        nodes.append(subprocess.Popen(launcher, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env))
        time.sleep(1)  # the first hosts the rendezvous' store
    deadline = time.time() + 120
    while not os.path.exists(tmp_path / "ckpt" / "fsdp_cpt2.pth") and time.time() < deadline:
        time.sleep(0.2)
    lost = nodes[1]
    workers = subprocess.run(["pgrep", "-P", str(lost.pid)], capture_output=True, text=True).stdout.split()
    # the agent first: killed after its worker, it could see the worker die and join the restart's round
    # in between, and the surviving node then waited 60 s for the dead agent's role in that round
    lost.kill()
    for pid in workers:
        os.kill(int(pid), signal.SIGKILL)  # its worker: a session of its own, outside the agent's group
    killed = time.monotonic()
    assert nodes[0].wait(timeout=240) == 0, (tmp_path / "node0.txt").read_text()[-3000:]
    output = (tmp_path / "node0.txt").read_text()
    assert "2 ranks, FULL_SHARD" in output and "1 ranks, FULL_SHARD" in output  # restarted alone
    resumed_at = int(output.split("resumed from ")[1].split(" at step ")[1].split()[0])
    assert resumed_at >= 2 and time.monotonic() - killed < 120
    expected = scalars(os.path.join(uninterrupted, "tb"), "train/loss")
    assert scalars(str(tmp_path / "tb"), "train/loss")[12] == pytest.approx(expected[12], rel=1e-4)


def test_a_lock_file_that_is_no_lock_ages_out_and_a_removed_lock_comes_back(tmp_path):
    (tmp_path / run_lock.NAME).write_text("")  # made by hand: no holder to name, no renewal
    lock = run_lock.RunLock(str(tmp_path), renew_every=0.2, stale_after=1)
    assert "unreadable for 1 s" in lock.acquire()
    os.remove(tmp_path / run_lock.NAME)  # a user cleaning up mid-run: the live run holds its folder again
    time.sleep(0.6)
    assert json.loads((tmp_path / run_lock.NAME).read_text())["token"] == lock.me["token"]
    lock.release()

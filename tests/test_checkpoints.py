"""Checkpoints: bitwise resume, resharding across world sizes and strategies, consolidation,
damaged files, preemption and killed workers."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fsdp_gpt.checkpoint import ckpt_format, ckpt_inspect
from fsdp_gpt.checkpoint.ckpt_format import save_atomically
from fsdp_gpt.config import UserError
from fsdp_gpt.model import GPT, GPTConfig
from conftest import (CANONICAL, DEMO, RESTARTED, ROOT, RUN, TINY, TRAINER, Spawned, assert_quiet, checkpoint_of, figures,
                      overrides, records, run_trainer, scalars, tool)


pytestmark = pytest.mark.slow


def resumed_losses(tmp_path, resume_from, nproc=2, **kwargs):
    result = run_trainer(str(tmp_path), nproc=nproc, resume_from=resume_from, **(RUN | kwargs))
    assert f"resumed from {resume_from} at step 3" in result.stdout
    assert_quiet(result.stderr)  # the rows read, sent to the ranks that hold them too, as quietly as trained
    return scalars(str(tmp_path / "tb"), "train/loss")


@pytest.mark.parametrize("kind", ["full", pytest.param("sharded", marks=pytest.mark.compat)])
def test_same_size_resume_is_bitwise(kind, two_rank_runs, corpus, tmp_path):
    units = dict(full="auto", sharded=1)[kind]  # as each run was laid out (conftest.CANONICAL)
    got = resumed_losses(tmp_path, checkpoint_of(two_rank_runs[kind], kind, 3), fsdp_blocks_per_unit=units, **corpus)
    expected = scalars(os.path.join(two_rank_runs[kind], "tb"), "train/loss")
    assert sorted(got) == [4, 5, 6]
    assert all(got[s] == expected[s] for s in got), (got, expected)  # bitwise


def test_force_fsdp_sharded_checkpoint_resumes_bitwise(run_of, corpus, tmp_path):
    """One process wrapped in FSDP2 (force_fsdp) saves DTensor shards and resumes them exactly."""
    forced = run_of("forced")
    got = resumed_losses(tmp_path, checkpoint_of(forced, "sharded", 3, rank=0), nproc=1, force_fsdp=True,
                         checkpoint_type="sharded", **corpus)
    expected = scalars(os.path.join(forced, "tb"), "train/loss")
    assert sorted(got) == [4, 5, 6]
    assert all(got[s] == expected[s] for s in got), (got, expected)  # bitwise


@pytest.mark.parametrize("kind", ["full", "sharded"])
@pytest.mark.parametrize("nproc, strategy", [(1, "FULL_SHARD"), (3, "FULL_SHARD"), (4, "HYBRID_SHARD")])
def test_resume_on_another_world_size_and_strategy(kind, nproc, strategy, two_rank_runs, corpus, tmp_path):
    path = checkpoint_of(two_rank_runs[kind], kind, 3)
    if kind == "sharded" and nproc == 3:  # a set is also named by its marker, as the save's line names it
        path = ckpt_format.marker_path(os.path.dirname(path), 3)
    got = resumed_losses(tmp_path, path, nproc=nproc,
                         sharding_strategy=strategy, fsdp_size=2 if strategy == "HYBRID_SHARD" else None, **corpus)
    expected = scalars(os.path.join(two_rank_runs[kind], "tb"), "train/loss")
    assert sorted(got) == [4, 5, 6]
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step


def test_one_process_checkpoint_resumes_on_two_ranks(two_rank_runs, corpus, tmp_path):
    """One process trains unwrapped; its sharded checkpoint continues under FSDP on 2 ranks."""
    one = tmp_path / "one"
    one.mkdir()
    result = run_trainer(str(one), nproc=1, checkpoint_type="sharded", **(RUN | dict(max_iters=3)), **corpus)
    assert "model not wrapped" in result.stdout
    got = resumed_losses(tmp_path, checkpoint_of(str(one), "sharded", 3, rank=0), **corpus)
    expected = scalars(os.path.join(two_rank_runs["sharded"], "tb"), "train/loss")
    assert sorted(got) == [4, 5, 6]
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step


def test_consolidated_sharded_equals_full(two_rank_runs, tmp_path):
    out = str(tmp_path / "consolidated.pth")
    marker = os.path.join(two_rank_runs["sharded"], "ckpt", "fsdp_sharded_cpt6.complete")
    tool("consolidate.py", marker, out)  # the set by the name its save's line printed, as by any rank's file
    full = torch.load(checkpoint_of(two_rank_runs["full"], "full", 6), weights_only=True)
    merged = torch.load(out, weights_only=True)
    assert merged["model"].keys() == full["model"].keys()
    for name, tensor in full["model"].items():
        assert torch.equal(merged["model"][name], tensor), name
    assert merged["optimizer"]["state"].keys() == full["optimizer"]["state"].keys()
    for name, state in full["optimizer"]["state"].items():
        for key, tensor in state.items():
            assert torch.equal(merged["optimizer"]["state"][name][key], tensor), (name, key)
    assert merged["optimizer"]["param_groups"] == full["optimizer"]["param_groups"]
    assert merged["step"] == full["step"] == 6
    assert merged["world_size"] == full["world_size"] == 2 and merged["train_state"] == full["train_state"]
    report, complete = ckpt_inspect.inspect(out)  # under the name it was given, as a resume takes it
    assert complete and report.startswith(f"{out}:\n  step         6: the state after it")
    # the tools that read a model (evaluate.py, sample.py, export_hf.py) take the marker alike
    by_marker = ckpt_format.read_model(marker)[1]
    assert by_marker.keys() == full["model"].keys()
    assert all(torch.equal(by_marker[name], tensor) for name, tensor in full["model"].items())


def test_the_last_line_names_the_newest_checkpoint_as_its_save_did(two_rank_runs):
    """A sharded set by its marker (what --resume_from and every tool take), in the save's line and the last."""
    run = two_rank_runs["sharded"]
    with open(os.path.join(run, "stdout.txt")) as f:
        out = f.read().splitlines()
    marker = os.path.join(run, "ckpt", "fsdp_sharded_cpt6.complete")
    assert f"saved checkpoint {marker}" in out
    assert out[-1] == f"done: last checkpoint {marker}, TensorBoard logs in {os.path.join(run, 'tb')}/"


def test_the_inspector_says_what_a_checkpoint_holds(two_rank_runs, corpus, tmp_path, capsys):
    """python fsdp_ckpt.py PATH: a folder's checkpoints and its newest one's fields, a full file's; the
    tokens seen are the state's, in both formats; an incomplete set and a damaged file are said to be
    (exit 1), the damage found by --verify."""
    sharded = os.path.join(two_rank_runs["sharded"], "ckpt")
    with torch.device("meta"):
        n_params = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=256)).num_params()
    lines = tool("fsdp_ckpt.py", sharded + "/").splitlines()  # exit 0: complete
    assert lines[:4] == [f"{sharded}/: 2 checkpoints", "  step 3, sharded: complete", "  step 6, sharded: complete",
                         f"the newest complete, {sharded}/fsdp_sharded_cpt6_rank0.pth (unverified: --resume_from=latest "
                         f"takes it where its checksums match, --verify checks them):"]
    fields = {line[2:15].strip(): line[15:] for line in lines[4:] if not line.startswith(" " * 15)}
    assert fields["step"] == "6: the state after it; a resume continues with step 7"
    assert fields["tokens seen"] == f"{6 * RUN['train_batch'] * TINY['block_size']:,}"
    assert fields["written by"] == "2 ranks, FULL_SHARD; sharded format"
    assert fields["model"] == f"GPT-2, 2 layers x 64 wide, 2 heads, context 32, vocabulary 256: {n_params:,} parameters"
    config = " ".join(line.strip() for line in lines if line.startswith(("  config", " " * 15)))
    assert all(f" {key}={value} " in config for key, value in dict(train_batch=24, async_save="true", seed=7).items())
    assert " dropout=" not in config and config.endswith("(the keys that differ from the defaults)")  # at its default
    assert fields["data"] == f"{corpus['data_path']}, seed 7: step 7's batch next"
    assert fields["complete"].startswith("yes: the marker and 2 of 2 rank files; its index holds every row of ")
    report, complete = ckpt_inspect.inspect(checkpoint_of(two_rank_runs["full"], "full", 3), verify=True)
    assert complete and "\n  written by   2 ranks, FULL_SHARD; full format\n" in report
    assert f"\n  tokens seen  {3 * RUN['train_batch'] * TINY['block_size']:,}\n" in report
    assert report.endswith("\n  complete     yes: one file under its final name, its checksum matches")
    # step 6's marker gone (a rank never finished), a byte of step 3's rank 1 file flipped
    damaged = str(tmp_path / "ckpt")
    shutil.copytree(sharded, damaged)
    os.remove(ckpt_format.marker_path(damaged, 6))
    flip_byte(ckpt_format.shard_path(damaged, 3, 1))
    assert ckpt_inspect.main([damaged]) == 0  # the header alone: step 3 looks complete
    capsys.readouterr()
    assert ckpt_inspect.main([damaged, "--verify"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith(f"  step 3, sharded: not complete: checkpoint {damaged}/fsdp_sharded_cpt3_rank1.pth is corrupt")
    assert out[2] == (f"  step 6, sharded: not complete: sharded checkpoint of step 6 in {damaged}/ is incomplete "
                      f"(no fsdp_sharded_cpt6.complete): some rank never finished writing it")
    assert out[3:] == ["no complete checkpoint"]
    # step 6's rank 1 file cut to half: every rank file's header is read (a resume would refuse it)
    cut = str(tmp_path / "cut")
    shutil.copytree(sharded, cut)
    with open(ckpt_format.shard_path(cut, 6, 1), "r+b") as f:
        f.truncate(os.path.getsize(ckpt_format.shard_path(cut, 6, 1)) // 2)
    assert ckpt_inspect.main([cut]) == 0  # step 3 is complete
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith(f"  step 6, sharded: not complete: checkpoint {cut}/fsdp_sharded_cpt6_rank1.pth is corrupt "
                             f"or truncated")
    assert out[3] == (f"the newest complete, {cut}/fsdp_sharded_cpt3_rank0.pth (unverified: --resume_from=latest takes "
                      f"it where its checksums match, --verify checks them):")
    # 8 bytes of the newest set's rank 1 file flipped: unverified, the newest looks complete; verified, the inspector
    # names the set a resume takes, and the resume takes it
    flipped = str(tmp_path / "flipped")
    shutil.copytree(sharded, flipped)
    for i in range(8):
        flip_byte(ckpt_format.shard_path(flipped, 6, 1), fraction=0.6 + i / 1000)
    assert ckpt_inspect.main([flipped]) == 0
    assert f"the newest complete, {flipped}/fsdp_sharded_cpt6_rank0.pth (unverified:" in capsys.readouterr().out
    assert ckpt_inspect.main([flipped, "--verify"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith(f"  step 6, sharded: not complete: checkpoint {flipped}/fsdp_sharded_cpt6_rank1.pth is corrupt")
    assert out[3] == f"the newest complete, {flipped}/fsdp_sharded_cpt3_rank0.pth (what --resume_from=latest takes):"
    resumed = run_trainer(str(tmp_path), checkpoint_dir=flipped, resume_from="latest", **corpus, **RUN)
    assert f"resumed from {flipped}/fsdp_sharded_cpt3_rank0.pth at step 3" in resumed.stdout
    # a rank's file under a name of its own, a .pth of someone else's, a full file cut to a few KB: not complete
    renamed, foreign, short = (str(tmp_path / name) for name in ("renamed.pth", "foreign.pth", "short.pth"))
    shutil.copy(ckpt_format.shard_path(sharded, 6, 1), renamed)
    torch.save({"step": 6, "model": {}}, foreign)
    Path(short).write_bytes(Path(checkpoint_of(two_rank_runs["full"], "full", 3)).read_bytes()[:5000])
    for path, why in [(renamed, f"{renamed} is rank 1's file of a sharded checkpoint of 2 ranks, not a full one: give it "
                                f"as fsdp_sharded_cpt6_rank1.pth beside the set's other files"),
                      (foreign, f"{foreign} is not a checkpoint of this trainer: no checksum was written with it"),
                      (short, f"checkpoint {short} is corrupt or truncated ([Errno 22] Invalid argument); "
                              f"resume from an earlier checkpoint")]:
        assert ckpt_inspect.main([path]) == 1
        assert capsys.readouterr().out.splitlines() == [f"{path}:", f"  complete     no: {why}"]


def test_killed_worker_restarts_from_latest(uninterrupted, corpus, tmp_path):
    """SIGKILL one of two workers mid-run under --max-restarts: the run ends as the same run without
    the kill does. The first attempt takes half a second more a step (tests/hang_probe.py's HANG=slow):
    when the step-2 checkpoint appears, 10 steps (5 s and more) are left, and the kill lands in them."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "--max-restarts=2", os.path.join(ROOT, "tests", "hang_probe.py")]
    settings = TINY | corpus | RESTARTED | dict(keep_last=2, resume_from="latest", checkpoint_dir=str(tmp_path / "ckpt"),
                                                tensorboard_dir=str(tmp_path / "tb"))
    agent = subprocess.Popen(launcher + [DEMO] + overrides(**settings), cwd=tmp_path, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env=dict(os.environ, OMP_NUM_THREADS="1", HANG="slow", HANG_RANK="0", HANG_STEP="1"))
    deadline = time.time() + 120
    while not os.path.exists(tmp_path / "ckpt" / "fsdp_cpt2.pth") and time.time() < deadline:
        time.sleep(0.2)
    workers = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
    assert workers, "no worker processes found"
    os.kill(int(workers[-1]), signal.SIGKILL)
    output = agent.communicate(timeout=240)[0]
    assert agent.returncode == 0, output[-3000:]
    assert "resumed from" in output
    expected = scalars(os.path.join(uninterrupted, "tb"), "train/loss")
    assert scalars(str(tmp_path / "tb"), "train/loss")[12] == expected[12]


def running_until(proc: Spawned, done, seconds: float = 120) -> None:
    """Wait while `proc` runs until done() holds."""
    deadline = time.time() + seconds
    while not done():
        assert proc.poll() is None and time.time() < deadline, proc.printed()[-3000:]
        time.sleep(0.01)


def test_sigterm_saves_the_current_step_and_exits_zero(corpus, tmp_path):
    # one thread, as the runs it is compared with (CPU kernels split their sums by thread)
    with Spawned([TRAINER, DEMO] + overrides(**(TINY | corpus | dict(
            max_iters=100, lr_decay_iters=100, checkpoint_dir=str(tmp_path / "ckpt"),
            tensorboard_dir=str(tmp_path / "tb")))), tmp_path, tmp_path / "output.txt") as proc:
        running_until(proc, lambda: "\nstep 3/" in proc.printed())
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    output = proc.printed()
    assert code == 0, output
    saved = [n for n in os.listdir(tmp_path / "ckpt") if n.endswith(".pth")]
    assert len(saved) == 1
    stopped_at = int(saved[0][len("fsdp_cpt"):-len(".pth")])
    assert f"SIGTERM: stopped after step {stopped_at}" in output and 3 <= stopped_at < 100
    assert f"step {stopped_at}/100 | val loss" not in output  # the save comes first, no eval
    # resume to stopped_at + 2 against a run that went there without stopping
    common = TINY | corpus | dict(lr_decay_iters=100, max_iters=stopped_at + 2)
    run_trainer(str(tmp_path), resume_from="latest", **common)
    whole = tmp_path / "whole"
    whole.mkdir()
    run_trainer(str(whole), **common)
    got, expected = (scalars(str(d / "tb"), "train/loss") for d in (tmp_path, whole))
    assert all(got[s] == expected[s] for s in (stopped_at + 1, stopped_at + 2))


def flip_byte(path, fraction=0.6):
    with open(path, "r+b") as f:
        f.seek(int(os.path.getsize(path) * fraction))
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("config, layout", [({}, "not wrapped"), ({"force_fsdp": True}, "FULL_SHARD"),
                                            ({"cpu_offload": True}, "FULL_SHARD")])
def test_the_inspector_says_how_one_process_trained(config, layout):
    """One process trains the plain model unless force_fsdp or cpu_offload wraps it (launch.wrapping)."""
    written = ckpt_inspect._writer({"world_size": 1}, "full", {"sharding_strategy": "FULL_SHARD"} | config)
    assert written == f"1 rank, {layout}; full format"


def test_damaged_checkpoints_refused_and_latest_falls_back(corpus, tmp_path):
    run_trainer(str(tmp_path), checkpoint_type="sharded", max_iters=6, save_interval=2, keep_last=2, **corpus)
    directory = tmp_path / "ckpt"
    assert sorted(os.listdir(directory)) == [  # keep_last pruned step 2
        "fsdp_sharded_cpt4.complete", "fsdp_sharded_cpt4_rank0.pth", "fsdp_sharded_cpt6.complete",
        "fsdp_sharded_cpt6_rank0.pth"]
    shutil.copy(directory / "fsdp_sharded_cpt6_rank0.pth", directory / "fsdp_sharded_cpt8_rank0.pth")  # no marker
    flip_byte(directory / "fsdp_sharded_cpt6_rank0.pth")
    with pytest.raises(UserError, match="fsdp_sharded_cpt6_rank0.pth is corrupt: its checksum"):
        ckpt_format.read_sharded(str(directory), 6)
    result = run_trainer(str(tmp_path), checkpoint_type="sharded", max_iters=7, resume_from="latest",
                         tensorboard_dir=str(tmp_path / "tb2"), **corpus)
    assert "skipping a damaged checkpoint: checkpoint" in result.stdout
    assert (f"skipping an incomplete checkpoint: sharded checkpoint of step 8 in {directory}/ is incomplete (no "
            f"fsdp_sharded_cpt8.complete): some rank never finished writing it") in result.stdout
    assert f"resumed from {directory / 'fsdp_sharded_cpt4_rank0.pth'} at step 4" in result.stdout
    # a set that mixes steps: step 4's file where step 6's should be
    os.replace(directory / "fsdp_sharded_cpt4_rank0.pth", directory / "fsdp_sharded_cpt6_rank0.pth")
    with pytest.raises(UserError, match="mixes files of different checkpoints"):
        ckpt_format.read_sharded(str(directory), 6)


def test_bit_flip_in_full_checkpoint_is_refused(corpus, tmp_path):
    run_trainer(str(tmp_path), max_iters=2, save_interval=2, **corpus)
    path = str(tmp_path / "ckpt" / "fsdp_cpt2.pth")
    flip_byte(path)
    result = run_trainer(str(tmp_path), resume_from=path, check=False, **corpus)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert f"error: checkpoint {path} is corrupt: its checksum does not match" in result.stderr


def test_kills_during_saves_leave_every_visible_checkpoint_loadable(corpus, tmp_path):
    rng = random.Random(0)
    for attempt in range(4):
        kind = ("full", "sharded")[attempt % 2]
        with Spawned([TRAINER, DEMO] + overrides(**(TINY | corpus | dict(
                max_iters=1000, lr_decay_iters=1000, save_interval=1, checkpoint_type=kind, eval_interval=1000,
                resume_from="latest", checkpoint_dir=str(tmp_path / "ckpt"), tensorboard_dir=str(tmp_path / "tb")))),
                tmp_path, tmp_path / f"attempt{attempt}.txt") as proc:
            saved = len(ckpt_format.complete_checkpoints(str(tmp_path / "ckpt")))
            # until this launch has saved once: past start-up, into a save per step
            running_until(proc, lambda: len(ckpt_format.complete_checkpoints(str(tmp_path / "ckpt"))) > saved)
            time.sleep(rng.uniform(0.0, 1.5))
            proc.kill()
            assert proc.wait() == -signal.SIGKILL, proc.printed()[-3000:]  # killed mid-run, not ended
        directory = str(tmp_path / "ckpt")
        for name in os.listdir(directory):
            if m := ckpt_format.FULL_RE.fullmatch(name):
                ckpt_format.load_file(os.path.join(directory, name))
            elif m := ckpt_format.MARKER_RE.fullmatch(name):
                ckpt_format.read_sharded(directory, int(m.group(1)))
    newest = max(ckpt_format.complete_checkpoints(str(tmp_path / "ckpt")))
    result = run_trainer(str(tmp_path), resume_from="latest", max_iters=newest[0] + 1, lr_decay_iters=1000,
                         checkpoint_type=newest[1], **corpus)
    assert f"at step {newest[0]}" in result.stdout


def test_resharded_checkpoint_resumes_bitwise_at_the_original_size(two_rank_runs, corpus, tmp_path):
    """2-rank shards -> consolidated into one full file -> resumed on 2 ranks: bitwise."""
    out = str(tmp_path / "fsdp_cpt3.pth")
    tool("consolidate.py", checkpoint_of(two_rank_runs["sharded"], "sharded", 3), out)
    got = resumed_losses(tmp_path, out, **corpus)
    expected = scalars(os.path.join(two_rank_runs["sharded"], "tb"), "train/loss")
    assert sorted(got) == [4, 5, 6] and all(got[s] == expected[s] for s in got)


def test_resume_refuses_a_folder_with_newer_checkpoints_and_prune_keeps_new_saves(corpus, tmp_path):
    run_trainer(str(tmp_path), max_iters=6, save_interval=2, keep_last=2, **corpus)
    directory = tmp_path / "ckpt"
    assert sorted(os.listdir(directory)) == ["fsdp_cpt4.pth", "fsdp_cpt6.pth"]
    # resuming step 4 where step 6 exists: `latest` would jump back to 6 after a restart
    result = run_trainer(str(tmp_path), resume_from=str(directory / "fsdp_cpt4.pth"), max_iters=8, check=False,
                         **corpus)
    assert result.returncode == 2, result.stderr
    assert (f"error: {directory}/ holds checkpoints of steps 6, newer than the resumed step 4: move them out of "
            f"{directory}/ or set --checkpoint_dir to a new folder") in result.stderr
    # a fresh start in that folder, said at start-up: keep_last never deletes what this run wrote for older steps' sake
    # (the folder given with a slash at its end, as shells complete it: named once with its slash)
    result = run_trainer(str(tmp_path), max_iters=2, save_interval=1, keep_last=1, checkpoint_dir=f"{directory}/",
                         **corpus)
    assert (f"note: {directory}/ holds checkpoints of an earlier run (up to step 6): this run starts from scratch and "
            f"replaces those of the steps it saves; until it saves past them, --resume_from=latest would take the "
            f"newest of them") in result.stdout
    assert sorted(os.listdir(directory)) == ["fsdp_cpt2.pth", "fsdp_cpt4.pth", "fsdp_cpt6.pth"]


def test_sigterm_during_start_up_stops_after_the_first_step(corpus, tmp_path):
    """The handler is in place before data preparation and the model build; the stop saves and skips eval."""
    with Spawned([TRAINER, DEMO] + overrides(**(TINY | corpus | dict(
            max_iters=100, lr_decay_iters=100, checkpoint_dir=str(tmp_path / "ckpt"),
            tensorboard_dir=str(tmp_path / "tb")))), tmp_path, tmp_path / "output.txt") as proc:
        running_until(proc, lambda: "\n" in proc.printed())  # the first line, printed before the model is built
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    output = proc.printed()
    assert code == 0, output
    assert "SIGTERM: stopped after step 1 with its checkpoint saved" in output
    assert os.listdir(tmp_path / "ckpt") == ["fsdp_cpt1.pth"]
    assert "step 1/100 | val loss" not in output


def test_an_unexpected_error_on_one_rank_stops_every_rank_at_once(corpus, tmp_path):
    """Rank 1 fails alone while rank 0 waits in a collective: both exit non-zero within seconds,
    not after the 30-minute collective timeout."""
    result = run_trainer(str(tmp_path), nproc=2, script=os.path.join(ROOT, "tests", "crash_probe.py"), check=False,
                         timeout=120, **corpus)
    assert result.returncode != 0
    assert "KeyError: \"injected: a rank's own failure\"" in result.stderr
    assert "Connection closed by peer" in result.stderr  # rank 0 left its collective
    assert not os.path.exists(tmp_path / "ckpt" / "fsdp_cpt8.pth")


def opened_rank_files(run_dir, nproc, **settings) -> list[list[int]]:
    """Resume under tests/open_probe.py in a new run_dir: the saved ranks whose files each rank opened."""
    run_dir.mkdir()
    result = run_trainer(str(run_dir), nproc=nproc, script=os.path.join(ROOT, "tests", "open_probe.py"), **settings)
    assert "resumed from" in result.stdout
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_each_rank_opens_only_the_rank_files_it_needs(run_of, corpus, tmp_path):
    """4 ranks save a sharded set; resumed on 4 ranks each opens its own file, on 2 the two that
    hold its rows (every tensor's rows divide evenly here)."""
    directory = os.path.join(run_of("FULL_SHARD"), "ckpt")
    resume = RUN | corpus | dict(checkpoint_type="sharded", max_iters=4, save_interval=1000,
                                 resume_from=ckpt_format.shard_path(directory, 3, 0))
    assert opened_rank_files(tmp_path / "on4", 4, **resume) == [[r] for r in range(4)]
    assert opened_rank_files(tmp_path / "on2", 2, **resume) == [[2 * r, 2 * r + 1] for r in range(2)]


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "NO_SHARD", "DDP"])
def test_replicas_write_their_rows_once(strategy, run_of, corpus, tmp_path):
    """Replicated slices are written and read by one replica: the set holds each row once, the
    other replicas receive their slices on resume; the losses continue as the uninterrupted run."""
    nproc, settings = CANONICAL[strategy]
    settings = RUN | settings | corpus
    whole = run_of(strategy)
    directory = os.path.join(whole, "ckpt")
    files = [torch.load(ckpt_format.shard_path(directory, 3, r), weights_only=True) for r in range(4)]
    for name, piece in files[0]["model"].items():
        assert sum(f["model"][name]["data"].shape[0] for f in files) == piece["shape"][0], name
    opened = opened_rank_files(tmp_path / "resumed", nproc, **settings,
                               resume_from=ckpt_format.shard_path(directory, 3, 0))
    # the first replica of each slice reads it and sends it to the other replicas
    assert opened == ([[0], [1], [], []] if strategy == "HYBRID_SHARD" else [[0], [], [], []]), opened
    expected = scalars(os.path.join(whole, "tb"), "train/loss")
    got = scalars(str(tmp_path / "resumed" / "tb"), "train/loss")
    assert sorted(got) == [4, 5, 6] and all(got[s] == expected[s] for s in got), (got, expected)


def test_sets_without_an_index_still_load(two_rank_runs, corpus, tmp_path):
    """A set written before the index: every rank opens every file, and the resume is bitwise."""
    source = os.path.join(two_rank_runs["sharded"], "ckpt")
    directory = tmp_path / "old"
    directory.mkdir()
    for r in range(2):
        shutil.copy(ckpt_format.shard_path(source, 3, r), directory)
    save_atomically({"step": 3, "world_size": 2}, ckpt_format.marker_path(str(directory), 3))
    opened = opened_rank_files(tmp_path / "resumed", 2, **RUN, **corpus,
                               resume_from=ckpt_format.shard_path(str(directory), 3, 0))
    assert opened == [[0, 1], [0, 1]]
    expected = scalars(os.path.join(two_rank_runs["sharded"], "tb"), "train/loss")
    got = scalars(str(tmp_path / "resumed" / "tb"), "train/loss")
    assert sorted(got) == [4, 5, 6] and all(got[s] == expected[s] for s in got)


def test_tensorboard_shows_each_step_once_after_a_resume(corpus, tmp_path):
    """A run logged steps 1-6; resumed from its step-3 checkpoint with another learning rate, its steps
    4-6 are an abandoned stretch. TensorBoard's own reader of the folder (as its UI loads it) shows
    each step once, 4-6 with the resumed run's values; so does metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_trainer(str(tmp_path), max_iters=6, save_interval=3, **corpus)
    abandoned = scalars(str(tmp_path / "tb"), "train/loss")
    run_trainer(str(tmp_path), max_iters=6, save_interval=3, learning_rate=1e-5, min_lr=1e-6,
                checkpoint_dir=str(tmp_path / "again"),
                resume_from=str(tmp_path / "ckpt" / "fsdp_cpt3.pth"), **corpus)
    shown = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    shown.Reload()
    events = shown.Scalars("train/loss")
    assert [e.step for e in events] == [1, 2, 3, 4, 5, 6]
    # step 4's loss is computed before its update, from step 3's weights, in both runs; 5 and 6 differ
    assert all(e.value == pytest.approx(abandoned[e.step], rel=1e-6) for e in events[:4])
    assert all(e.value != pytest.approx(abandoned[e.step], rel=1e-6) for e in events[4:])
    # metrics.jsonl alike: each step once, the resumed run's records after step 3 (val at 0, 4 and 6)
    logged = [(r["kind"], r["step"]) for r in records(str(tmp_path / "tb"))]
    assert logged == [("val", 0), *(("train", s) for s in (1, 2, 3, 4)), ("val", 4), ("train", 5), ("train", 6), ("val", 6)]
    assert figures(str(tmp_path / "tb"), "train/loss") == pytest.approx({e.step: e.value for e in events}, rel=1e-6)


@pytest.mark.parametrize("written, units", [("sharded", "auto"), ("full", 1)])
def test_a_checkpoint_resumes_bitwise_under_another_unit_layout(written, units, two_rank_runs, corpus, tmp_path):
    """FSDP's units are a runtime choice (fsdp_units.py): the 2-rank run written a unit a block resumes as
    the whole model one unit (the tiny model's auto layout), and the other way, both bitwise."""
    run = two_rank_runs[written]
    got = resumed_losses(tmp_path, checkpoint_of(run, written, 3), fsdp_blocks_per_unit=units, **corpus)
    expected = scalars(os.path.join(run, "tb"), "train/loss")
    assert sorted(got) == [4, 5, 6] and all(got[s] == expected[s] for s in got), (got, expected)

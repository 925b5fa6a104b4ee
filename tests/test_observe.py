"""Seeing inside a run: every rank's time (a late rank named), profiler traces per rank, loss spikes
(named, counted, skipped on request), the figures as JSON lines, and wandb beside TensorBoard."""
import json
import math
import os
import struct
import subprocess
import sys
import time
import types

import pytest
import torch

from conftest import DEMO, ROOT, TINY, figures, overrides, records, run_trainer, scalars, written_tags
from fsdp_gpt import doc_tables
from test_bad_input import train_in_process
from fsdp_gpt.distributed import peak_flops
from fsdp_gpt.observe import metrics
from fsdp_gpt.observe.figures_file import FiguresFile
from fsdp_gpt.observe.metrics import scalar_tags
from fsdp_gpt.observe.spikes import SpikeDetector

PROBE = os.path.join(ROOT, "tests", "observe_probe.py")
sys.path.insert(0, os.path.join(ROOT, "bench"))
from spike_z import mean_std_z  # noqa: E402 - the rule the detector used before


def run_in(folder, **settings):
    os.makedirs(folder)
    return run_trainer(str(folder), **settings)


def lines(result, prefix: str) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.startswith(prefix)]


@pytest.mark.slow
def test_a_late_rank_is_named_and_traces_are_written_per_rank(corpus, tmp_path):
    # rank 1 waits 0.3 s for each batch (a slow disk); the collectives make both ranks' wall time equal
    late = run_in(tmp_path / "late", nproc=2, script=PROBE, env={"LATE_RANK": "1", "LATE_SECONDS": "0.3"},
                       max_iters=6, log_interval=3, micro_batch=4, profile_steps="[2,3]", **corpus)
    for line in lines(late, "step 3/6 | loss") + lines(late, "step 6/6 | loss"):
        assert "| slowest rank 1: " in line, line
    assert all(value == 1 for value in scalars(str(tmp_path / "late" / "tb"), "time/slowest_rank").values())
    data_max = scalars(str(tmp_path / "late" / "tb"), "time/data_ms/max")
    assert all(ms >= 300 for ms in data_max.values()), data_max
    for rank in (0, 1):  # one trace per rank, of steps 2 to 3, in the run's TensorBoard folder
        with open(tmp_path / "late" / "tb" / "profile" / f"rank{rank}.2.pt.trace.json") as f:
            events = json.load(f)["traceEvents"]
        assert any(event.get("name") == "aten::mm" for event in events)

    on_time = run_in(tmp_path / "on_time", nproc=2, script=PROBE, env={"LATE_RANK": "1", "LATE_SECONDS": "0"},
                          max_iters=6, log_interval=3, micro_batch=4, **corpus)
    assert len(lines(on_time, "step 6/6 | loss")) == 1 and not any("slowest rank" in line for line in on_time.stdout.splitlines())
    ratios = scalars(str(tmp_path / "on_time" / "tb"), "time/slowest_ratio")
    assert ratios and all(1 <= r < 1.2 for r in ratios.values()), ratios
    assert not os.path.exists(tmp_path / "on_time" / "tb" / "profile")  # no profile_steps: no trace


def model_and_moments(path) -> dict:
    saved = torch.load(path, weights_only=True)
    return saved["model"] | {f"{name}/{key}": v for name, s in saved["optimizer"]["state"].items() for key, v in s.items()}


# a batch of random tokens at step 20 on every rank: a finite spike (the model has learnt bytes of
# Python by then); a window of 10 judges from step 6 on
SPIKE = dict(script=PROBE, env={"SPIKE_STEP": "20"}, max_iters=20, lr_decay_iters=20, spike_window=10, save_interval=19)


@pytest.mark.slow
@pytest.mark.parametrize("nproc, skip", [(1, False), (2, True)])
def test_a_loss_spike_is_named_counted_and_skipped_on_request(nproc, skip, corpus, tmp_path):
    result = run_trainer(str(tmp_path), nproc=nproc, spike_skip=skip, **SPIKE, **corpus)
    named = [line for line in lines(result, "step ") if "loss spike" in line]
    assert len(named) == 1 and named[0].startswith("step 20/20 | loss"), named
    assert ("update skipped)" in named[0]) == skip
    assert scalars(str(tmp_path / "tb"), "train/spikes") == {s: int(s >= 20) for s in range(1, 21)}
    before, at = (model_and_moments(tmp_path / "ckpt" / f"fsdp_cpt{s}.pth") for s in (19, 20))
    assert any(key.endswith("/step") for key in at)  # AdamW's step counts are compared too
    unchanged = [key for key in before if torch.equal(before[key], at[key])]
    assert (unchanged == list(before)) == skip  # skipped: no parameter, moment or step count moved


def test_the_spike_window_resumes_as_it_was():
    window = SpikeDetector(torch.device("cpu"), zscore=6.0, window=8)
    window.check(1, torch.tensor(float("nan")))  # a non-finite first step (the guard's) leaves a hole
    for step in range(2, 12):
        window.check(step, torch.tensor(3.0 - 0.01 * step))
    resumed = SpikeDetector(torch.device("cpu"), zscore=6.0, window=8)
    resumed.load(window.state())
    for detector in (window, resumed):
        detector.check(12, torch.tensor(3.5))
        detector.check(13, torch.tensor(float("inf")))  # the guard's: not a spike
        detector.check(14, torch.tensor(4.5))  # still judged: the holes did not spoil the statistics
    assert [s for s, _ in window.since_last_log()] == [12, 14] and [s for s, _ in resumed.since_last_log()] == [12, 14]
    torch.testing.assert_close(window.losses, resumed.losses, rtol=0, atol=0, equal_nan=True)
    assert resumed.total() == window.total() == 2
    off = SpikeDetector(torch.device("cpu"), zscore=0.0, window=8)  # spike_zscore: 0 turns detection off
    assert not any(off.check(step, torch.tensor(float(step % 2))).item() for step in range(1, 30))
    assert off.since_last_log() == [] and off.total() == 0


def test_a_spike_while_the_loss_still_descends_is_named():
    """The new user's run: the loss falling from 5.4 to 2.8 over 79 steps (a little noise on it), then
    random tokens at step 80 (7.9). Against the window's mean and standard deviation it scored under 6
    (the descent inflated the deviation) and went unnamed; against the level just before it and the
    spread of the step-to-step changes it is named, and no step of the descent is."""
    noise = torch.randn(79, generator=torch.Generator().manual_seed(0)) * 0.03
    descent = torch.linspace(5.4, 2.8, 79) + noise
    assert mean_std_z(descent, torch.tensor(7.9)) < 6  # the old rule's miss
    detector = SpikeDetector(torch.device("cpu"), zscore=6.0, window=100)
    for step, loss in enumerate([*descent, torch.tensor(7.9)], 1):
        detector.check(step, loss)
    [(step, z)] = detector.since_last_log()
    assert step == 80 and z > 50, z


def busy(seconds: float) -> subprocess.Popen:
    """A process that keeps one core busy for `seconds` (another program installing packages)."""
    return subprocess.Popen([sys.executable, "-c", f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass"])


def test_mfu_peak_holds_under_load(tmp_path, monkeypatch, capsys):
    """A CPU's peak taken while every core is busy is about what a matmul reaches once they are free again: the peak a
    run takes, the vector bound included (2026-11-26 the timing alone: 193-197 GFLOP/s loaded, 195-202 quiet; where
    a load undercut it, 27 of 434 on 2026-11-25's machine under an older timing, the bound carries the peak; a CPU
    without one relies on the timing). Half tells the two apart with room for the suite's other worker, which trains
    beside this test on the same cores. The timing never sets the thread count (MKL's matmuls inside torch's
    parallel loops ran a quarter slower for the rest of a run that did, even to the count it had). And the run's own
    FLOP/s cap MFU at 100%."""
    def set_num_threads(n):
        raise AssertionError(f"torch.set_num_threads({n}) from the peak's timing")
    monkeypatch.setattr(torch, "set_num_threads", set_num_threads)
    loads = [busy(4.0) for _ in range(os.cpu_count() or 1)]
    time.sleep(0.5)  # the loads running before the measurement starts
    under_load, how = peak_flops.cpu_peak_flops()
    for load in loads:
        load.wait()
    quiet = max(peak_flops.timed_matmul_flops() for _ in range(3))
    assert under_load >= 0.5 * quiet, (under_load, quiet, how)

    monkeypatch.setattr(peak_flops, "vector_peak_flops", lambda threads: None)  # a CPU that names no width or clock
    monkeypatch.setattr(peak_flops, "timed_matmul_flops", lambda: 1e3)  # a measurement a busy moment undercut
    cfg = types.SimpleNamespace(max_iters=10, straggler_ratio=1.2, spike_skip=False, tensorboard_dir=str(tmp_path))
    log = metrics.ProgressLog(True, cfg, tokens_per_step=1000, flops_per_token=1000, device=torch.device("cpu"),
                              dtype=torch.float32, world_size=1)
    assert "note: MFU on the CPU is an estimate, against 0 GFLOP/s per rank" in capsys.readouterr().out
    log.start(0)
    memory = [0.1] * len(metrics.MEMORY_COLUMNS)  # one rank's GB, then its data, compute and wait seconds
    log.train(1, 2.0, 1e-3, 1.0, torch.tensor([memory + [0.0, 1.0, 0.0]]), 0, {}, [], 0)
    log.close(torch.tensor([memory]))
    assert scalars(str(tmp_path), "perf/mfu") == {1: 1.0}


def test_a_figure_reaches_the_console_by_its_row_alone(tmp_path, monkeypatch, capsys):
    """Every figure a log step has reaches TensorBoard and metrics.jsonl; the console shows those CONSOLE
    names, by its row: a maintainer's new figure (here the embedding's mean absolute gradient, an
    owner's scalar) shows once its row is added, and nothing else in the logger knows it."""
    cfg = types.SimpleNamespace(max_iters=10, straggler_ratio=1.2, spike_skip=True, tensorboard_dir=str(tmp_path))
    monkeypatch.setattr(peak_flops, "cpu_peak_flops", lambda: (1e9, "a test's peak"))
    log = metrics.ProgressLog(True, cfg, tokens_per_step=1000, flops_per_token=1000, device=torch.device("cpu"),
                              dtype=torch.float32, world_size=1)
    memory = [0.5] * len(metrics.MEMORY_COLUMNS)
    owned = {"grad/wte_abs_mean": 3.25e-4, "moe/busiest": 1.5, "moe/idle": 0.25}

    def line(step: int) -> str:
        log.start(step - 1)
        log.train(step, 2.0, 1e-3, 1.0, torch.tensor([memory + [0.0, 0.01, 0.0]]), 1, owned, [(step, 7.5)], 3)
        return next(text for text in capsys.readouterr().out.splitlines() if text.startswith(f"step {step}/10"))

    first = line(1)
    assert first.startswith("step 1/10 | loss 2.0000 | lr 1.00e-03 | ") and " tok/s | MFU " in first
    assert " | mem 0.50 GB | ETA " in first and " | skipped 1 | experts busiest 1.50x, idle 25% | " in first
    assert first.endswith(" | loss spike at step 1 (z 7.5, update skipped)") and "wte" not in first
    monkeypatch.setattr(metrics, "CONSOLE", metrics.CONSOLE + [("grad/wte_abs_mean", metrics.shown("wte |g| {:.2e}"))])
    assert line(2).endswith(" | loss spike at step 2 (z 7.5, update skipped) | wte |g| 3.25e-04")
    log.close(torch.tensor([memory]))
    assert scalars(str(tmp_path), "grad/wte_abs_mean") == pytest.approx({1: 3.25e-4, 2: 3.25e-4})  # TensorBoard keeps fp32
    assert figures(str(tmp_path), "grad/wte_abs_mean") == {1: 3.25e-4, 2: 3.25e-4}
    assert [(r["kind"], r["train/skipped_steps"], r["moe/idle"]) for r in records(str(tmp_path))] == [("train", 1, 0.25)] * 2


def test_the_slowest_rank_is_found_by_its_columns_names(monkeypatch):
    """Own time is data + compute, read by the columns' names (StepTimes' order may change), and the
    console names the rank with its parts."""
    rows = {"data": [0.01, 0.10, 0.01], "compute": [0.05, 0.06, 0.05], "wait": [0.09, 0.0, 0.09]}
    for order in (("data", "compute", "wait"), ("wait", "compute", "data")):
        monkeypatch.setattr(metrics, "TIME_COLUMNS", order)
        lag = metrics.slowest_rank(torch.tensor([rows[column] for column in order]).t())
        assert (lag.rank, lag.data_ms, lag.compute_ms) == (1, pytest.approx(100), pytest.approx(60))
        assert lag.ratio == pytest.approx(0.16 / 0.06)
    assert metrics.console_fields({"slowest": lag}) == " | slowest rank 1: 2.67x the median (data 100 ms, compute 60 ms a step)"


def test_the_logger_writes_the_tags_it_declares(tmp_path, monkeypatch):
    """ProgressLog.TAGS (docs/logging.md's table) is what the logger writes of its own: every tag it
    writes at a log step and an eval of a run with every figure (2 ranks' memory and times, a mixture's
    two sources, a multiple-choice set, a text sample) is declared, and every declared one written."""
    cfg = types.SimpleNamespace(max_iters=10, straggler_ratio=1.2, spike_skip=False, tensorboard_dir=str(tmp_path))
    monkeypatch.setattr(peak_flops, "cpu_peak_flops", lambda: (1e9, "a test's peak"))
    log = metrics.ProgressLog(True, cfg, tokens_per_step=1000, flops_per_token=1000, device=torch.device("cpu"),
                              dtype=torch.float32, world_size=2)
    memory = [0.5] * len(metrics.MEMORY_COLUMNS)
    log.start(0)
    log.train(1, 2.0, 1e-3, 1.0, torch.tensor([memory + [0.0, 0.01, 0.0]] * 2), 0, {}, [], 0)
    log.val(1, 2.5, "def f", {"web": 2.4, "code": 2.6}, {"hellaswag": {"acc": 0.3, "acc_norm": 0.35}})
    log.close(torch.tensor([memory] * 2))
    tags = written_tags(str(tmp_path))
    assert "mem/rank1/state_gb" in tags and "eval/hellaswag/acc_norm" in tags and "val/sample" in tags
    assert not doc_tables.undeclared(tags, [metrics.ProgressLog]) and not doc_tables.unwritten(tags, metrics.ProgressLog)
    assert doc_tables.undeclared(tags | {"mem/rank1/host_gb"}, [metrics.ProgressLog]) == {"mem/rank1/host_gb"}


def test_the_figures_file_holds_each_step_once_across_a_resume(tmp_path):
    """metrics.jsonl: a resumed run keeps the records up to its step and appends after them (what an
    abandoned stretch wrote past it goes, as TensorBoard's purge_step hides it); a line a killed run
    cut short is dropped; a non-finite figure is JSON's null; a fresh run starts the file anew, the
    earlier run's moved beside it."""
    run = str(tmp_path)
    first = FiguresFile(run)
    for step in (1, 2, 3):
        first.write("train", step, {"train/loss": float(step)})
    first.write("val", 3, {"val/loss": math.nan})
    first.file.write('{"step": 4, "ti')  # killed mid-line
    first.close()
    assert [(r["step"], r["kind"]) for r in records(run)] == [(1, "train"), (2, "train"), (3, "train"), (3, "val")]
    assert records(run)[-1]["val/loss"] is None and records(run)[0]["time"] <= records(run)[-1]["time"]
    resumed = FiguresFile(run, resumed_at=2)
    resumed.write("train", 3, {"train/loss": 30.0})
    resumed.close()
    assert figures(run, "train/loss") == {1: 1.0, 2: 2.0, 3: 30.0} and figures(run, "val/loss") == {}
    before = records(run)
    FiguresFile(run).close()
    assert records(run) == [] and [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl.earlier"))] == before


def test_a_fresh_run_into_an_earlier_runs_logs_replaces_them_and_says_so(corpus, tmp_path, monkeypatch, capsys):
    """TensorBoard shows the new run alone (the earlier events purged from step 0, their files kept), as
    metrics.jsonl holds it alone (the earlier one moved to metrics.jsonl.earlier)."""
    def run(max_iters: int, checkpoint_dir: str) -> list[str]:
        argv = [DEMO] + overrides(**(TINY | corpus | dict(max_iters=max_iters, eval_interval=100, save_interval=100,
                                                           checkpoint_dir=checkpoint_dir, tensorboard_dir="tb")))
        assert train_in_process(argv, tmp_path, monkeypatch) == 0
        return capsys.readouterr().out.splitlines()
    assert not any("earlier run" in line for line in run(3, "first"))
    said = run(2, "second")
    assert ("note: tb/ holds an earlier run's TensorBoard events: this run replaces them in TensorBoard's view (purged "
            "from step 0; their files stay), and its metrics.jsonl moves to metrics.jsonl.earlier; a tensorboard_dir of "
            "its own keeps both runs in view") in said
    tb = str(tmp_path / "tb")
    assert sorted(scalars(tb, "train/loss")) == [1, 2] and sorted(figures(tb, "train/loss")) == [1, 2]
    earlier = [json.loads(line) for line in open(os.path.join(tb, "metrics.jsonl.earlier"))]
    assert [r["step"] for r in earlier if r["kind"] == "train"] == [1, 2, 3]


def wandb_history(run_folder: str) -> tuple[str, dict[int, dict]]:
    """The run id and {step: scalars} of an offline wandb run's .wandb file (LevelDB-style records of
    wandb's protobufs: 32 KiB blocks, each record a 7-byte header, checksum, length and type)."""
    from wandb.proto import wandb_internal_pb2
    [name] = [n for n in os.listdir(run_folder) if n.endswith(".wandb")]
    with open(os.path.join(run_folder, name), "rb") as f:
        data = f.read()
    block, pos, pieces, run, history = 32768, 7, [], None, {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pieces.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            pieces = []
            if record.WhichOneof("record_type") == "run":
                run = record.run.run_id
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                history.setdefault(items["_step"], {}).update(items)
    return run, history


@pytest.mark.slow
def test_wandb_logs_tensorboards_scalars_and_a_resumed_run_continues_it(corpus, tmp_path):
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": None, "WANDB_RUN_ID": None}  # none of the user's
    settings = dict(wandb_project="fsdp-gpt-test", wandb_name="tiny", max_iters=4, save_interval=2, **corpus)
    run_trainer(str(tmp_path), nproc=2, env=env, **settings)
    run_trainer(str(tmp_path), env=env, **settings | dict(max_iters=6, resume_from="latest"))
    runs = sorted(os.listdir(tmp_path / "tb" / "wandb"))
    folders = [os.path.join(tmp_path, "tb", "wandb", name) for name in runs if name.startswith("offline-run-")]
    assert len(folders) == 2  # one wandb run per launch: rank 0's (the first launch had 2 ranks)
    (first_id, first), (second_id, second) = map(wandb_history, folders)
    assert first_id == second_id and folders[0].endswith(first_id)  # the resumed run continues the same wandb run
    logged = first | second
    tags = scalar_tags(str(tmp_path / "tb"))
    assert {"train/loss", "val/loss", "mem/rank1/peak_gb", "time/compute_ms/max", "train/spikes"} <= tags
    for tag in tags:  # every TensorBoard scalar, at every step it was written
        tensorboard = scalars(str(tmp_path / "tb"), tag)
        assert {step: logged[step][tag] for step in tensorboard} == pytest.approx(tensorboard), tag
    assert set(second) == {5, 6}


@pytest.mark.slow
def test_wandb_keeps_the_users_own_folder_and_run_id(corpus, tmp_path):
    """WANDB_DIR and WANDB_RUN_ID, where set, hold: nothing of wandb's beside TensorBoard's."""
    scratch = tmp_path / "scratch"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(scratch), "WANDB_RUN_ID": "mine42"}
    run_trainer(str(tmp_path), env=env, wandb_project="fsdp-gpt-test", max_iters=2, **corpus)
    [folder] = [name for name in os.listdir(scratch / "wandb") if name.startswith("offline-run-")]
    assert folder.endswith("-mine42") and wandb_history(str(scratch / "wandb" / folder))[0] == "mine42"
    assert not (tmp_path / "tb" / "wandb").exists()


def test_wandb_missing_is_one_line(corpus, tmp_path):
    result = run_trainer(str(tmp_path), script=PROBE, check=False, env={"NO_WANDB": "1"}, wandb_project="p",
                         max_iters=1, **corpus)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
        "error: wandb_project is set but wandb is not installed: pip install wandb (or unset wandb_project)")

"""What long runs need, in the real trainer: a data mixture under any world size, resumed bitwise and
resharded, its weights changed on resume; a non-finite step skipped on every rank, too many in a row
stopping the run; a WSD schedule extended past its planned end."""
import os

import pytest
import torch

from fsdp_gpt.optim import schedule
from fsdp_gpt.config import TrainConfig
from fsdp_gpt.config_parse import parse_args
from conftest import (DEMO, ROOT, RUN, TINY, checkpoint_of, evaluated, launcher_once, run_trainer, scalars, shared, tool,
                      written_tags)
from fsdp_gpt import doc_tables
from fsdp_gpt.data.loader import BatchLoader
from fsdp_gpt.data.prepare import prepare_data

STDLIB = os.path.dirname(os.__file__)


# ---- the schedules (no launch) ----

def test_schedules():
    cfg = TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_iters=10, max_iters=110, lr_decay_iters=110,
                      decay_fraction=0.2, lr_schedule="wsd")
    lr = {s: schedule.lr_at(cfg, s) for s in range(1, 111)}
    assert lr[5] == 0.5 and lr[10] == 1.0  # warmup
    assert all(lr[s] == 1.0 for s in range(10, 89))  # stable until the last 22 steps
    assert lr[89] < 1.0 and lr[110] == pytest.approx(0.1) and lr[99] == pytest.approx(1.0 - 0.9 * 11 / 22)
    cfg.decay_shape = "1-sqrt"
    assert schedule.lr_at(cfg, 99) == pytest.approx(0.1 + 0.9 * (1 - (11 / 22) ** 0.5))
    assert schedule.lr_at(cfg, 110) == pytest.approx(0.1)
    cfg.lr_schedule = "constant"
    assert schedule.lr_at(cfg, 100) == 1.0
    cfg.lr_schedule = "cosine"
    assert schedule.lr_at(cfg, 60) == pytest.approx(0.55) and schedule.lr_at(cfg, 110) == 0.1
    for key, value, message in (("lr_schedule", "linear", "lr_schedule 'linear'"),
                                ("decay_shape", "cosine", "decay_shape 'cosine'"),
                                ("decay_fraction", 1.5, "decay_fraction must be in")):
        with pytest.raises(Exception, match=message):
            parse_args([DEMO, f"--{key}={value}"])


# ---- mixtures ----

@pytest.fixture(scope="module")
def mix(tmp_path_factory) -> dict:
    """Two prepared sources, byte tokens: {"web": json's modules, "code": email's}, and run settings
    that mix them 3:1."""
    paths = {}
    for name, package in (("web", "json"), ("code", "email")):
        paths[name] = shared(tmp_path_factory, f"mix_{name}",
                             lambda folder, p=package: prepare_data(folder, [os.path.join(STDLIB, p, "*.py")], "bytes"))
    return dict(data_mix="{" + ", ".join(f"{k}: {v}" for k, v in paths.items()) + "}",
                data_weights="{web: 0.75, code: 0.25}")


@pytest.fixture(scope="module")
def mix_runs(mix, tmp_path_factory):
    return launcher_once(tmp_path_factory, "mixture", checkpoint_type="sharded", **RUN, **mix)


def logged(run_dir: str, *tags: str) -> dict:
    return {tag: scalars(os.path.join(run_dir, "tb"), tag) for tag in tags}


TAGS = ("train/loss", "train/grad_norm", "val/loss", "val/loss/web", "val/loss/code")


@pytest.mark.slow
def test_a_mixture_trains_alike_on_any_world_size(mix_runs):
    one, two = logged(mix_runs("one", 1), *TAGS), logged(mix_runs("two", 2), *TAGS)
    for tag, values in one.items():
        assert sorted(values) == sorted(two[tag]) and values, tag
        for step, value in values.items():
            assert two[tag][step] == pytest.approx(value, rel=1e-4), (tag, step)
    # 6 steps of 24 rows, 3:1: 108 web rows and 36 code rows of 32 tokens
    tags = written_tags(os.path.join(mix_runs("two", 2), "tb"))  # the loader's tags: declared, each written
    assert not doc_tables.undeclared(tags) and not doc_tables.unwritten(tags, BatchLoader)
    data = logged(mix_runs("two", 2), "data/web/tokens", "data/code/tokens", "data/web/epoch")
    assert data["data/web/tokens"][6] == 108 * 32 and data["data/code/tokens"][6] == 36 * 32
    assert 0 < data["data/web/epoch"][6] < 1
    # the val loss is the sources' mean weighted 3:1
    assert one["val/loss"][6] == pytest.approx(0.75 * one["val/loss/web"][6] + 0.25 * one["val/loss/code"][6])
    # evaluate.py reports the same figures for the checkpoint
    checkpoint = checkpoint_of(mix_runs("two", 2), "sharded", 6, rank=0)
    printed = tool("evaluate.py", checkpoint)
    for name in ("web", "code"):
        assert float(printed.split(f"| {name} ")[1].split()[0]) == pytest.approx(two[f"val/loss/{name}"][6], rel=1e-5)
    assert evaluated(checkpoint) == pytest.approx(two["val/loss"][6], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 1])
def test_a_mixture_resumes_bitwise_and_reshards(nproc, mix_runs, mix, tmp_path):
    original = mix_runs("two", 2)
    result = run_trainer(str(tmp_path), nproc=nproc, resume_from=checkpoint_of(original, "sharded", 3, rank=0),
                         checkpoint_type="sharded", **RUN, **mix)
    assert "data_weights changed" not in result.stdout
    got, expected = logged(str(tmp_path), "train/loss")["train/loss"], logged(original, "train/loss")["train/loss"]
    assert sorted(got) == [4, 5, 6]
    for step in got:
        if nproc == 2:
            assert got[step] == expected[step], step  # bitwise
        else:
            assert got[step] == pytest.approx(expected[step], rel=1e-4), step


@pytest.mark.slow
def test_weights_changed_on_resume_are_said_and_a_dropped_source_is_refused(mix_runs, mix, tmp_path):
    original = checkpoint_of(mix_runs("two", 2), "sharded", 3, rank=0)
    (tmp_path / "changed").mkdir()
    result = run_trainer(str(tmp_path / "changed"), nproc=2, resume_from=original, checkpoint_type="sharded",
                         **RUN, **(mix | dict(data_weights="{web: 0.5, code: 0.5}")))
    assert ("note: data_weights changed on resume (web 0.75 -> 0.5, code 0.25 -> 0.5): they apply from step 4 on"
            in result.stdout)
    saved = torch.load(checkpoint_of(str(tmp_path / "changed"), "sharded", 6, rank=0), weights_only=True)
    # steps 1-3 at 3:1 (54 and 18 rows), steps 4-6 at 1:1 (36 each)
    assert saved["train_state"]["data"]["mixture"]["supplied"] == {"web": 54 + 36, "code": 18 + 36}
    web_only = "{web: " + mix["data_mix"].split("web: ")[1].split(",")[0] + "}"
    (tmp_path / "dropped").mkdir()
    result = run_trainer(str(tmp_path / "dropped"), nproc=1, resume_from=original, checkpoint_type="sharded",
                         check=False, **RUN, data_mix=web_only, data_weights=None)
    assert result.returncode == 2 and [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        "error: the checkpoint's mixture reads code, which data_mix lacks: a resume may change data_weights "
        "(0 stops a source), not drop a source"]


@pytest.mark.slow
def test_a_plain_resume_after_a_change_of_train_batch_continues_its_run_bitwise(mix, tmp_path):
    """A at 8 rows a step saves at step 2; B resumes it at 16 and saves at 4 and 6; C resumes B@4 as B ran:
    C's steps 5 and 6 are B's. Weights 1 and 2: a cycle of 3 rows, which 16 rows a step do not fill (C
    restarted the pattern here once, drawing other rows unsaid)."""
    def run(name, resume_from=None, **settings):
        (tmp_path / name).mkdir()
        run_trainer(str(tmp_path / name), nproc=1, resume_from=resume_from, save_interval=2, eval_interval=100,
                    **(mix | dict(data_weights="{web: 1, code: 2}") | settings))
        return str(tmp_path / name)
    a = run("a", train_batch=8, max_iters=2)
    b = run("b", checkpoint_of(a, "full", 2), train_batch=16, max_iters=6)
    c = run("c", checkpoint_of(b, "full", 4), train_batch=16, max_iters=6)
    got, expected = logged(c, "train/loss")["train/loss"], logged(b, "train/loss")["train/loss"]
    assert sorted(got) == [5, 6] and all(got[step] == expected[step] for step in got), (got, expected)


# ---- non-finite steps ----

def nonfinite_run(run_dir, steps: str, rank: int, into: str, **settings):
    env = {"NONFINITE_STEPS": steps, "NONFINITE_RANK": str(rank), "NONFINITE_INTO": into}
    return run_trainer(str(run_dir), nproc=2, script=os.path.join(ROOT, "tests", "nonfinite_probe.py"), env=env,
                       **settings)


def states(path) -> dict:
    saved = torch.load(path, weights_only=True)
    optimizer = {f"{name}/{key}": v for name, s in saved["optimizer"]["state"].items() for key, v in s.items()}
    return saved["model"] | optimizer


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, into, rank", [("adamw", "data", 1), ("muon", "gradient", 0)])
def test_a_non_finite_step_changes_nothing_on_any_rank(optimizer, into, rank, corpus, tmp_path):
    result = nonfinite_run(tmp_path, "3", rank, into, optimizer=optimizer, max_iters=5, save_interval=1, **corpus)
    before, at, after = (states(tmp_path / "ckpt" / f"fsdp_cpt{s}.pth") for s in (2, 3, 4))
    assert before.keys() == at.keys() and any(key.endswith("/step") for key in at)  # AdamW's step counts
    assert any(key.endswith("/momentum_buffer") for key in at) == (optimizer == "muon")
    for key in before:  # the full checkpoint holds every rank's slices: none of them moved
        assert torch.equal(before[key], at[key]), key
    assert any(not torch.equal(at[key], after[key]) for key in at)  # training went on
    assert all(torch.isfinite(t).all() for s in (2, 3, 4, 5) for t in states(tmp_path / "ckpt" / f"fsdp_cpt{s}.pth").values())
    assert "| skipped 1" in next(line for line in result.stdout.splitlines() if line.startswith("step 3/5 | loss"))
    assert scalars(str(tmp_path / "tb"), "train/skipped_steps") == {1: 0, 2: 0, 3: 1, 4: 1, 5: 1}


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True])  # async: step 6's save, in flight at the stop, lands first
def test_too_many_non_finite_steps_in_a_row_stop_every_rank(async_save, corpus, tmp_path):
    result = nonfinite_run(tmp_path, "3,4,5,6,7", 1, "data", max_iters=10, save_interval=2, check=False,
                           async_save=async_save, **corpus)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    last_good = tmp_path / "ckpt" / "fsdp_cpt6.pth"
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        f"error: 5 consecutive steps up to step 7 had a non-finite loss or gradient norm and were skipped (5 in all): "
        f"stopped. Data position: the batch of step 7 (seed 7). Last good checkpoint: {last_good}"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["fsdp_cpt2.pth", "fsdp_cpt4.pth", "fsdp_cpt6.pth"]
    assert all(torch.isfinite(t).all() for s in (2, 4, 6) for t in states(tmp_path / "ckpt" / f"fsdp_cpt{s}.pth").values())


@pytest.mark.parametrize("where", ["a weight's NaN", "a moment's inf"])
def test_a_state_with_a_non_finite_value_is_never_saved(where, one_process_group, tmp_path):
    from fsdp_gpt.config import RunStopped
    from fsdp_gpt.checkpoint.fsdp_ckpt import CheckpointManager
    from fsdp_gpt.distributed.launch import Topology
    from fsdp_gpt.model import GPT, GPTConfig
    cfg = parse_args([DEMO, f"--checkpoint_dir={tmp_path}"])
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16))
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.zeros(1, 8, dtype=torch.long)
    model(tokens, tokens)[1].backward()
    optimizer.step()  # AdamW's moments exist
    manager = CheckpointManager(cfg, Topology(0, 1, 0, 1, torch.device("cpu"), "none", None))
    manager.save(1, model, optimizer)
    weight = model.blocks[0].mlp.c_fc.weight
    with torch.no_grad():
        if where == "a weight's NaN":
            weight[0, 0] = float("nan")
        else:
            optimizer.state[weight]["exp_avg"][-1, -1] = float("inf")
    with pytest.raises(RunStopped, match=f"the state after step 2 holds a non-finite value: not saved. Last good "
                                         f"checkpoint: {tmp_path}/fsdp_cpt1.pth"):
        manager.save(2, model, optimizer)
    assert sorted(os.listdir(tmp_path)) == ["fsdp_cpt1.pth", "run.lock"]  # the run holds its folder still


# ---- WSD ----

@pytest.mark.slow
def test_a_wsd_run_extended_from_its_stable_phase_is_the_longer_run(corpus, tmp_path_factory):
    """Planned for 6 steps (decay over steps 4-6), resumed from step 3 with max_iters=10: the same
    run as one planned for 10 steps from the start (its decay over steps 6-10)."""
    run = launcher_once(tmp_path_factory, "wsd", lr_schedule="wsd", decay_fraction=0.5, save_interval=3,
                        warmup_iters=2, **corpus)
    planned6, planned10 = run("six", 1, max_iters=6), run("ten", 1, max_iters=10, decay_fraction=0.4)
    extended = str(tmp_path_factory.mktemp("extended"))
    run_trainer(extended, resume_from=checkpoint_of(planned6, "full", 3), max_iters=10, lr_schedule="wsd",
                decay_fraction=0.4, save_interval=3, warmup_iters=2, **corpus)
    got, expected = (logged(d, "train/loss", "train/lr") for d in (extended, planned10))
    assert sorted(got["train/loss"]) == list(range(4, 11))
    assert all(got[tag][s] == expected[tag][s] for tag in got for s in got[tag])  # bitwise
    lr6, lr10 = logged(planned6, "train/lr")["train/lr"], expected["train/lr"]
    peak, floor = TINY["learning_rate"], TINY["min_lr"]
    assert lr6[3] == lr10[3] == pytest.approx(peak)  # the checkpoint came from the stable phase
    assert lr6[4] < peak and lr6[6] == pytest.approx(floor)  # the 6-step plan decayed over steps 4-6
    assert got["train/lr"][6] == pytest.approx(peak) and lr10[10] == pytest.approx(floor)  # the 10-step one after 6

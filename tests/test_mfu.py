"""bench/mfu.py at tiny size on the CPU: the trainer's rows and the plain loop's run, time the steps
after the first log line, and make one table of ratios; the profiler trace's split of GPU time."""
import importlib.util
import json
import os
import subprocess
import sys
import tarfile

import pytest
import torch

from conftest import ROOT, overrides, zygote_python
from fsdp_gpt import compat

sys.path.insert(0, os.path.join(ROOT, "bench"))
import mfu  # noqa: E402
from mfu import split_trace  # noqa: E402

TINY_ROW = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=256, train_batch=8, micro_batch=4,
                dtype="fp32", compile=False)


def bench_mfu(*args: str) -> subprocess.CompletedProcess:
    """bench/mfu.py and each of its rows forked from the tests' zygote (tests/zygote_python), not
    started afresh: torch imported once, not once a row."""
    env = dict(os.environ, **zygote_python())
    return subprocess.run([env["PYTHON"], os.path.join(ROOT, "bench", "mfu.py"), *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=env)


@pytest.mark.slow
def test_rows_run_and_are_tabled_against_the_plain_loop(corpus, tmp_path):
    result = bench_mfu("--rows", "gpt2_ref,gpt2,gpt2_logits_loss", "--out", str(tmp_path), "--keep",
                       str(tmp_path / "back"), *overrides(**TINY_ROW, **corpus))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = {r["row"]: r for r in json.loads((tmp_path / "results.json").read_text())}
    assert [r["result"] for r in results.values()] == ["pass"] * 3
    assert all(r["tok_s"] > 0 for r in results.values())
    table = (tmp_path / "table.md").read_text()
    for row in ("gpt2", "gpt2_logits_loss"):  # each trainer row's ratio to the reference, from this run's figures
        assert f"{results[row]['tok_s'] / results['gpt2_ref']['tok_s']:.3f}x gpt2_ref" in table
    assert "whole model compiled" in table and "n/a" in table  # MFU needs a GPU's peak
    # the trace row recorded its three steps after the timed ones (no GPU kernels in it here)
    assert os.listdir(tmp_path / "gpt2" / "tb" / "profile")
    # what a lent GPU's call brings back from $OUT: the table, the results and every row's log
    assert sorted(os.listdir(tmp_path / "back")) == ["logs.tar.gz", "results.json", "table.md"]
    with tarfile.open(tmp_path / "back" / "logs.tar.gz") as logs:
        assert sorted(logs.getnames()) == ["gpt2.log", "gpt2_logits_loss.log", "gpt2_ref.log"]


def test_a_trace_splits_into_kinds_and_idle_time(tmp_path):
    def kernel(name, ts, dur):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}
    events = [kernel("nvjet_sm90_tst_256x128_gemm", 0, 10), kernel("flash_fwd_kernel", 5, 10),  # overlapping streams
              kernel("triton_red_fused_exp_logsumexp_0", 20, 5), {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    shares, top = split_trace(str(path))
    assert shares["matmuls"] == pytest.approx(0.4) and shares["attention"] == pytest.approx(0.4)
    assert shares["loss"] == pytest.approx(0.2) and shares["idle"] == pytest.approx(0.2)  # 15-20 of 0-25
    assert top[0] == ("nvjet_sm90_tst_256x128_gemm", 0.01)
    (tmp_path / "cpu.json").write_text(json.dumps({"traceEvents": events[-1:]}))
    assert split_trace(str(tmp_path / "cpu.json")) is None


def test_rows_run_what_their_names_say():
    """Parsed as the trainer parses them: the FSDP rows of GPT-2 FULL_SHARD (the config ships SHARD_GRAD_OP,
    the row its own), the shipped rows each config's own vocabulary where it sets one."""
    from fsdp_gpt.config_parse import parse_args
    rows = {row.name: parse_args(row.args + mfu.BYTES) for row in mfu.ROWS if not row.plain}
    for name in ("gpt2_fsdp", "gpt2_fsdp_per_block", "gpt2_fsdp_prefetch", "gpt2_fsdp_fp8", "llama1b_fsdp"):
        assert (rows[name].force_fsdp, rows[name].sharding_strategy) == (True, "FULL_SHARD"), name
    assert rows["gpt2_fsdp_once"].sharding_strategy == rows["shipped_gpt2_124M"].sharding_strategy == "SHARD_GRAD_OP"
    assert (rows["shipped_llama_1B"].vocab_size, rows["shipped_gpt2_124M"].vocab_size) == (128256, 50304)
    assert rows["shipped_recipe_124M"].vocab_size == 50304  # null in the config: the data's; GPT-2's here


def test_each_fp8_row_is_its_bf16_row_with_fp8():
    rows = {row.name: row for row in mfu.ROWS}
    for name in ("llama1b_fp8", "llama1b_fp8_rowwise", "gpt2_fp8", "gpt2_fsdp_fp8"):
        fp8 = [a for a in rows[name].args if a.startswith("--fp8")]
        assert len(fp8) == 1 and [a for a in rows[name].args if a not in fp8] == rows[rows[name].vs].args, name


@pytest.mark.slow
def test_fp8_row_runs_emulated_with_float8_all_gather(corpus, tmp_path):
    if importlib.util.find_spec("torchao") is None:
        pytest.skip('torchao is not installed: pip install -e ".[fp8]"')
    if not compat.float8_training():
        pytest.skip(f"torchao 0.18's float8 training needs torch 2.11+, this is {torch.__version__}")
    result = bench_mfu("--rows", "gpt2_fsdp_fp8", "--out", str(tmp_path),
                       *overrides(**TINY_ROW, **corpus, fp8_emulate=True, fp8_layers="all"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "torchao 0.18" in result.stdout.splitlines()[0]  # where the rows' torchao comes from
    assert "8 of 8 block linears in FP8" in (tmp_path / "gpt2_fsdp_fp8.log").read_text()
    assert "float8 all-gather" in (tmp_path / "gpt2_fsdp_fp8.log").read_text()


def test_rows_import_the_torchao_unpacked_in_the_checkout(tmp_path, monkeypatch):
    """A folder as docs/fp8.md makes it (torchao/ and its dist-info): first on the rows' path, before
    the torchao installed here."""
    (tmp_path / "torchao").mkdir()
    (tmp_path / "torchao" / "__init__.py").write_text("")
    (tmp_path / "torchao-9.9.dist-info").mkdir()
    (tmp_path / "torchao-9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torchao\nVersion: 9.9\n")
    monkeypatch.setattr(mfu, "TORCHAO", str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    assert mfu.carried_torchao() == f"torchao 9.9 from {tmp_path}"
    row = subprocess.run([sys.executable, "-c", "import torchao; print(torchao.__file__)"], capture_output=True,
                         text=True, timeout=60)
    assert row.stdout.strip() == str(tmp_path / "torchao" / "__init__.py")

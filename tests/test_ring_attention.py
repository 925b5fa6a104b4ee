"""cp_mode: ring. The ring's attention against whole rows' on the same q, k, v (tests/ring_probe.py);
the trainer with rows split over 2 and 4 ranks against one process, for both layouts, with and
without doc_mask, under AdamW and Muon, with one key/value head (which Ulysses can't split); its
checkpoints independent of cp_mode and cp_size; what it refuses."""
import json
import os
import re

import pytest
import torch

from attention_check import largest_differences, sink_cases
from conftest import DEMO, ROOT, RUN, checkpoint_of, launch, launcher_once, run_trainer, scalars
from test_context_parallel import assert_parity, logged
from test_doc_mask import short_corpus  # noqa: F401 - the fixture
from fsdp_gpt.config import CP_MODES, UserError
from fsdp_gpt.config_parse import parse_args
from fsdp_gpt.distributed.context_parallel import row_pieces
from fsdp_gpt.distributed.precision import Chip
from fsdp_gpt.distributed.ring_attention import ring_refusal


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_ring_attention_is_whole_row_attention(nproc, tmp_path):
    """Outputs and the gradients of q, k and v within float rounding of attention over whole rows,
    with documents, with grouped and single key/value heads, and within sliding windows wider than a
    chunk (at 4 ranks, more than two); with attention sinks through the ring and Ulysses, the sinks'
    gradients summed over the ranks; nothing left in reference cycles (a block in flight held until
    the garbage collector ran: activation memory grew with the ring's size)."""
    result = launch([os.path.join(ROOT, "tests", "ring_probe.py")], str(tmp_path), nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(report) == 13
    for case, (largest, cycles) in report.items():
        # Ulysses' all-to-alls leave their own objects in cycles (70 a call, sinks or none): the sinks add none
        left = report["ulysses, documents"][1] if case.startswith("ulysses") else 0
        assert largest < 1e-5 and cycles == left, (case, largest, cycles)


# relative to each tensor's largest entry; bf16 keeps 8 bits (a rounding is up to 0.4%), and the
# fp32 reference is rounded once to bf16 on the way in
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}


@pytest.mark.parametrize("dtype", TOLERANCE)
def test_ring_kernels_and_per_document_calls_are_masked_attention(dtype):
    """tests/attention_check.py on the CPU: blocks merged by log-sum-exp and their backward with the
    merged output, per-document calls, and the one-rank ring with documents; a sliding window over
    rows and documents, through the bands and the ring's windowed tiles; each of them with attention
    sinks (gpt-oss's), the sinks' gradients too: against a dense mask."""
    figures = largest_differences("cpu", getattr(torch, dtype))
    assert len(figures) == 13 and max(figures.values()) < TOLERANCE[dtype], figures


def test_zigzag_pieces_cover_each_row_once_and_balance_the_causal_work():
    """Rank c holds chunks c and 2cp-1-c: together every position once, and every rank's queries
    see as many earlier keys (the causal work) as every other's."""
    for cp in (1, 2, 3, 4):
        T = 2 * cp * 8
        positions = [[p for start, length in row_pieces("ring", rank, cp, T) for p in range(start, start + length)]
                     for rank in range(cp)]
        assert sorted(p for mine in positions for p in mine) == list(range(T))
        assert len({sum(p + 1 for p in mine) for mine in positions}) == 1  # keys seen, summed over a rank's queries
    assert row_pieces("ulysses", 1, 4, 64) == [(16, 16)]


# one process against the ring at 2 and 4 ranks: 2 query heads over 1 key/value head (llama), 2 heads (gpt2)
LAYOUTS = {"llama_docs_adamw": dict(arch="llama", n_head=2, n_kv_head=1, doc_mask=True),
           "gpt2_muon": dict(optimizer="muon"),
           "llama_docs_muon": dict(arch="llama", n_head=2, n_kv_head=1, doc_mask=True, optimizer="muon"),
           "gpt2_docs_adamw": dict(doc_mask=True)}
RING = dict(cp_mode="ring")
# every ring run has one data-parallel rank (one process; the ring over all ranks): 4 rows a step are
# 2 micro-batches, gradients accumulated over both
RING_RUN = RUN | dict(train_batch=4, block_size=64, micro_batch=2, checkpoint_type="sharded")


@pytest.fixture(scope="module")
def ring_runs(short_corpus, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """ring_runs(layout, name) -> the folder of that run, launched once a session: "one" (one process),
    "cp2" and "cp4" (the ring over 2 and 4 ranks; cp4 with activation checkpointing, cp2 of gpt2_muon
    compiled)."""
    launch_once = launcher_once(tmp_path_factory, "ring", **RING_RUN, **short_corpus)

    def run(layout: str, name: str) -> str:
        nproc, extra = {"one": (1, {}), "cp2": (2, dict(RING, cp_size=2, compile=layout == "gpt2_muon")),
                        "cp4": (4, dict(RING, cp_size=4, activation_checkpointing=True))}[name]
        return launch_once(f"{layout}_{name}", nproc, **LAYOUTS[layout] | extra)
    return run


@pytest.mark.slow
@pytest.mark.parametrize("layout, name", [("llama_docs_adamw", "cp2"), ("llama_docs_adamw", "cp4"), ("gpt2_muon", "cp2"),
                                          ("gpt2_muon", "cp4"), ("llama_docs_muon", "cp4"), ("gpt2_docs_adamw", "cp2")])
def test_ring_trains_the_run_of_one_process(layout, name, ring_runs):
    with open(os.path.join(ring_runs(layout, name), "stdout.txt")) as f:
        assert f"context parallel {name[2:]} (ring, each row over {name[2:]} ranks)" in f.read()
    assert_parity(logged(ring_runs(layout, "one")), logged(ring_runs(layout, name)))


@pytest.mark.slow
def test_checkpoints_do_not_depend_on_cp_mode(ring_runs, short_corpus, tmp_path):  # noqa: F811
    """The ring's checkpoint of step 3 resumed by one process, and one process's by the ring at 4
    ranks: the rest of the run as uninterrupted (within 1e-4); the ring's by the ring, bitwise."""
    settings = RING_RUN | LAYOUTS["llama_docs_adamw"] | short_corpus
    whole = scalars(os.path.join(ring_runs("llama_docs_adamw", "one"), "tb"), "train/loss")
    ring = scalars(os.path.join(ring_runs("llama_docs_adamw", "cp2"), "tb"), "train/loss")
    for name, source, nproc, extra, expected in (
            ("ring_to_one", "cp2", 1, {}, whole),
            ("one_to_ring", "one", 4, dict(RING, cp_size=4), whole),
            ("ring_to_ring", "cp2", 2, dict(RING, cp_size=2), ring)):
        os.makedirs(tmp_path / name)
        checkpoint = checkpoint_of(ring_runs("llama_docs_adamw", source), "sharded", 3, rank=0)  # one rank's set too
        result = run_trainer(str(tmp_path / name), nproc=nproc, resume_from=checkpoint, **settings | extra)
        assert f"resumed from {checkpoint} at step 3" in result.stdout
        got = scalars(str(tmp_path / name / "tb"), "train/loss")
        assert sorted(got) == [4, 5, 6]
        for step in got:
            assert got[step] == expected[step] if name == "ring_to_ring" else got[step] == pytest.approx(
                expected[step], rel=1e-4), (name, step)


@pytest.mark.parametrize("overrides, message", [
    (["--cp_mode=zigzag"], f"cp_mode 'zigzag' is not one of {', '.join(CP_MODES)}"),  # the table's modes
    (["--cp_mode=ring", "--cp_size=3"], "cp_mode: ring needs 2 x cp_size = 6 to divide block_size=128"),
    (["--cp_mode=ring", "--cp_size=2", "--dropout=0.1"], "dropout=0.1 with cp_mode: ring is not built"),
    (["--cp_size=4", "--arch=llama", "--n_kv_head=2"], "(cp_mode: ring has no head-count limit)"),
])
def test_bad_context_parallel_settings_are_refused(overrides, message):
    with pytest.raises(UserError, match=re.escape(message)):
        parse_args([DEMO] + overrides)  # the demo: 4 heads, block_size 128


def test_ring_refuses_where_its_kernels_cannot_run():
    """The flash kernels' log-sum-exp: CPU in fp32 and bf16, CUDA in bf16 and fp16 from sm80."""
    assert ring_refusal(Chip("cpu"), torch.float32) is None
    assert ring_refusal(Chip("cpu"), torch.bfloat16) is None
    a100 = Chip("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), bf16=True)
    assert ring_refusal(a100, torch.bfloat16) is None
    assert "on CUDA in bf16 or fp16" in ring_refusal(a100, torch.float32)
    v100 = Chip("cuda", "Tesla V100-SXM2-16GB", (7, 0))
    assert "here cuda in torch.float16 is not built" in ring_refusal(v100, torch.float16)


def test_sinks_take_the_written_out_kernel_where_no_fused_one_runs(monkeypatch):
    """Attention sinks need a kernel that returns the log-sum-exp: the CPU's flash (fp32, bf16) or CUDA's
    (bf16, fp16 from sm80; no mask); elsewhere (CUDA in fp32, a V100, a window's bands on CUDA) attention
    written out in fp32. Here, the sink cases of tests/attention_check.py through it as such a GPU runs them
    (whole rows, windows, documents; the ring's kernels and windowed tiles stay as they are)."""
    import types

    from fsdp_gpt import attention_kernels
    cuda = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert attention_kernels.lse_kernels(cuda) is attention_kernels.KERNELS["cuda"]
    assert attention_kernels.lse_kernels(cuda, masked=True) is attention_kernels.WRITTEN_OUT
    assert attention_kernels.lse_kernels(types.SimpleNamespace(device=cuda.device, dtype=torch.float32)) is \
        attention_kernels.WRITTEN_OUT
    assert attention_kernels.lse_kernels(torch.zeros(1)) is attention_kernels.KERNELS["cpu"]
    monkeypatch.setattr(attention_kernels, "fused_lse_runs", lambda device, dtype: False)
    figures = largest_differences("cpu", torch.float32, cases=(sink_cases,))
    assert len(figures) == 6 and max(figures.values()) < 1e-5, figures

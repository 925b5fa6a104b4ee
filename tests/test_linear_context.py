"""A model with linear layers (Gated DeltaNet) under the trainer's parallelisms: its core over a context
group against whole rows (tests/linear_probe.py); 2 ranks, and rows split over 2 and 4 ranks (Ulysses and
the ring for its attention layers, with and without doc_mask), train as one process does; a sharded
resume is bitwise; evaluation and sampling of its checkpoint in one process."""
import json
import os

import pytest

from conftest import RUN, ROOT, checkpoint_of, evaluated, launch, launcher_once, run_trainer, scalars, tool
from test_context_parallel import assert_parity, logged
from test_doc_mask import short_corpus  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow
# a linear layer (2 key heads each serving 2 value heads, key and value widths apart, chunks of 8 on rows of 32)
# and a full one; 4 heads and key/value heads, which Ulysses splits over 4 ranks
HYBRID = dict(arch="llama", n_head=4, attn_pattern="[linear,full]", linear_key_heads=2, linear_value_heads=4,
              linear_key_dim=16, linear_value_dim=8, linear_chunk=8, checkpoint_type="sharded")
RUNS = {"one": (1, {}), "two": (2, {}), "cp2": (2, dict(cp_size=2)), "cp4": (4, dict(cp_size=4)),
        "ring2": (2, dict(cp_size=2, cp_mode="ring")), "ring4": (4, dict(cp_size=4, cp_mode="ring"))}
# doc_mask on rows of several documents (tests/test_doc_mask.py's short_corpus): 128 tokens, pieces of 16 to 64
DOCUMENTS = dict(block_size=128, train_batch=8, micro_batch=4, doc_mask=True)
DOC_RUNS = {"one": (1, {}), "cp2": (2, dict(cp_size=2)), "ring4": (4, dict(cp_size=4, cp_mode="ring"))}


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_the_linear_core_over_a_context_group_is_the_whole_rows(nproc, tmp_path):
    """Outputs and the gradients of the inputs within float rounding of the core over whole rows, for
    both layouts (one piece a rank, the ring's two) with and without documents."""
    result = launch([os.path.join(ROOT, "tests", "linear_probe.py")], str(tmp_path), nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(report) == 6 and max(report.values()) < 1e-5, report


@pytest.fixture(scope="module")
def hybrid_run(corpus, tmp_path_factory):
    launch_run = launcher_once(tmp_path_factory, "linear", **RUN, **HYBRID, **corpus)
    return lambda name: launch_run(name, RUNS[name][0], **RUNS[name][1])


@pytest.mark.parametrize("name", [name for name in RUNS if name != "one"])
def test_a_model_with_linear_layers_trains_at_every_layout_as_one_process(name, hybrid_run):
    one = logged(hybrid_run("one"))
    assert_parity(one, logged(hybrid_run(name)), rel=1e-5)
    assert one["train/loss"][6] < one["train/loss"][1]  # it trained: the parity is not a model standing still


@pytest.mark.parametrize("name, nproc, extra", [("two", 2, {}), ("ring4", 4, dict(cp_size=4, cp_mode="ring"))])
def test_a_sharded_resume_is_bitwise(name, nproc, extra, hybrid_run, corpus, tmp_path):
    run = hybrid_run(name)
    result = run_trainer(str(tmp_path), nproc=nproc, resume_from=checkpoint_of(run, "sharded", 3),
                         **RUN | HYBRID | corpus | extra)
    assert "resumed from" in result.stdout
    resumed, uninterrupted = (scalars(os.path.join(folder, "tb"), "train/loss") for folder in (str(tmp_path), run))
    assert sorted(resumed) == [4, 5, 6] and all(resumed[s] == uninterrupted[s] for s in resumed)


def test_its_checkpoint_evaluates_and_samples_in_one_process(hybrid_run):
    """evaluate.py's val loss of a run split over 4 ranks is the run's own, and sample.py writes text."""
    run = hybrid_run("cp4")
    final = scalars(os.path.join(run, "tb"), "val/loss")[6]
    checkpoint = checkpoint_of(run, "sharded", 6, rank=0)
    assert evaluated(checkpoint) == pytest.approx(final, rel=1e-5)
    assert tool("sample.py", checkpoint, "--max_new_tokens", "16", "--seed", "1").strip()


def test_doc_mask_over_context_ranks_is_one_process(short_corpus, tmp_path_factory):
    """The state and the convolution start at every document, across the ranks' pieces too."""
    launch_run = launcher_once(tmp_path_factory, "linear_docs", **RUN | HYBRID | DOCUMENTS | short_corpus)
    runs = {name: launch_run(name, nproc, **extra) for name, (nproc, extra) in DOC_RUNS.items()}
    one = logged(runs["one"])
    for name in ("cp2", "ring4"):
        assert_parity(one, logged(runs[name]), rel=1e-5)
    plain = launch_run("plain", 1, doc_mask=False)
    assert scalars(os.path.join(plain, "tb"), "val/loss")[0] != one["val/loss"][0]  # the documents matter

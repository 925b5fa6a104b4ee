"""Data mixtures (mixture.py): exact proportions per cycle of rows, each window once per epoch,
a function of (seed, step) and the segment; resumes that keep or change the weights; llm.c's Llama 3
shards; bad mixtures refused with one line. The trainer runs them in test_long_runs.py."""
import numpy as np
import pytest
import torch

from fsdp_gpt.data import prepare as data
from fsdp_gpt.config import UserError
from fsdp_gpt.config_parse import parse_args
from conftest import DEMO
from fsdp_gpt.data.loader import BatchLoader
from fsdp_gpt.data.mixture import Mixture, Segment, cycle, resumed_segment, shuffled


@pytest.mark.parametrize("size", [1, 2, 7, 64, 1000, 1025, 4097])
def test_shuffled_is_a_permutation_that_depends_on_its_key(size):
    order = shuffled(np.arange(size), size, [7, 1, 0])
    assert sorted(order.tolist()) == list(range(size))
    if size > 64:
        assert not np.array_equal(order, shuffled(np.arange(size), size, [7, 1, 1]))  # another epoch, another order
        assert abs(np.corrcoef(np.arange(size), order)[0, 1]) < 0.2  # not close to the identity


@pytest.mark.parametrize("weights", [[0.8, 0.2], [1, 1, 1], [0.5, 0.3, 0.2], [2.0, 0.0, 1.0], [1 / 3, 2 / 3]])
def test_every_cycle_of_rows_holds_each_source_exactly(weights):
    counts, pattern, prefix = cycle(weights)
    assert np.bincount(pattern, minlength=len(weights)).tolist() == counts.tolist()
    share = counts / counts.sum()
    assert np.allclose(share, np.array(weights) / sum(weights), atol=1e-3)
    assert (prefix[-1] == counts).all()
    # spread evenly: any run of rows holds each source's share to within 2 rows
    for length in (8, 24, 100):
        for start in range(0, len(pattern), 7):
            window = np.take(pattern, range(start, start + length), mode="wrap")
            assert (np.abs(np.bincount(window, minlength=len(weights)) - share * length) < 2).all()


def mixture(weights=(0.75, 0.25), windows=(50, 13), segment=None, seed=3, batch=8):
    names = ["web", "code"]
    segment = segment or Segment(0, batch, dict(zip(names, weights)), {name: 0 for name in names})
    return Mixture(names, list(windows), segment, seed, [None] * len(names))


def test_rows_read_each_window_once_per_epoch_in_a_new_order_each_epoch():
    mix = mixture()
    seen = {0: [], 1: []}
    for step in range(1, 41):  # 320 rows: 240 of web (4.8 epochs), 80 of code (6.2 epochs)
        sources, starts = mix.rows(step, block_size=16)
        for k, start in zip(sources.tolist(), starts.tolist()):
            assert start % 16 == 0
            seen[k].append(start // 16)
    assert (len(seen[0]), len(seen[1])) == (240, 80)  # exactly 3:1
    for k, w in ((0, 50), (1, 13)):
        epochs = [seen[k][i:i + w] for i in range(0, len(seen[k]) - w + 1, w)]
        assert all(sorted(e) == list(range(w)) for e in epochs), k  # each window once per epoch
        assert epochs[0] != epochs[1]  # reshuffled
    assert mix.supplied(40) == {"web": 240, "code": 80}
    assert mix.epochs(40) == pytest.approx({"web": 4.8, "code": 80 / 13})


def test_rows_are_a_function_of_seed_and_step():
    a, b, other = mixture(), mixture(), mixture(seed=4)
    for step in (1, 7, 33, 5, 1):
        assert all(np.array_equal(x, y) for x, y in zip(a.rows(step, 16), b.rows(step, 16)))
    assert not np.array_equal(a.rows(2, 16)[1], other.rows(2, 16)[1])


def test_a_resume_with_the_same_weights_continues_the_segment_and_with_others_where_it_left_off():
    first = mixture()
    saved = first.state(10)
    same, note = resumed_segment(["web", "code"], {"web": 0.75, "code": 0.25}, saved, 10, 8)
    assert note is None
    continued = mixture(segment=same)
    assert all(np.array_equal(x, y) for step in range(11, 20) for x, y in zip(first.rows(step, 16), continued.rows(step, 16)))
    changed, note = resumed_segment(["web", "code"], {"web": 0.5, "code": 0.5}, saved, 10, 8)
    assert note == "data_weights changed on resume (web 0.75 -> 0.5, code 0.25 -> 0.5): they apply from step 11 on"
    after = mixture(weights=(0.5, 0.5), segment=changed)
    rows = [after.rows(step, 16) for step in range(11, 21)]
    assert sum(int((sources == 0).sum()) for sources, _ in rows) == 40  # half of 80 rows
    # the positions continue: web's epoch 0 (50 windows) ends with no window read twice
    web_before = [s // 16 for step in range(1, 11) for k, s in zip(*first.rows(step, 16)) if k == 0]
    web_after = [s // 16 for sources, starts in rows for k, s in zip(sources, starts) if k == 0]
    assert sorted((web_before + web_after)[:50]) == list(range(50))
    assert after.supplied(20) == {"web": 60 + 40, "code": 20 + 40}
    with pytest.raises(UserError, match="the checkpoint's mixture reads code, which data_mix lacks"):
        resumed_segment(["web"], {"web": 1.0}, saved, 10, 8)


@pytest.mark.parametrize("batch", [4, 16])
def test_a_resume_with_another_train_batch_continues_each_source_where_it_stopped(batch):
    """Saved at step 10 of 8 rows, resumed with 4 or 16 rows a step: no window read twice or skipped
    in an epoch (the saved segment's rows were numbered by 8), each source on from its count."""
    first = mixture()
    segment, note = resumed_segment(["web", "code"], {"web": 0.75, "code": 0.25}, first.state(10), 10, batch)
    assert note is None
    after = mixture(segment=segment, batch=batch)
    steps = range(11, 11 + 80 // batch)  # 80 rows more: 60 of web, 20 of code
    web_before = [s // 16 for step in range(1, 11) for k, s in zip(*first.rows(step, 16)) if k == 0]
    web_after = [s // 16 for step in steps for k, s in zip(*after.rows(step, 16)) if k == 0]
    assert len(web_after) == 60 and sorted((web_before + web_after)[:50]) == list(range(50))
    assert after.supplied(steps[-1]) == {"web": 60 + 60, "code": 20 + 20}


def resumed(saved: dict, step: int, batch: int) -> Mixture:
    """A run resumed after `step` from a mixture's saved state, at `batch` rows a step (as BatchLoader.load does)."""
    segment, note = resumed_segment(["web", "code"], {"web": 1, "code": 2}, saved, step, batch)
    assert note is None
    return mixture(weights=(1, 2), segment=segment, batch=batch)


def same_rows(a: Mixture, b: Mixture, steps) -> bool:
    return all(np.array_equal(x, y) for step in steps for x, y in zip(a.rows(step, 16), b.rows(step, 16)))


def test_every_resume_after_changes_of_train_batch_continues_the_run_it_resumes():
    """Two changes of train_batch (8 -> 16 at step 2, 16 -> 4 at step 6), each followed by a plain resume:
    the plain resume draws the rows its run drew (the segment numbers its rows from its own start). Weights
    1 and 2: a cycle of 3 rows, which no step fills."""
    a = mixture(weights=(1, 2), batch=8)
    b = resumed(a.state(2), 2, 16)
    c = resumed(b.state(4), 4, 16)
    assert same_rows(b, c, range(5, 9))
    d = resumed(b.state(6), 6, 4)
    e = resumed(d.state(8), 8, 4)
    assert same_rows(d, e, range(9, 13))
    assert sum(e.supplied(12).values()) == 2 * 8 + 4 * 16 + 6 * 4
    # a checkpoint written before segments kept their train_batch (its rows numbered from the run's start by
    # the train_batch of the resume that made it, which made the plain resume start over) continues too
    old = b.state(4)
    old["segment"] = {"start_row": 2 * 16, "weights": old["segment"]["weights"], "base": old["segment"]["base"]}
    assert same_rows(b, resumed(old, 4, 16), range(5, 9))


@pytest.mark.parametrize("override, message", [
    (["--data_weights={web: 1}"], "data_weights needs data_mix"),
    (["--data_mix={web: a, code: b}", "--data_weights={web: -0.1, code: 1}"], "data_weights: web=-0.1 must be a number, 0 or more"),
    (["--data_mix={web: a, code: b}", "--data_weights={web: 0, code: 0}"], "data_weights are all zero"),
    (["--data_mix={web: a, code: b}", "--data_weights={web: 1, books: 1}"], "data_weights names 'books', which data_mix lacks"),
    (["--data_mix={web: a, code: b}", "--data_weights={web: 1}"], "data_weights gives no weight for code"),
])
def test_bad_mixtures_are_refused(override, message):
    with pytest.raises(UserError, match=message):
        parse_args([DEMO] + override)


def write_shard(path, tokens, version):
    fmt = data.LLMC_FORMATS[version]
    header = np.zeros(data.LLMC_HEADER_INTS, dtype=np.int32)
    header[:3] = fmt.magic, version, len(tokens)
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype=fmt.dtype).tobytes())


def test_llama3_shards_read_as_they_are_and_mix_only_with_their_vocabulary(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 128256, size=3000)  # past uint16: needs llm.c's uint32
    for version, folder in ((7, "llama3"), (1, "gpt2a"), (1, "gpt2b")):
        (tmp_path / folder).mkdir()
        vocab = data.LLMC_FORMATS[version].vocab_size
        write_shard(tmp_path / folder / "x_val_000000.bin", tokens[:500] % vocab, version)
        write_shard(tmp_path / folder / "x_train_000001.bin", tokens[500:] % vocab, version)
    meta = data.prepare_data(str(tmp_path / "llama3"), None, "gpt2")
    assert (meta["tokenizer"], meta["vocab_size"], meta["dtype"]) == ("llama3", 128256, "uint32")
    loader = BatchLoader({"data": (str(tmp_path / "llama3"), meta)}, 32, 4, 4, 0, 1, 0, torch.device("cpu"))
    (_, x, y, _, _), *_ = loader.val_batches(4)
    assert torch.equal(x[0], torch.from_numpy(tokens[:32].astype(np.int64)))  # tokens past 65535 intact
    both = data.prepare_sources({"a": str(tmp_path / "gpt2a"), "b": str(tmp_path / "gpt2b")}, "", None, "gpt2")
    assert list(both) == ["a", "b"]
    with pytest.raises(UserError, match="data_mix: b holds 'llama3' tokens \\(vocabulary 128256\\), a 'gpt2' ones "
                                        "\\(50257\\): prepare every source with one tokenizer"):
        data.prepare_sources({"a": str(tmp_path / "gpt2a"), "b": str(tmp_path / "llama3")}, "", None, "gpt2")

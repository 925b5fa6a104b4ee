"""Data mixtures: which source, and which window of it, each training row of a run reads.

The weights become whole numbers of rows per cycle (kept to 1/1000 of the whole), laid out over the
cycle by smooth weighted round robin: row r of a segment (row i of step s is r = (s - 1 - start_step)
* train_batch + i) comes from source pattern[r % cycle], so every cycle of rows holds each source's
share exactly and a step's batch holds it to within a row or two. Source k's n-th row is window
shuffled(n mod W_k) of its epoch n // W_k, its W_k windows being its train tokens cut at multiples
of block_size: every window once per epoch, in an order drawn anew for each epoch (a keyed
permutation computed per row: no table to hold, however large the source). A source that runs out
starts its next epoch on its own.

All of it is a function of the seed, the step and the segment: the weights and the rows a step in
force since a step of the run, and the rows each source had supplied by then. A resume with the same
weights and train_batch continues the saved segment (bitwise, after any number of earlier changes);
with others it starts a new one where the checkpoint left off.
"""
import math
import zlib
from dataclasses import dataclass

import numpy as np

from fsdp_gpt.config import UserError

RESOLUTION = 1000  # weights are kept to 1/1000 of their sum


@dataclass
class Segment:
    start_step: int  # the step after which these weights apply (0: from the run's start)
    train_batch: int  # the rows of each of its steps: its rows are numbered by it
    weights: dict[str, float]
    base: dict[str, int]  # rows each source had supplied by the end of start_step

    def to_state(self) -> dict:
        return {"start_step": self.start_step, "train_batch": self.train_batch, "weights": dict(self.weights),
                "base": dict(self.base)}

    @classmethod
    def saved(cls, state: dict, supplied: dict[str, int], step: int, train_batch: int) -> "Segment | None":
        """The checkpoint's segment, resumed after `step`. One saved before segments kept their
        train_batch (a start_row, its rows numbered from the run's start by the train_batch of the
        run's steps) is that train_batch's where the rows it supplied since its start agree with it,
        else None (a resume at another train_batch: a new segment)."""
        if "start_step" in state:
            return cls(**state)
        start_step, rest = divmod(state["start_row"], train_batch)
        since = sum(supplied.values()) - sum(state["base"].values())
        if rest or since != (step - start_step) * train_batch:
            return None
        return cls(start_step, train_batch, state["weights"], state["base"])


def cycle(weights: list[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows per cycle of each source, the source of each row of a cycle, prefix: rows of each
    source among the cycle's first j rows, j = 0..cycle)."""
    total = sum(weights)
    counts = [max(round(w / total * RESOLUTION), 1) if w > 0 else 0 for w in weights]
    divisor = math.gcd(*counts)
    counts = np.array([c // divisor for c in counts], dtype=np.int64)
    length = int(counts.sum())
    credit, pattern = np.zeros(len(counts), dtype=np.int64), []
    for _ in range(length):  # smooth weighted round robin: the most owed source, the first on ties
        credit += counts
        k = int(np.argmax(credit))
        credit[k] -= length
        pattern.append(k)
    pattern = np.array(pattern, dtype=np.int64)
    prefix = np.zeros((length + 1, len(counts)), dtype=np.int64)
    prefix[1:] = np.cumsum(np.eye(len(counts), dtype=np.int64)[pattern], axis=0)
    return counts, pattern, prefix


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: 64 well-mixed bits from 64."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def shuffled(index: np.ndarray, size: int, key: list[int]) -> np.ndarray:
    """A keyed pseudo-random permutation of range(size) at `index`: a 4-round Feistel network on the
    smallest 2^(2h) >= size, walking cycles back into range (fewer than 4 rounds of it on average)."""
    half = max(1, ((size - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    round_keys = np.random.default_rng(key).integers(0, 2 ** 63, size=4, dtype=np.uint64)

    def permute(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        for k in round_keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << np.uint64(half)) | right

    x = permute(np.asarray(index, dtype=np.uint64))
    while (outside := x >= size).any():
        x[outside] = permute(x[outside])
    return x.astype(np.int64)


class Mixture:
    """The rows of a run drawn from several sources (names in data_mix's order)."""

    def __init__(self, names: list[str], windows: list[int], segment: Segment, seed: int,
                 starts: list[np.ndarray | None]):
        """windows: each source's windows per epoch; starts: their offsets where they are documents
        (align_rows), None where window w starts at w * block_size."""
        self.names, self.windows, self.segment, self.starts = names, np.array(windows, dtype=np.int64), segment, starts
        self.seed, self.train_batch = seed, segment.train_batch
        self.counts, self.pattern, self.prefix = cycle([segment.weights[name] for name in names])
        self.base = np.array([segment.base.get(name, 0) for name in names], dtype=np.int64)

    def _rows_by(self, step: int) -> int:
        """The segment's rows in its steps up to and including `step` (the number of step + 1's first)."""
        assert step >= self.segment.start_step, "steps before the segment's start belong to another segment"
        return (step - self.segment.start_step) * self.train_batch

    def _supplied_before(self, rows: np.ndarray, sources: np.ndarray) -> np.ndarray:
        """How many rows source sources[i] has supplied before row rows[i] of the segment."""
        length = len(self.pattern)
        return self.base[sources] + (rows // length) * self.counts[sources] + self.prefix[rows % length, sources]

    def rows(self, step: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, start offset in its train tokens) of each of step `step`'s train_batch rows."""
        rows = self._rows_by(step - 1) + np.arange(self.train_batch, dtype=np.int64)
        sources = self.pattern[rows % len(self.pattern)]
        n = self._supplied_before(rows, sources)
        epochs, within = n // self.windows[sources], n % self.windows[sources]
        windows = np.empty_like(n)
        for k, epoch in set(zip(sources.tolist(), epochs.tolist())):
            at = (sources == k) & (epochs == epoch)
            windows[at] = shuffled(within[at], int(self.windows[k]), [self.seed, zlib.crc32(self.names[k].encode()), epoch])
        offsets = windows * block_size
        for k, starts in enumerate(self.starts):
            if starts is not None:
                of_k = sources == k
                offsets[of_k] = starts[windows[of_k]]
        return sources, offsets

    def supplied(self, step: int) -> dict[str, int]:
        """Rows each source has supplied in steps 1..step."""
        end = np.full(len(self.names), self._rows_by(step), dtype=np.int64)
        return dict(zip(self.names, self._supplied_before(end, np.arange(len(self.names))).tolist()))

    def epochs(self, step: int) -> dict[str, float]:
        """Epochs of each source read by the end of step `step` (1.5: once, and half again)."""
        return {name: n / int(w) for (name, n), w in zip(self.supplied(step).items(), self.windows)}

    def state(self, step: int) -> dict:
        """What a checkpoint of step `step` keeps: the segment, and the rows supplied so far."""
        return {"segment": self.segment.to_state(), "supplied": self.supplied(step)}


def resumed_segment(names: list[str], weights: dict[str, float], saved: dict | None, step: int,
                    train_batch: int) -> tuple[Segment, str | None]:
    """The segment a run continues with after step `step`, and a note when its weights changed.
    saved: the checkpoint's mixture state (None: a fresh start, or a checkpoint of a run without one)."""
    if saved is None:
        return Segment(step, train_batch, dict(weights), {name: 0 for name in names}), None
    dropped = [name for name in saved["supplied"] if name not in names]
    if dropped:
        raise UserError(f"the checkpoint's mixture reads {', '.join(dropped)}, which data_mix lacks: a resume may "
                        f"change data_weights (0 stops a source), not drop a source")
    before = saved["segment"]["weights"]
    # a segment numbers its rows by its train_batch: another train_batch numbers them otherwise, and each
    # source continues where it stopped in a new segment
    segment = Segment.saved(saved["segment"], saved["supplied"], step, train_batch)
    if before == weights and segment is not None and segment.train_batch == train_batch:
        return segment, None
    changes = ", ".join(f"{name} {before.get(name, 0):g} -> {weights[name]:g}" for name in names
                        if before.get(name) != weights[name])
    return Segment(step, train_batch, dict(weights), dict(saved["supplied"])), \
        (f"data_weights changed on resume ({changes}): they apply from step {step + 1} on" if changes else None)


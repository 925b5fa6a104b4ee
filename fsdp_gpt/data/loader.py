"""Token files read back, and the deterministic batch loader: token windows as tensors on the device."""
import os

import numpy as np
import torch

from fsdp_gpt.config import UserError
from fsdp_gpt.data.prepare import LLMC_HEADER_INTS, llmc_format, llmc_header, llmc_shards
from fsdp_gpt.data.mixture import Mixture, Segment, resumed_segment
from fsdp_gpt.distributed.context_parallel import positions_of


class TokenStream:
    """Token files read as one sequence (memory-mapped): a window may span two files."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays
        self.offsets = np.cumsum([0] + [len(a) for a in arrays])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        parts = []
        while length > 0:
            piece = self.arrays[i][start - self.offsets[i]:start - self.offsets[i] + length]
            parts.append(piece)
            start, length, i = start + len(piece), length - len(piece), i + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def open_split(data_path: str, meta: dict, split: str) -> TokenStream:
    if meta.get("format") == "llm.c":
        shards = llmc_shards(data_path, split)
        if not shards:
            raise UserError(f"{data_path} has llm.c train shards but no *_{split}_*.bin")
        arrays = []
        for path in shards:
            version, count = llmc_header(path)
            arrays.append(np.memmap(path, dtype=llmc_format(version).dtype, mode="r", offset=4 * LLMC_HEADER_INTS,
                                    shape=(count,)))
        return TokenStream(arrays)
    return TokenStream([np.memmap(os.path.join(data_path, f"{split}.bin"), dtype=np.dtype(meta["dtype"]), mode="r")])


SCAN_TOKENS = 1 << 24  # tokens compared at a time when looking for separators: bounded memory


def document_starts(tokens: TokenStream, separator: int, block_size: int) -> np.ndarray:
    """align_rows: the offsets of the separator tokens a whole row (block_size + 1 tokens) fits after.
    A row starting there begins with the separator, then a document's first token: prepared data
    ends each document with it, llm.c's shards begin each one with it (BOS-aligned rows)."""
    found = [np.flatnonzero(array[i:i + SCAN_TOKENS] == separator) + offset + i
             for offset, array in zip(tokens.offsets, tokens.arrays) for i in range(0, len(array), SCAN_TOKENS)]
    starts = np.concatenate(found).astype(np.int64)
    starts = starts[starts + block_size + 1 <= len(tokens)]
    if not len(starts):
        raise UserError(f"align_rows: no document separator (token {separator}) with a whole row after it")
    return starts


def never_read(starts: np.ndarray, total: int, block_size: int) -> int:
    """Tokens no aligned row reaches: those more than block_size past their document's start (cropped)."""
    ends = np.append(starts[1:], total)
    return int(starts[0] + np.maximum(ends - starts - (block_size + 1), 0).sum())


class RandomWindows:
    """One dataset (data_path): step s's rows start at train_batch offsets drawn anywhere in the train
    tokens by a generator seeded with (seed, s), with replacement (nanoGPT's sampling); with
    align_rows, drawn among the document starts instead."""

    def __init__(self, tokens: int, seed: int, train_batch: int, starts: np.ndarray | None = None):
        self.tokens, self.seed, self.train_batch, self.starts = tokens, seed, train_batch, starts

    def rows(self, step: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
        draw = np.random.default_rng([self.seed, step]).integers
        starts = draw(0, self.tokens - block_size - 1, size=self.train_batch) if self.starts is None else \
            self.starts[draw(0, len(self.starts), size=self.train_batch)]
        return np.zeros(self.train_batch, dtype=np.int64), starts


class BatchLoader:
    """Deterministic batches: the global batch of step s depends only on (seed, s) (and, for a
    mixture, its segment: mixture.py).

    The sampler gives step s's train_batch rows as (source, start offset); data-parallel rank r takes
    rows [r * n, (r + 1) * n) of them, n = train_batch / dp, and cuts them into micro-batches. World
    size, micro batch and restarts change who computes which row, never which rows make up the step;
    nor does the same token sequence split into other files (llm.c shards).

    sources: {name: (folder, its metadata)}; one (data_path) or several (data_mix, with a segment).
    Context parallelism (cp_size ranks per row): a rank reads only its pieces of each row, (start,
    length) each (context_parallel.row_pieces: one slice, or two chunks for the ring), each with the
    token after it (its last target); `positions` says where its columns sit in the row.

    doc_mask: each batch comes with `opens`, a host array (rows, tokens), True at its inputs' tokens
    that open a document (the separator), found in the host's copy of the rows: where the documents
    lie is known without reading the device back. Without doc_mask, opens is None.

    What a checkpoint keeps of the data (state(), load()): the tokens trained on so far (counted, not
    derived from the step: a resume may change block_size or train_batch), and a mixture's segment and
    the rows each source supplied by the last step served; one dataset's position is a function of
    (seed, step) alone.
    """

    # the TensorBoard tags scalars() returns, {tag: meaning}: docs/logging.md's table is made of these
    # (fsdp_gpt/doc_tables.py) and the tests refuse a tag a run writes undeclared
    TAGS = {"data/tokens": "tokens trained on so far, over every rank (kept in every checkpoint)",
            "data/{source}/epoch": "a mixture's: the epochs of each source read so far",
            "data/{source}/tokens": "a mixture's: the tokens of each source trained on so far"}

    def __init__(self, sources: dict[str, tuple[str, dict]], block_size: int, train_batch: int, micro_batch: int,
                 dp_rank: int, dp_size: int, seed: int, device: torch.device, segment: Segment | None = None,
                 align_rows: bool = False, pieces: list[tuple[int, int]] | None = None, doc_mask: bool = False,
                 step: int = 0):
        """step: the step a resumed run continues after (0: a fresh one)."""
        self.block_size, self.train_batch, self.micro_batch = block_size, train_batch, micro_batch
        self.step = step  # the last step whose batches were served: what state() keeps
        # tokens of the steps up to resumed_at: the checkpoint's count (load()), or derived from the step
        self.resumed_at, self.tokens_before = step, step * train_batch * block_size
        self.dp_rank, self.dp_size, self.seed, self.device = dp_rank, dp_size, seed, device
        self.pieces = pieces or [(0, block_size)]
        self.positions = positions_of(self.pieces).to(device)
        self.cp_size = block_size // len(self.positions)  # ranks that share each row
        self.separator = next(iter(sources.values()))[1].get("eot_token")  # between documents (None: not known)
        self.doc_mask = doc_mask
        self.names = list(sources)
        self.splits = {split: [open_split(path, meta, split) for path, meta in sources.values()]
                       for split in ("train", "val")}
        for split, streams in self.splits.items():
            for (path, _), tokens in zip(sources.values(), streams):
                if len(tokens) <= block_size + 1:
                    raise UserError(f"the {split} split of {path} holds {len(tokens)} tokens, fewer than "
                                    f"block_size+1={block_size + 1}")
        train = self.splits["train"]
        # align_rows: each source's rows start at its documents (a window per document), else anywhere
        self.starts = [document_starts(tokens, meta["eot_token"], block_size) if align_rows else None
                       for tokens, (_, meta) in zip(train, sources.values())]
        # each source's windows: its train tokens cut at block_size, or its document starts
        self.windows = [(len(tokens) - 1) // block_size if starts is None else len(starts)
                        for tokens, starts in zip(train, self.starts)]
        self.mixture = None
        self.sampler = RandomWindows(len(train[0]), seed, train_batch, self.starts[0])
        if segment is not None:
            self._follow(segment)
        self.val_weights = [1.0] if segment is None else [segment.weights[name] for name in self.names]
        # on GPU the next micro-batch is copied on a side stream while the current one computes;
        # on CPU there is no copy to hide and batches are built when asked for
        self.one_ahead = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if self.one_ahead else None
        self._ahead = None  # ((step, micro_step), copy in flight)

    def _follow(self, segment: Segment) -> None:
        """Rows drawn from the mixture of `segment` from here on."""
        self.mixture = self.sampler = Mixture(self.names, self.windows, segment, self.seed, self.starts)

    def tokens(self, step: int) -> int:
        """Tokens trained on up to and including step `step`, over every rank."""
        return self.tokens_before + (step - self.resumed_at) * self.train_batch * self.block_size

    def state(self) -> dict:
        """What a checkpoint of the last step served keeps of the data."""
        mixture = {} if self.mixture is None else {"mixture": self.mixture.state(self.step)}
        return {"tokens": self.tokens(self.step)} | mixture

    def load(self, state: dict | None) -> str | None:
        """A resumed run's data: its tokens so far (where a checkpoint predates their count, taken from its
        steps, train_batch and block_size: run_state.resumed_train_state), and a mixture continues the checkpoint's segment, or starts a new one where it left off
        when data_weights changed (the notes returned say so)."""
        state, notes = state or {}, []
        self.tokens_before = state.get("tokens", self.tokens_before)
        if "tokens_taken_as" in state:  # from the checkpoint's own config (run_state.resumed_train_state)
            notes.append(f"the checkpoint predates its count of tokens seen: {state['tokens_taken_as']} = "
                         f"{self.tokens_before:,}")
        if self.mixture is not None:
            segment, note = resumed_segment(self.names, self.mixture.segment.weights, state.get("mixture"),
                                            self.step, self.train_batch)
            self._follow(segment)
            notes += [note] if note else []
        return "; ".join(notes) or None

    def _host_rows(self, split: str, chunk: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """(rows, 2, tokens): each row's inputs, then its targets (the next tokens), over this rank's pieces."""
        streams = self.splits[split]
        windows = [[streams[int(k)].window(int(s) + start, length + 1) for start, length in self.pieces]
                   for k, s in zip(*chunk)]
        return np.stack([[np.concatenate([w[:-1] for w in row]), np.concatenate([w[1:] for w in row])]
                         for row in windows]).astype(np.int64)

    def _rows(self, split: str, chunk: tuple[np.ndarray, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self._finish_copy(self._start_copy(self._host_rows(split, chunk)))

    def _my_chunks(self, step: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """This rank's share of step `step`'s rows, (sources, start offsets), cut into micro-batches."""
        sources, starts = self.sampler.rows(step, self.block_size)
        share = self.train_batch // self.dp_size
        mine = slice(self.dp_rank * share, (self.dp_rank + 1) * share)
        sources, starts = sources[mine], starts[mine]
        return [(sources[i:i + self.micro_batch], starts[i:i + self.micro_batch]) for i in range(0, share, self.micro_batch)]

    def micro_batches(self, step: int):
        """Yield (x, y, opens) micro-batches of this rank's share of step `step`'s global batch."""
        self.step = step
        chunks = self._my_chunks(step)
        if not self.one_ahead:
            for chunk in chunks:
                yield self._rows("train", chunk)
            return
        # one ahead: micro-batch i+1 (after the last, the next step's first) is read and its copy
        # started before micro-batch i is handed over, so the copy runs while i computes
        queue = [((step, i), chunk) for i, chunk in enumerate(chunks)]
        queue.append(((step + 1, 0), self._my_chunks(step + 1)[0]))
        for (key, chunk), (following, following_chunk) in zip(queue, queue[1:]):
            if self._ahead is None or self._ahead[0] != key:  # the first step, or a jump (resume)
                self._ahead = (key, self._start_copy(self._host_rows("train", chunk)))
            copy = self._ahead[1]
            self._ahead = (following, self._start_copy(self._host_rows("train", following_chunk)))
            yield self._finish_copy(copy)

    def _start_copy(self, rows: np.ndarray):
        """The host rows on their way to the device: on GPU through pinned memory, on a side stream;
        with doc_mask, the tokens that open documents found in the host's copy meanwhile."""
        opens = rows[:, 0] == self.separator if self.doc_mask else None
        xy = torch.from_numpy(rows)
        if self.device.type != "cuda":
            return xy.to(self.device), None, opens  # on CPU: xy itself
        with torch.cuda.stream(self._copy_stream):
            xy = xy.pin_memory().to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return xy, done, opens

    def _finish_copy(self, copy) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(x, y, opens) once the copy is done, for the compute stream."""
        xy, done, opens = copy
        if done is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(done)
            xy.record_stream(compute)  # allocated on the copy stream, used (and freed) on this one
        return xy[:, 0], xy[:, 1], opens

    def val_batches(self, n_windows: int):
        """Yield (source, x, y, opens, weight) over the first n_windows consecutive val windows of each source
        (a mixture's each: what the same eval of that source alone gives, whatever the weights).

        Windows are dealt round-robin to ranks; every rank yields the same number of micro-batches
        (collectives inside forward must match), padding with weight 0.
        """
        for k in range(len(self.names)):
            available = (len(self.splits["val"][k]) - 1) // self.block_size
            wanted = min(n_windows, available)
            mine = np.arange(self.dp_rank, wanted, self.dp_size)
            per_rank = -(-wanted // self.dp_size)
            for i in range(-(-per_rank // self.micro_batch)):
                ids = mine[i * self.micro_batch:(i + 1) * self.micro_batch]
                weight = (torch.arange(self.micro_batch, device=self.device) < len(ids)).float()  # made on the device
                ids = np.concatenate([ids, np.zeros(self.micro_batch - len(ids), dtype=ids.dtype)])
                x, y, opens = self._rows("val", (np.full(len(ids), k), ids * self.block_size))
                yield k, x, y, opens, weight

    def cropped(self) -> dict[str, float]:
        """align_rows: each source's share of train tokens no row reads."""
        return {name: never_read(starts, len(tokens), self.block_size) / len(tokens)
                for name, starts, tokens in zip(self.names, self.starts, self.splits["train"]) if starts is not None}

    def scalars(self, step: int) -> dict[str, float]:
        """The progress after step `step`, as TensorBoard scalars: data/tokens (trained on so far), and a
        mixture's data/{name}/epoch and /tokens."""
        figures = {"data/tokens": self.tokens(step)}
        if self.mixture is not None:
            supplied, epochs = self.mixture.supplied(step), self.mixture.epochs(step)
            figures |= {f"data/{name}/{what}": value for name in self.names
                        for what, value in (("epoch", epochs[name]), ("tokens", supplied[name] * self.block_size))}
        return figures

    def position(self, step: int) -> str:
        """Where in the data step `step` read, in words (the guard's stop line names it)."""
        if self.mixture is None:
            return f"the batch of step {step} (seed {self.seed})"
        epochs = ", ".join(f"{name} epoch {e:.3f}" for name, e in self.mixture.epochs(step).items())
        return f"the batch of step {step} (seed {self.seed}; read so far: {epochs})"

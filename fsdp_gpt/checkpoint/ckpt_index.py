"""The index of a sharded checkpoint: which rank file holds which rows of every tensor.

Rank 0 writes it into the set's .complete marker once every rank has written its file (each
rank's layout is gathered to rank 0; no file is read back). A resume reads the marker once,
checks from the index alone that every row of every tensor is in the set, and each rank opens
only the rank files that overlap its own slices: one file at the same world size and strategy,
two or three when the world size changes. Without an index (sets written before it) every rank
opens every file.

index: {key: (rows of the whole tensor, table)}, key "model/{name}" or "optimizer/{name}/{state}";
table: int64 (saved world size, 2), row r = (offset, rows) held by rank r's file. Tensors split
alike share one table object, which torch.save stores once.
"""
import numpy as np
import torch

from fsdp_gpt.checkpoint.ckpt_format import CorruptCheckpoint


def model_key(name: str) -> str:
    return f"model/{name}"


def state_key(name: str, state: str) -> str:
    return f"optimizer/{name}/{state}"


def tensor_pieces(state: dict):
    """(key, piece) for every sliced tensor of one rank file's state: weights and optimizer moments."""
    for name, piece in state["model"].items():
        yield model_key(name), piece
    for name, saved in state["optimizer"].items():
        for key, value in saved.items():
            if isinstance(value, dict):
                yield state_key(name, key), value


def layout(state: dict) -> dict:
    """What the index records of one rank's file: {key: (rows of the whole tensor, offset, rows held)}."""
    return {key: (piece["shape"][0], piece["offset"], piece["data"].shape[0]) for key, piece in tensor_pieces(state)}


def build_index(layouts: list[dict]) -> dict:
    """The index from every rank's layout, in rank order."""
    tables, index = {}, {}
    for key, (rows, _, _) in layouts[0].items():
        table = tuple((lay[key][1], lay[key][2]) for lay in layouts)
        index[key] = (rows, tables.setdefault(table, torch.tensor(table, dtype=torch.int64)))
    return index


def check_whole(index: dict, marker: str) -> None:
    """Every row of every tensor is held by some rank file."""
    for key, (rows, table) in index.items():
        cursor = 0
        for offset, held in sorted(table.tolist()):
            if offset > cursor:
                break
            cursor = max(cursor, offset + held)
        if cursor < rows:
            raise CorruptCheckpoint(f"sharded checkpoint {marker} lists no rank file with rows {cursor}..{rows} of {key}")


def check_file(index: dict, state: dict, rank: int, path: str) -> None:
    """A rank file holds what the index says it holds."""
    if layout(state) != {key: (rows, *table[rank].tolist()) for key, (rows, table) in index.items()}:
        raise CorruptCheckpoint(f"rank file {path} does not hold the slices its checkpoint's index lists: "
                                f"the set mixes files of different checkpoints")


def wanted_rows(index: dict, slices: dict) -> dict:
    """{key: (offset, rows)} of every indexed tensor of the parameters in slices ({name: (offset,
    rows)}): a parameter's optimizer moments are split as the parameter is."""
    return {key: slices[name] for key in index if (name := key.split("/")[1]) in slices}


def files_to_open(index: dict, wanted: dict, own_rank: int) -> list[int]:
    """The saved ranks whose files hold this rank's rows; wanted: {key: (offset, rows)}.

    Greedy along each tensor's rows: a file already chosen first, then this rank's own file,
    then the one that reaches furthest.
    """
    chosen = set()
    for key, (offset, rows) in wanted.items():
        starts, held = index[key][1].numpy().T
        ends = starts + held
        cursor = offset
        while cursor < offset + rows:
            holders = np.flatnonzero((starts <= cursor) & (cursor < ends)).tolist()
            best = max(holders, key=lambda r: (r in chosen, r == own_rank, ends[r], -r))
            chosen.add(best)
            cursor = int(ends[best])
    return sorted(chosen)

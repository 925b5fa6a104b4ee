"""Multiple-choice evaluation (HellaSwag and its kind), scored as llm.c scores it.

Each choice is scored by the model's log-probabilities of its tokens given the context: a row is
the context's tokens, then the tokens of " " + choice. acc picks the choice with the largest sum of
log-probs, acc_norm the largest mean log-prob per choice token (llm.c's rule; lm-evaluation-harness
normalises by the choice's length in bytes instead, so its acc_norm differs). A row longer than
block_size + 1 tokens loses the start of its context (left truncation, as the harness does), and
its item is counted as truncated.

Files: HellaSwag's own jsonl (`ctx`, `endings`, `label`), a plain jsonl (`context`, `choices`,
`label`), or llm.c's hellaswag_val.bin (GPT-2 tokens, magic 20240522) as it is.
"""
import json
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from fsdp_gpt.config import UserError

LLMC_EVAL_MAGIC, LLMC_EVAL_VERSION = 20240522, 1
LLMC_HEADER_BYTES = 256 * 4  # 256 int32
LLMC_START_EXAMPLE = 2**16 - 1
FIELDS = (("ctx", "endings"), ("context", "choices"))  # HellaSwag's names, then the plain form's


@dataclass
class Item:
    context: list[int]
    choices: list[list[int]]
    label: int


# ---- reading ----
def read_items(path: str, tokenizer_name: str) -> list[Item]:
    """A file's items, tokenized with the run's tokenizer (llm.c's .bin holds GPT-2 tokens already)."""
    if not os.path.isfile(path):
        raise UserError(f"multiple-choice file {path} not found")
    if path.endswith(".bin"):
        if tokenizer_name != "gpt2":
            raise UserError(f"{path} holds GPT-2 tokens (llm.c's format) and the model reads '{tokenizer_name}' "
                            f"tokens: give the items as jsonl instead")
        return read_llmc(path)
    from fsdp_gpt.data.tokenizer import get_tokenizer  # only jsonl needs the tokenizer (gpt2's file may be absent offline)
    return read_jsonl(path, get_tokenizer(tokenizer_name))


def read_jsonl(path: str, tokenizer) -> list[Item]:
    items = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{where}: not JSON ({e.msg})")
            context, choices = _texts(record, where)
            label = _label(record.get("label") if isinstance(record, dict) else None, len(choices), where)
            items.append(Item(tokenizer.encode_ordinary(context),
                              [tokenizer.encode_ordinary(" " + choice) for choice in choices], label))
    if not items:
        raise UserError(f"{path} holds no items")
    return items


def _texts(record, where: str) -> tuple[str, list[str]]:
    for context_key, choices_key in FIELDS:
        if isinstance(record, dict) and context_key in record:
            context, choices = record[context_key], record.get(choices_key)
            if not isinstance(context, str) or not context:
                raise UserError(f"{where}: '{context_key}' must be a non-empty string")
            if not (isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) and c for c in choices)):
                raise UserError(f"{where}: '{choices_key}' must be a list of two or more non-empty strings")
            return context, choices
    raise UserError(f"{where}: no 'ctx' and 'endings' (HellaSwag) nor 'context' and 'choices' fields")


def _label(label, n_choices: int, where: str) -> int:
    if isinstance(label, str) and label.isdigit():  # the Hugging Face copy of HellaSwag stores "0".."3"
        label = int(label)
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < n_choices:
        raise UserError(f"{where}: 'label' must be the index of the right choice, 0 to {n_choices - 1}, got {label!r}")
    return label


def read_llmc(path: str) -> list[Item]:
    """llm.c's eval file: a header of 256 int32 (magic, version, examples, longest example), then per
    example a uint16 stream: 65535, its size in bytes, its index, the label, the number of
    completions, the context's length and tokens, then each completion's length and tokens."""
    data = np.fromfile(path, dtype=np.uint8)
    header = data[:LLMC_HEADER_BYTES].view(np.int32) if len(data) >= LLMC_HEADER_BYTES else np.zeros(3, np.int32)
    if header[0] != LLMC_EVAL_MAGIC or header[1] != LLMC_EVAL_VERSION:
        raise UserError(f"{path} is not an llm.c eval file (header {header[0]}, version {header[1]}; expected "
                        f"{LLMC_EVAL_MAGIC}, {LLMC_EVAL_VERSION})")
    body = data[LLMC_HEADER_BYTES:]
    stream = body[:len(body) // 2 * 2].view(np.uint16)
    items, at = [], 0
    for index in range(int(header[2])):
        where = f"{path} example {index}"
        if at + 6 > len(stream) or stream[at] != LLMC_START_EXAMPLE:
            raise UserError(f"{where}: truncated or misaligned (no example starts at token {at})")
        example = stream[at:at + int(stream[at + 1]) // 2].tolist()
        at += len(example)
        label, n_choices, pos = example[3], example[4], 5
        parts = []
        for _ in range(n_choices + 1):  # the context, then each choice: a length, then the tokens
            length = example[pos] if pos < len(example) else 0
            parts.append(example[pos + 1:pos + 1 + length])
            pos += 1 + length
        if pos != len(example) or any(not part for part in parts):
            raise UserError(f"{where}: its lengths don't add up to its size ({len(example) * 2} bytes)")
        items.append(Item(parts[0], parts[1:], _label(label, n_choices, where)))
    return items


# ---- scoring ----
def row(item: Item, choice: list[int], block_size: int) -> tuple[list[int], int]:
    """A choice's row (context then choice, cut to its last block_size + 1 tokens: the model reads
    all but the last and predicts all but the first) and how many of its choice tokens are scored."""
    tokens = (item.context + choice)[-(block_size + 1):]
    return tokens, min(len(choice), len(tokens) - 1)


def truncated(items: list[Item], block_size: int) -> int:
    """Items whose longest row is cut."""
    return sum(len(item.context) + max(map(len, item.choices)) > block_size + 1 for item in items)


@torch.no_grad()
def score_group(model, group: list[Item], block_size: int, device: torch.device) -> list[torch.Tensor]:
    """Per item, (choices, 2): each choice's sum and mean of log-probs of its tokens, all rows of the
    group in one forward. Rows are right-padded: causal attention keeps the padding out of every
    real position, and padded positions are not scored."""
    rows = [row(item, choice, block_size) for item in group for choice in item.choices]
    width = max(len(tokens) for tokens, _ in rows) - 1
    host = torch.zeros(3, len(rows), width, dtype=torch.long)  # x, y, scored: one copy to the device
    for r, (tokens, n) in enumerate(rows):
        host[0, r, :len(tokens) - 1], host[1, r, :len(tokens) - 1] = torch.tensor(tokens[:-1]), torch.tensor(tokens[1:])
        host[2, r, len(tokens) - 1 - n:len(tokens) - 1] = 1
    # from pinned memory the copy is queued behind the GPU's work instead of waiting for it to drain
    x, y, scored = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
    scored = scored.float()
    _, losses = model(x, y, reduction="none")  # (rows, width): each position's loss, no logits tensor
    logprobs = -losses * scored
    sums = logprobs.sum(1).double()
    scores = torch.stack([sums, sums / scored.sum(1)], dim=1)  # (rows, 2)
    return list(scores.split([len(item.choices) for item in group]))


def groups(items: list[Item], items_per_forward: int) -> list[list[Item]]:
    """The items of each forward: consecutive runs of items_per_forward, the same at any world size."""
    return [items[i:i + items_per_forward] for i in range(0, len(items), items_per_forward)]


def mc_sums(model, items: list[Item], block_size: int, items_per_forward: int, rank: int, world: int,
            device: torch.device) -> torch.Tensor:
    """float64 (right by sum, right by mean, items) over this rank's share. Groups of items_per_forward
    consecutive items, group g on rank g % world: each group is the same forward at any world
    size, so any world size gives the same numbers. Every rank runs as many forwards (under FSDP
    each forward's gathers are collectives): a rank out of groups scores group 0 again, uncounted."""
    forwards = groups(items, items_per_forward)
    total = torch.zeros(3, dtype=torch.float64, device=device)
    # eager even where the blocks are compiled: every new row width would compile a graph of its own
    with torch.compiler.set_stance("force_eager"):
        for g in range(rank, math.ceil(len(forwards) / world) * world, world):
            group = forwards[g] if g < len(forwards) else forwards[0]
            scores = score_group(model, group, block_size, device)
            if g < len(forwards):
                right = torch.stack([s.argmax(0) == item.label for s, item in zip(scores, group)])  # (items, 2)
                total[:2] += right.sum(0)
                total[2] += len(group)  # a Python number: no copy from the host
    return total


def accuracies(total: torch.Tensor) -> dict[str, float]:
    """acc and acc_norm from every rank's mc_sums."""
    right, right_norm, n = total.tolist()
    return {"acc": right / n, "acc_norm": right_norm / n}


def load_sets(paths: dict[str, str], tokenizer_name: str, vocab_size: int) -> dict[str, list[Item]]:
    """{name: items} of mc_eval_path, refusing tokens the model has no row for."""
    sets = {}
    for name, path in paths.items():
        items = read_items(path, tokenizer_name)
        top = max(max(item.context + [t for choice in item.choices for t in choice]) for item in items)
        if top >= vocab_size:
            raise UserError(f"{path} holds token {top}, past the model's vocab_size {vocab_size}")
        sets[name] = items
    return sets


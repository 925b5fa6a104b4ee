"""The sharded checkpoint index on its own: which files a rank opens, and whether a set is whole."""
import os

import pytest
import torch

from fsdp_gpt.checkpoint.ckpt_format import CorruptCheckpoint
from fsdp_gpt.distributed.shards import dim0_shard
from fsdp_gpt.checkpoint.ckpt_index import build_index, check_whole, files_to_open
from fsdp_gpt.config_parse import parse_args
from fsdp_gpt.model import GPT, GPTConfig
from conftest import ROOT

ROWS = {"model/wte.weight": 256, "model/ln.bias": 64, "model/odd.weight": 50, "model/tiny.bias": 3}


def flat_layouts(world: int) -> list[dict]:
    return [{key: (rows, *dim0_shard(rows, world, r)) for key, rows in ROWS.items()} for r in range(world)]


def model_rows(config: str) -> dict:
    """{key: rows} of a config's model, as the index keys its weights."""
    cfg = parse_args([os.path.join(ROOT, "config", config), "--vocab_size=50304"])
    with torch.device("meta"):
        return {f"model/{name}": p.shape[0] for name, p in GPT(GPTConfig.of(cfg)).named_parameters()}


def opened(rows: dict, saved_world: int, world: int) -> list[list[int]]:
    layouts = [{key: (n, *dim0_shard(n, saved_world, r)) for key, n in rows.items()} for r in range(saved_world)]
    index = build_index(layouts)
    return [files_to_open(index, {key: dim0_shard(n, world, r) for key, n in rows.items()}, r) for r in range(world)]


@pytest.mark.parametrize("config", ["demo_cpu.yaml", "train90M_fsdp.yaml", "train300M_fsdp.yaml"])
@pytest.mark.parametrize("saved, now, most", [(8, 8, 1), (8, 4, 3), (4, 6, 3), (6, 4, 3), (2, 1, 2), (1, 3, 1)])
def test_each_rank_opens_few_files_and_every_file_is_read(config, saved, now, most):
    files = opened(model_rows(config), saved, now)
    assert max(len(f) for f in files) <= most, files
    assert sorted({r for f in files for r in f}) == list(range(saved))  # together they read every row
    if saved == now:
        assert files == [[r] for r in range(now)]


def test_tensors_whose_rows_do_not_split_alike_need_more_files():
    """Each tensor is split on its own: 3 rows and 50 rows saved on 8 ranks, read on 4."""
    assert opened(ROWS, 8, 4) == [[0, 1], [1, 2, 3], [2, 3, 4, 5], [5, 6, 7]]


def test_tensors_split_alike_share_one_table():
    index = build_index(flat_layouts(4))
    assert index["model/wte.weight"][1] is not index["model/ln.bias"][1]
    layouts = flat_layouts(4)
    for layout in layouts:
        layout["model/wpe.weight"] = layout["model/wte.weight"]
    index = build_index(layouts)
    assert index["model/wpe.weight"][1] is index["model/wte.weight"][1]


def test_a_set_with_rows_nobody_holds_is_refused():
    layouts = flat_layouts(4)
    check_whole(build_index(layouts), "m")
    layouts[2]["model/odd.weight"] = (50, 26, 0)  # rank 2 held rows 26..39
    with pytest.raises(CorruptCheckpoint, match="lists no rank file with rows 26..50 of model/odd.weight"):
        check_whole(build_index(layouts), "m")

"""Same seed, same weights for any world size; only rank 0 ever builds the model whole."""
import json
import os

import pytest
import torch

from conftest import DEMO, ROOT, TINY, overrides, run_in_zygote

pytestmark = pytest.mark.slow


def test_initial_weights_identical_and_only_rank0_materialises(tmp_path):
    settings = {k: TINY[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "seed")}
    probe = os.path.join(ROOT, "tests", "init_probe.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for world in (1, 2, 4):
        argv = [probe, str(tmp_path), DEMO] + overrides(vocab_size=256, **settings)
        result = run_in_zygote(argv, str(tmp_path), env, world, timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
    reference = torch.load(tmp_path / "weights_world1.pt", weights_only=True)
    for world in (2, 4):
        weights = torch.load(tmp_path / f"weights_world{world}.pt", weights_only=True)
        assert weights.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(weights[name], tensor), (world, name)
        for rank in range(world):
            report = json.loads((tmp_path / f"world{world}_rank{rank}.json").read_text())
            if rank == 0:
                assert report["materialised"] == [report["total"]]
            else:
                assert report["materialised"] == []
            # what stays on each rank is its shard: about 1/world of the model
            assert report["local"] <= report["total"] / world * 1.1

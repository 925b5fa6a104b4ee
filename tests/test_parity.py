"""Distributed correctness by parity: 4 ranks under each strategy train the same run as one process."""
import os
import socket
import subprocess
import sys

import pytest

from conftest import DEMO, ROOT, TINY, overrides, run_trainer, scalars

pytestmark = pytest.mark.slow
STEPS = 8


@pytest.fixture(scope="module")
def single_process(corpus, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("ref"))
    result = run_trainer(run_dir, nproc=1, max_iters=STEPS, **corpus)
    assert "gradient accumulation 4" in result.stdout  # one process needs 4 micro-steps
    return {tag: scalars(os.path.join(run_dir, "tb"), tag) for tag in ("train/loss", "val/loss")}


@pytest.fixture(scope="module")
def four_ranks(corpus, tmp_path_factory):
    """strategy -> the folder of its 4-rank run (each run once per module)."""
    runs = {}

    def run(strategy: str) -> str:
        if strategy not in runs:
            run_dir = str(tmp_path_factory.mktemp(strategy))
            mode = dict(fsdp=False) if strategy == "DDP" else dict(sharding_strategy=strategy)
            result = run_trainer(run_dir, nproc=4, max_iters=STEPS, **mode, **corpus)
            assert "gradient accumulation 1" in result.stdout  # four ranks need none
            runs[strategy] = run_dir
        return runs[strategy]
    return run


def assert_parity(single_process, run_dir):
    for tag, reference in single_process.items():
        losses = scalars(os.path.join(run_dir, "tb"), tag)
        assert sorted(losses) == sorted(reference)
        for step, value in reference.items():
            assert losses[step] == pytest.approx(value, rel=1e-4), (tag, step)


# HYBRID_SHARD's (2, 2) mesh on 4 ranks: test_two_nodes_match_one_process
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "DDP"])
def test_four_ranks_match_one_process(strategy, single_process, four_ranks):
    assert_parity(single_process, four_ranks(strategy))
    assert len(single_process["train/loss"]) == STEPS
    # training moved the weights: the parity is not that of a model standing still
    assert single_process["train/loss"][STEPS] < single_process["train/loss"][1]


def test_standalone_evaluation_matches_the_four_rank_log(four_ranks):
    run_dir = four_ranks("FULL_SHARD")
    logged = scalars(os.path.join(run_dir, "tb"), "val/loss")[STEPS]
    result = subprocess.run([sys.executable, os.path.join(ROOT, "evaluate.py"),
                             os.path.join(run_dir, "ckpt", f"fsdp_cpt{STEPS}.pth")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    standalone = float(result.stdout.split("val loss ")[1].split()[0])
    assert standalone == pytest.approx(logged, rel=1e-5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "HYBRID_SHARD_ZERO2", "FULL_SHARD"])
def test_two_nodes_match_one_process(strategy, single_process, corpus, tmp_path):
    """Two torchrun launches of 2 ranks, as on two machines; each 'node' runs in its own folder,
    where relative checkpoint and log paths land (a node's local disk)."""
    port, nodes = free_port(), []
    settings = TINY | corpus | dict(max_iters=STEPS, sharding_strategy=strategy, checkpoint_dir="ckpt",
                                    tensorboard_dir="tb")
    for node_rank in (0, 1):
        (tmp_path / f"node{node_rank}").mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
               "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}",
               os.path.join(ROOT, "train_fsdp.py"), DEMO] + overrides(**settings)
        nodes.append(subprocess.Popen(cmd, cwd=tmp_path / f"node{node_rank}", text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1")))
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (stdout, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr[-3000:]
    if strategy.startswith("HYBRID"):  # sharded inside a node, replicated across the two
        assert "mesh DeviceMesh((replicate=2, shard=2)" in outputs[0][0]
    assert_parity(single_process, str(tmp_path / "node0"))
    # global rank 0 alone prints, logs and writes the full checkpoint
    assert os.listdir(tmp_path / "node1") == []
    assert "step " not in outputs[1][0]
    assert len(os.listdir(tmp_path / "node0" / "tb")) == 1
    assert os.listdir(tmp_path / "node0" / "ckpt") == [f"fsdp_cpt{STEPS}.pth"]

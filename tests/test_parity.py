"""Distributed correctness by parity: 4 ranks under each strategy train the same run as one process."""
import os
import subprocess
import sys

import pytest

from conftest import DEMO, ROOT, TINY, free_port, overrides, run_trainer, scalars

pytestmark = pytest.mark.slow
STEPS = 8


@pytest.fixture(scope="module")
def single_process(corpus, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("ref"))
    result = run_trainer(run_dir, nproc=1, max_iters=STEPS, **corpus)
    assert "gradient accumulation 4" in result.stdout  # one process needs 4 micro-steps
    # grad_norm catches a wrong reduction, or a missing division by the accumulation steps
    return {tag: scalars(os.path.join(run_dir, "tb"), tag) for tag in ("train/loss", "train/grad_norm", "val/loss")}


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


def test_two_ranks_match_one_process(single_process, corpus, tmp_path):
    """The parity a 2-GPU machine can run (bench/gpu_check.sh: NCCL there, gloo here)."""
    result = run_trainer(str(tmp_path), nproc=2, max_iters=STEPS, **corpus)
    assert "gradient accumulation 2" in result.stdout
    assert_parity(single_process, str(tmp_path))


def test_standalone_evaluation_matches_the_four_rank_log(four_ranks):
    run_dir = four_ranks("FULL_SHARD")
    logged = scalars(os.path.join(run_dir, "tb"), "val/loss")[STEPS]
    result = subprocess.run([sys.executable, os.path.join(ROOT, "evaluate.py"),
                             os.path.join(run_dir, "ckpt", f"fsdp_cpt{STEPS}.pth")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    standalone = float(result.stdout.split("val loss ")[1].split()[0])
    assert standalone == pytest.approx(logged, rel=1e-5)


def launch_two_nodes(tmp_path, settings: dict) -> list[tuple[int, str, str]]:
    """Two torchrun launches of 2 ranks, as on two machines, each in its own folder node0/node1,
    where relative checkpoint and log paths land (a node's local disk). (exit code, stdout, stderr) each."""
    port, nodes = free_port(), []
    for node_rank in (0, 1):
        (tmp_path / f"node{node_rank}").mkdir(exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
               "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}",
               os.path.join(ROOT, "train_fsdp.py"), DEMO] + overrides(**settings)
        nodes.append(subprocess.Popen(cmd, cwd=tmp_path / f"node{node_rank}", text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1")))
    return [(node.returncode, *output) for node, output in zip(nodes, [n.communicate(timeout=300) for n in nodes])]


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "HYBRID_SHARD_ZERO2", "FULL_SHARD"])
def test_two_nodes_match_one_process(strategy, single_process, corpus, tmp_path):
    settings = TINY | corpus | dict(max_iters=STEPS, sharding_strategy=strategy, checkpoint_dir="ckpt",
                                    tensorboard_dir="tb")
    outputs = launch_two_nodes(tmp_path, settings)
    for code, _, stderr in outputs:
        assert code == 0, stderr[-3000:]
    if strategy.startswith("HYBRID"):  # sharded inside a node, replicated across the two
        assert "mesh (replicate=2, shard=2)" in outputs[0][1]
    assert_parity(single_process, str(tmp_path / "node0"))
    # global rank 0 alone prints, logs and writes the full checkpoint
    assert os.listdir(tmp_path / "node1") == []
    assert "step " not in outputs[1][1]
    assert len(os.listdir(tmp_path / "node0" / "tb")) == 1
    assert os.listdir(tmp_path / "node0" / "ckpt") == [f"fsdp_cpt{STEPS}.pth"]


def test_sharded_checkpoints_on_node_local_disks(corpus, tmp_path):
    """Each node writes its ranks' files into its own folder; a resume that can't see the whole set
    on every rank stops with one line instead of starting from scratch on some ranks."""
    settings = TINY | corpus | dict(max_iters=2, save_interval=2, checkpoint_type="sharded", checkpoint_dir="ckpt",
                                    tensorboard_dir="tb")
    for code, _, stderr in launch_two_nodes(tmp_path, settings):
        assert code == 0, stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "node0" / "ckpt")) == [
        "fsdp_sharded_cpt2.complete", "fsdp_sharded_cpt2_rank0.pth", "fsdp_sharded_cpt2_rank1.pth"]
    assert sorted(os.listdir(tmp_path / "node1" / "ckpt")) == ["fsdp_sharded_cpt2_rank2.pth", "fsdp_sharded_cpt2_rank3.pth"]
    outputs = launch_two_nodes(tmp_path, settings | dict(max_iters=4, resume_from="latest"))
    for code, stdout, stderr in outputs:
        assert code != 0 and "starting from scratch" not in stdout
        assert ("ranks [2, 3] can't see ckpt/fsdp_sharded_cpt2.complete, which rank 0 sees: a sharded resume needs "
                "checkpoint_dir on a filesystem every node shares (or checkpoint_type: full)") in stderr


FAKE_SRUN = """#!/bin/bash
# stand-in for SLURM's srun: the command once per node, each with the variables SLURM gives its task
while [[ $1 == --* ]]; do shift; done
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 SLURM_NTASKS=$SLURM_NNODES "$@" &
done
code=0
for pid in $(jobs -p); do wait "$pid" || code=$?; done
exit $code
"""


def test_slurm_script_gives_each_node_its_rank(single_process, corpus, tmp_path):
    """train_slurm.sh as sbatch runs it, with stand-ins for srun and scontrol: two loopback nodes
    of 2 ranks each form one run of 4 ranks, which trains as one process does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    # the head node first, then a large allocation's worth of others (a reader that stops early
    # would end scontrol with SIGPIPE)
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\nseq -f 'node%g' 100000\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}", OMP_NUM_THREADS="1",
               SLURM_JOB_NODELIST="node[1-2]", SLURM_NNODES="2", SLURM_NTASKS="2", NPROC_PER_NODE="2",
               MASTER_PORT=str(free_port()))
    settings = TINY | corpus | dict(max_iters=STEPS, checkpoint_dir=str(tmp_path / "ckpt"),
                                    tensorboard_dir=str(tmp_path / "tb"))
    result = subprocess.run(["bash", os.path.join(ROOT, "train_slurm.sh"), DEMO, *overrides(**settings)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "4 ranks, FULL_SHARD" in result.stdout
    assert_parity(single_process, str(tmp_path))

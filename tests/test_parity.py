"""Distributed correctness by parity: 2 and 4 ranks under each strategy, two launches as two nodes
and the SLURM script train the same run as one process."""
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (DEMO, ROOT, RUN, TINY, TRAINER, assert_quiet, evaluated, free_port, launcher_once, overrides, scalars,
                      shared, stderr_of, torchrun_forking_workers)

pytestmark = pytest.mark.slow
STEPS = RUN["max_iters"]
TAGS = ("train/loss", "train/grad_norm", "val/loss")


def printed(run_dir: str) -> str:
    with open(os.path.join(run_dir, "stdout.txt")) as f:
        return f.read()


@pytest.fixture(scope="module")
def single_process(run_of):
    run_dir = run_of("one")
    assert "gradient accumulation 12" in printed(run_dir)  # one process takes 12 micro-steps of 2
    # grad_norm catches a wrong reduction, or a missing division by the accumulation steps
    return {tag: scalars(os.path.join(run_dir, "tb"), tag) for tag in TAGS}


def assert_parity(single_process, run_dir):
    for tag, reference in single_process.items():
        losses = scalars(os.path.join(run_dir, "tb"), tag)
        assert sorted(losses) == sorted(reference)
        for step, value in reference.items():
            assert losses[step] == pytest.approx(value, rel=1e-4), (tag, step)


# HYBRID_SHARD's (2, 2) mesh on 4 ranks runs here and as two nodes (test_two_nodes_match_one_process)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "DDP"])
def test_four_ranks_match_one_process(strategy, single_process, run_of):
    run_dir = run_of(strategy)
    assert "gradient accumulation 3" in printed(run_dir)  # 4 ranks take 3 micro-steps each
    assert_parity(single_process, run_dir)
    assert len(single_process["train/loss"]) == STEPS
    # training moved the weights: the parity is not that of a model standing still
    assert single_process["train/loss"][STEPS] < single_process["train/loss"][1]


def test_explicit_prefetch_names_the_next_units_each_way():
    """fsdp_prefetch's lists, a unit's first block standing for it (the FULL_SHARD run above trains with
    fsdp_prefetch 1 a unit a block, the deepest its 2 blocks allow, and matches one process)."""
    from fsdp_gpt.distributed.parallelize import prefetch

    class Block:
        def __init__(self, i):
            self.i, self.forward, self.backward = i, None, None

        def set_modules_to_forward_prefetch(self, blocks):
            self.forward = [b.i for b in blocks]

        def set_modules_to_backward_prefetch(self, blocks):
            self.backward = [b.i for b in blocks]
    blocks = [Block(i) for i in range(4)]
    prefetch([[b] for b in blocks], 2, says=False)
    assert [b.forward for b in blocks] == [[1, 2], [2, 3], [3], []]
    assert [b.backward for b in blocks] == [[], [0], [1, 0], [2, 1]]
    pairs = [Block(i) for i in range(5)]
    prefetch([pairs[0:2], pairs[2:4], pairs[4:]], 1, says=False)  # units of 2 blocks, the last of 1
    assert [b.forward for b in pairs] == [[2], None, [4], None, []]
    assert [b.backward for b in pairs] == [[], None, [0], None, [2]]
    untouched = [Block(i) for i in range(4)]
    prefetch([[b] for b in untouched], 0, says=False)  # FSDP2's own order
    assert all(b.forward is None and b.backward is None for b in untouched)
    cut = [Block(i) for i in range(3)]
    prefetch([[b] for b in cut], 5, says=False)  # past the units: as deep as they allow (2)
    assert [b.forward for b in cut] == [[1, 2], [2], []] and [b.backward for b in cut] == [[], [0], [1, 0]]


def test_units_of_several_blocks_at_three_ranks_match_one_process(corpus, tmp_path_factory):
    """FSDP units of 2 blocks and then 1 (fsdp_blocks_per_unit: 2 of a 3-block model), prefetched, at 3
    ranks (64-wide rows over 3: uneven shards), against one process: the layout between a unit a block
    and the whole model one unit, which the runs above take."""
    run = launcher_once(tmp_path_factory, "units", **RUN, **corpus, n_layer=3)
    units = run("units", 3, fsdp_blocks_per_unit=2, fsdp_prefetch=1)
    assert "FSDP units: 2 of 2 and 1 blocks" in printed(units)
    one = run("one", 1)
    assert_parity({tag: scalars(os.path.join(one, "tb"), tag) for tag in TAGS}, units)


# DDP's runs warn of find_unused_parameters, which parallelize.py sets on purpose
@pytest.mark.parametrize("name", ["full2", "FULL_SHARD", "NO_SHARD", "HYBRID_SHARD", "cp2", "cp2_hybrid"])
def test_a_healthy_run_prints_no_warning(name, run_of):
    assert_quiet(stderr_of(run_of(name)))


def test_two_ranks_match_one_process(single_process, run_of):
    """The parity a 2-GPU machine runs on NCCL (tests/test_gpu.py); gloo here."""
    run_dir = run_of("full2")
    assert "gradient accumulation 6" in printed(run_dir)
    assert_parity(single_process, run_dir)


def test_one_process_wrapped_by_force_fsdp_matches_the_unwrapped_one(single_process, run_of):
    run_dir = run_of("forced")
    assert "1 ranks, FULL_SHARD, mesh (shard=1), gradient accumulation 12" in printed(run_dir)
    assert_parity(single_process, run_dir)


def test_standalone_evaluation_matches_the_four_rank_log(run_of):
    run_dir = run_of("FULL_SHARD")
    logged = scalars(os.path.join(run_dir, "tb"), "val/loss")[STEPS]
    standalone = evaluated(os.path.join(run_dir, "ckpt", f"fsdp_sharded_cpt{STEPS}_rank0.pth"))
    assert standalone == pytest.approx(logged, rel=1e-5)


def launch_two_nodes(tmp_path, settings: dict) -> list[tuple[int, str, str]]:
    """Two torchrun launches of 2 ranks, as on two machines, each in its own folder node0/node1,
    where relative checkpoint and log paths land (a node's local disk). (exit code, stdout, stderr) each."""
    port, nodes = free_port(), []
    forking, env = torchrun_forking_workers()
    for node_rank in (0, 1):
        (tmp_path / f"node{node_rank}").mkdir(exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
               "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}", *forking,
               TRAINER, DEMO] + overrides(**settings)
        nodes.append(subprocess.Popen(cmd, cwd=tmp_path / f"node{node_rank}", text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1", **env)))
    return [(node.returncode, *output) for node, output in zip(nodes, [n.communicate(timeout=300) for n in nodes])]


# HYBRID_SHARD writes sharded checkpoints (each node its ranks' files, on its "local disk"), keeping the
# newest (keep_last: 1, which each node's ranks apply to their own files): the node-local test below
# resumes from them; HYBRID_SHARD_ZERO2 writes rank 0's full file. FULL_SHARD over two nodes is
# train_slurm.sh's run (test_slurm_script_gives_each_node_its_rank): two torchrun launches as here.
TWO_NODES = {"HYBRID_SHARD": "sharded", "HYBRID_SHARD_ZERO2": "full"}


@pytest.fixture(scope="module")
def two_nodes(corpus, tmp_path_factory):
    """two_nodes(strategy) -> (folder holding node0/ and node1/, their [code, stdout, stderr]), launched
    once per session."""
    def run(strategy: str):
        def launch(folder):
            settings = TINY | RUN | corpus | dict(sharding_strategy=strategy, checkpoint_type=TWO_NODES[strategy],
                                                  checkpoint_dir="ckpt", tensorboard_dir="tb",
                                                  keep_last=int(TWO_NODES[strategy] == "sharded"))
            outputs = launch_two_nodes(Path(folder), settings)
            (Path(folder) / "outputs.json").write_text(json.dumps(outputs))
        folder = Path(shared(tmp_path_factory, f"two_nodes/{strategy}", launch))
        return folder, json.loads((folder / "outputs.json").read_text())
    return run


@pytest.mark.parametrize("strategy", list(TWO_NODES))
def test_two_nodes_match_one_process(strategy, single_process, two_nodes):
    folder, outputs = two_nodes(strategy)
    for code, _, stderr in outputs:
        assert code == 0, stderr[-3000:]
    assert "mesh (replicate=2, shard=2)" in outputs[0][1]  # sharded inside a node, replicated across the two
    assert_parity(single_process, str(folder / "node0"))
    # global rank 0 alone prints and logs; it alone writes a full checkpoint, each rank its own shards
    assert "step " not in outputs[1][1]
    assert sorted(name.split(".")[0] for name in os.listdir(folder / "node0" / "tb")) == ["events", "metrics"]
    if TWO_NODES[strategy] == "full":
        assert os.listdir(folder / "node1") == []
        assert sorted(os.listdir(folder / "node0" / "ckpt")) == ["fsdp_cpt3.pth", f"fsdp_cpt{STEPS}.pth"]
    else:  # each node's own folder: the markers where rank 0 is; step 3's files gone from both (keep_last)
        assert os.listdir(folder / "node1") == ["ckpt"]
        assert sorted(os.listdir(folder / "node0" / "ckpt")) == [
            f"fsdp_sharded_cpt{STEPS}{end}" for end in (".complete", "_rank0.pth", "_rank1.pth")]
        assert sorted(os.listdir(folder / "node1" / "ckpt")) == [f"fsdp_sharded_cpt{STEPS}_rank{r}.pth" for r in (2, 3)]


def test_sharded_checkpoints_on_node_local_disks(two_nodes, corpus, tmp_path):
    """A resume that can't see the whole sharded set on every rank (each node wrote its ranks'
    files into its own folder) stops with one line instead of starting from scratch on some ranks."""
    folder, _ = two_nodes("HYBRID_SHARD")
    for node in ("node0", "node1"):
        shutil.copytree(folder / node / "ckpt", tmp_path / node / "ckpt")
    settings = TINY | RUN | corpus | dict(sharding_strategy="HYBRID_SHARD", checkpoint_type="sharded",
                                          checkpoint_dir="ckpt", tensorboard_dir="tb", max_iters=8, resume_from="latest")
    outputs = launch_two_nodes(tmp_path, settings)
    for code, stdout, _ in outputs:
        assert code != 0 and "starting from scratch" not in stdout
    # every rank stops with the same error; rank 0 alone prints it
    assert [line for line in outputs[0][2].splitlines() if line.startswith("error:")] == [
        f"error: ranks [2, 3] can't see ckpt/fsdp_sharded_cpt{STEPS}.complete, which rank 0 sees: a sharded resume "
        f"needs checkpoint_dir on a filesystem every node shares (or checkpoint_type: full)"]
    assert "error:" not in outputs[1][2]


# torchrun as train_slurm.sh calls it (its options, each one word as --key=value, then the script), its
# workers forked from the tests' zygote
FORKING_TORCHRUN = """#!/bin/bash
options=()
while [[ $1 == --* ]]; do options+=("$1"); shift; done
exec "$ZYGOTE_INTERPRETER" -m torch.distributed.run "${options[@]}" %s "$@"
"""

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
    forking, zygote_env = torchrun_forking_workers()
    (bin_dir / "torchrun").write_text(FORKING_TORCHRUN % shlex.join(forking))
    # the head node first, then a large allocation's worth of others (a reader that stops early
    # would end scontrol with SIGPIPE)
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\nseq -f 'node%g' 100000\n")
    for tool in ("srun", "scontrol", "torchrun"):
        (bin_dir / tool).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}", OMP_NUM_THREADS="1",
               SLURM_JOB_NODELIST="node[1-2]", SLURM_NNODES="2", SLURM_NTASKS="2", NPROC_PER_NODE="2",
               MASTER_PORT=str(free_port()), **zygote_env)
    settings = TINY | RUN | corpus | dict(checkpoint_dir=str(tmp_path / "ckpt"), tensorboard_dir=str(tmp_path / "tb"))
    result = subprocess.run(["bash", os.path.join(ROOT, "train_slurm.sh"), DEMO, *overrides(**settings)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "4 ranks, FULL_SHARD" in result.stdout
    assert_parity(single_process, str(tmp_path))

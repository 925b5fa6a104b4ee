"""Shared helpers: a tiny corpus, a tiny model config, and launching the real trainer."""
import glob
import os
import socket
import subprocess
import sys
import sysconfig

import pytest
import torch.distributed as dist

# Tests run on the CPU wherever they run: the trainer picks CUDA when it sees a GPU, and a 4-rank
# test on a 1-GPU machine would die of an invalid device ordinal. Set before anything touches CUDA;
# every process a test starts inherits it. GPU tests (test_gpu.py) hand the GPUs back (gpu_env).
VISIBLE_GPUS = os.environ.get("CUDA_VISIBLE_DEVICES")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "config", "demo_cpu.yaml")

# fp32, no dropout: runs that must agree step by step
TINY = dict(n_layer=2, n_head=2, n_embd=64, block_size=32, dropout=0.0, dtype="fp32", train_batch=8,
            micro_batch=2, max_iters=8, warmup_iters=2, lr_decay_iters=8, learning_rate=3e-3, min_lr=3e-4,
            log_interval=1, eval_interval=4, eval_iters=1, save_interval=1000, tokenizer="bytes", seed=7,
            sample_tokens=0)


def trainer_cmd(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, os.path.join(ROOT, "train_fsdp.py")]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            os.path.join(ROOT, "train_fsdp.py")]


def overrides(**kwargs) -> list[str]:
    return [f"--{k}={'null' if v is None else v}" for k, v in kwargs.items()]


def run_trainer(run_dir, nproc=1, config=DEMO, timeout=300, check=True, launcher=None, env=None, **kwargs):
    """Run train_fsdp.py (under torchrun for nproc > 1) with TINY settings plus kwargs."""
    settings = dict(TINY, checkpoint_dir=os.path.join(run_dir, "ckpt"),
                    tensorboard_dir=os.path.join(run_dir, "tb")) | kwargs
    cmd = (launcher or trainer_cmd(nproc)) + [config] + overrides(**settings)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1") | (env or {})
    result = subprocess.run(cmd, cwd=run_dir, env=env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"trainer failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_once(tmp_path_factory, **common):
    """run(name, nproc, **settings) -> the folder of a trainer run with `common` and `settings`,
    launched the first time a name is asked for (module fixtures share runs between tests)."""
    made = {}

    def run(name: str, nproc: int, **settings) -> str:
        if name not in made:
            made[name] = str(tmp_path_factory.mktemp(name))
            run_trainer(made[name], nproc=nproc, **(common | settings))
        return made[name]
    return run


def _event_files(tb_dir: str):
    """An EventAccumulator per TensorBoard events file in tb_dir, oldest first."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    for path in sorted(glob.glob(os.path.join(tb_dir, "events.*"))):
        acc = EventAccumulator(path, size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        yield acc


def scalars(tb_dir: str, tag: str) -> dict[int, float]:
    """{step: value} of one TensorBoard tag across every events file in tb_dir."""
    values = {}
    for acc in _event_files(tb_dir):
        if tag in acc.Tags()["scalars"]:
            values |= {e.step: e.value for e in acc.Scalars(tag)}
    return values


def texts(tb_dir: str, tag: str) -> dict[int, str]:
    """{step: text} of one TensorBoard text tag."""
    values = {}
    for acc in _event_files(tb_dir):
        if f"{tag}/text_summary" in acc.Tags()["tensors"]:
            values |= {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(f"{tag}/text_summary")}
    return values


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict:
    """A small byte-level dataset prepared once from a few standard-library modules."""
    stdlib = sysconfig.get_paths()["stdlib"]
    data_path = str(tmp_path_factory.mktemp("data") / "tiny")
    source = os.path.join(stdlib, "json", "*.py")
    return dict(data_path=data_path, data_source=f"[{source}, {os.path.join(stdlib, 'email', '*.py')}]")


# 24 sequences a step: 1, 2, 3 and 4 ranks each take whole micro-batches of 2
RUN = dict(train_batch=24, max_iters=6, save_interval=3, eval_interval=3)


@pytest.fixture(scope="session")
def two_rank_runs(corpus, tmp_path_factory):
    """Two 2-rank runs of 6 steps, checkpointing at 3 and 6: one full, one sharded (written async)."""
    runs = {}
    for kind in ("full", "sharded"):
        run_dir = str(tmp_path_factory.mktemp(kind))
        # with a text sample at each eval: the sharded model generates between training steps
        run_trainer(run_dir, nproc=2, checkpoint_type=kind, async_save=kind == "sharded", sample_tokens=8,
                    **RUN, **corpus)
        runs[kind] = run_dir
    return runs


@pytest.fixture(scope="session")
def gpu_count() -> int:
    """GPUs the machine has (counted in a child process: this one must never initialise CUDA)."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | (
        {"CUDA_VISIBLE_DEVICES": VISIBLE_GPUS} if VISIBLE_GPUS is not None else {})
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"], env=env,
                         capture_output=True, text=True, timeout=120)
    return int(out.stdout.strip() or 0)


@pytest.fixture
def gpu_env(gpu_count):
    """gpu_env(n): the environment for a child process that sees the machine's GPUs; the test skips
    (with the reason) where fewer than n are present."""
    def env(n: int = 1) -> dict:
        if gpu_count < n:
            pytest.skip(f"needs {n} GPU{'s' * (n > 1)}, this machine has {gpu_count}")
        return {"CUDA_VISIBLE_DEVICES": VISIBLE_GPUS if VISIBLE_GPUS is not None else ",".join(map(str, range(gpu_count)))}
    return env


@pytest.fixture
def one_process_group():
    """A process group of one (gloo), for code that runs collectives, in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def checkpoint_of(run_dir, kind, step, rank=1):
    name = f"fsdp_cpt{step}.pth" if kind == "full" else f"fsdp_sharded_cpt{step}_rank{rank}.pth"
    return os.path.join(run_dir, "ckpt", name)

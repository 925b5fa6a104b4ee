"""Shared helpers: a tiny corpus, a tiny model config, running the real trainer (started as
tests/launching.py starts it), and the runs many tests read, launched once per session."""
import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch
import torch.distributed as dist

from launching import (ROOT, TRAINER, Spawned, free_port, launch, run_env, run_in_zygote,  # noqa: F401 - the tests'
                       torchrun_forking_workers, trainer_cmd, zygote_python)  # names for them, as conftest's
from fsdp_gpt.config_parse import parse_args
from fsdp_gpt.data.prepare import prepare_data
from fsdp_gpt.model import GPT, GPTConfig
from fsdp_gpt.observe.figures_file import read_figures as figures, read_records as records  # noqa: F401 - likewise
from fsdp_gpt.observe.metrics import read_scalars as scalars, read_texts as texts  # noqa: F401 - the tests' names for them
from fsdp_gpt.observe.metrics import scalar_tags, text_tags


def written_tags(tb_dir: str) -> set[str]:
    """Every tag a run wrote: TensorBoard's scalars and texts, and metrics.jsonl's figures (the tags that
    doc_tables.undeclared checks against their owners' TAGS)."""
    in_file = {name for record in records(tb_dir) for name in record} - {"step", "time", "kind"}
    return scalar_tags(tb_dir) | text_tags(tb_dir) | in_file

# Tests run on the CPU wherever they run: the trainer picks CUDA when it sees a GPU, and a 4-rank
# test on a 1-GPU machine would die of an invalid device ordinal. Set before anything touches CUDA;
# every process a test starts inherits it. GPU tests (test_gpu.py) hand the GPUs back (gpu_env).
VISIBLE_GPUS = os.environ.get("CUDA_VISIBLE_DEVICES")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

DEMO = os.path.join(ROOT, "config", "demo_cpu.yaml")

# fp32, no dropout: runs that must agree step by step
TINY = dict(n_layer=2, n_head=2, n_embd=64, block_size=32, dropout=0.0, dtype="fp32", train_batch=8,
            micro_batch=2, max_iters=8, warmup_iters=2, lr_decay_iters=8, learning_rate=3e-3, min_lr=3e-4,
            log_interval=1, eval_interval=4, eval_iters=1, save_interval=1000, tokenizer="bytes", seed=7,
            sample_tokens=0)


# the classes the tests compare with as transformers 5 computes them: 4.51 (CI's oldest venv) has none of
# them or, DeepSeek V3's, one that predates rope_parameters
TRANSFORMERS_5_CLASSES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "GptOssForCausalLM", "Qwen3_5ForCausalLM",
                          "Qwen3_5MoeForCausalLM", "Olmo3ForCausalLM")


def needs_transformers(what: str, major: int = 5) -> None:
    """A test that compares with transformers' code (a class, an integration) skips, saying so, on a
    transformers older than the one that brought it."""
    import transformers
    if int(transformers.__version__.split(".")[0]) < major:
        pytest.skip(f"transformers {transformers.__version__} predates {what} (transformers {major}'s)")


def needs_class(architecture: str) -> None:
    """A family's reference class: skipped, saying so, where the installed transformers lacks it (SmolLM3
    arrived in 4.53) or has it only as it was before transformers 5."""
    import transformers
    if not hasattr(transformers, architecture):
        pytest.skip(f"transformers {transformers.__version__} has no {architecture}")
    if architecture in TRANSFORMERS_5_CLASSES:
        needs_transformers(architecture)


def counted_parameters(config: str, *args: str) -> int:
    """The parameters the trainer counts for a config and its overrides: GPT.num_params on the meta
    device, as build_model counts them before it prints them (the demo's test reads that line)."""
    cfg = parse_args([config, *args])
    with torch.device("meta"):
        return GPT(GPTConfig.of(cfg)).num_params()


def overrides(**kwargs) -> list[str]:
    return [f"--{k}={'null' if v is None else v}" for k, v in kwargs.items()]


# the longest tests first, so that pytest-xdist's workers finish together instead of one of them
# starting the demo last
LONGEST_FIRST = ("test_demo.py::", "test_scale.py::test_full_shard_memory", "test_gpu_paths.py::test_gpu_check",
                 "test_llama.py::test_resharded", "test_scale.py::test_feature")


def pytest_collection_modifyitems(items):
    def rank(item):
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if prefix in item.nodeid), len(LONGEST_FIRST))
    items.sort(key=rank)  # stable: otherwise the collected order


def run_trainer(run_dir, nproc=1, config=DEMO, timeout=300, check=True, launcher=None, env=None,
                script=TRAINER, **kwargs):
    """Run the trainer (or a probe `script` that runs it) on nproc ranks with TINY settings plus kwargs."""
    settings = dict(TINY, checkpoint_dir=os.path.join(run_dir, "ckpt"),
                    tensorboard_dir=os.path.join(run_dir, "tb")) | kwargs
    result = launch([script, config] + overrides(**settings), run_dir, nproc, env, timeout, launcher)
    if check and result.returncode != 0:
        raise AssertionError(f"trainer failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def tool(script: str, *args, env: dict | None = None) -> str:
    """What a tool (sample.py, evaluate.py, export_hf.py, consolidate.py) prints; it must exit 0."""
    result = launch([os.path.join(ROOT, script), *map(str, args)], ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def hf_val_loss(folder, corpus: dict, architecture: str, train_batch: int = TINY["train_batch"]) -> float:
    """transformers' val loss of an exported folder on the corpus's val windows of a TINY run with
    this train_batch, as evaluate.py and the trainer's val/loss take them; the folder must load as
    `architecture`."""
    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_gpt.data.loader import BatchLoader
    from fsdp_gpt.data.prepare import prepare_data
    from fsdp_gpt.evaluation.val_loss import val_loss_sums

    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(hf).__name__ == architecture
    meta = prepare_data(corpus["data_path"], None, "bytes")
    loader = BatchLoader({"data": (corpus["data_path"], meta)}, TINY["block_size"], TINY["micro_batch"],
                         TINY["micro_batch"], 0, 1, TINY["seed"], torch.device("cpu"))
    windows = TINY["eval_iters"] * train_batch
    total, count = val_loss_sums(as_gpt(hf), loader, windows)[0].tolist()
    return total / count


def as_gpt(hf):
    """A transformers model called as the evaluation calls model.GPT: (None, each position's loss)."""
    import torch.nn.functional as F

    def forward(x, y, positions=None, opens=None, reduction="none"):
        assert reduction == "none" and opens is None
        return None, F.cross_entropy(hf(x).logits.float().flatten(0, 1), y.flatten(), reduction="none").view_as(y)
    return forward


def evaluated(checkpoint, *args, env: dict | None = None) -> float:
    """The val loss evaluate.py reports for a checkpoint."""
    return float(tool("evaluate.py", checkpoint, *args, env=env).split("val loss ")[1].split()[0])


@contextlib.contextmanager
def _locked(path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def shared(tmp_path_factory, name: str, make) -> str:
    """The folder `name`, made by make(folder) once per session whichever test (or pytest-xdist
    worker) asks first; the others wait for it, then read it."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"  # one per session
    folder = root / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _locked(f"{folder}.lock"):
        if not (folder / ".done").exists():
            shutil.rmtree(folder, ignore_errors=True)  # a failed attempt's leftovers
            folder.mkdir()
            make(str(folder))
            (folder / ".done").touch()
    return str(folder)


def launcher_once(tmp_path_factory, group: str, **common):
    """run(name, nproc, **settings) -> the folder of a trainer run with `common` and `settings`,
    launched the first time `group/name` is asked for in the session."""
    def launch(folder: str, nproc: int, settings: dict) -> None:
        result = run_trainer(folder, nproc=nproc, **(common | settings))
        for stream in ("stdout", "stderr"):  # what the run printed, for tests to read
            with open(os.path.join(folder, f"{stream}.txt"), "w") as f:
                f.write(getattr(result, stream))

    def run(name: str, nproc: int, **settings) -> str:
        return shared(tmp_path_factory, f"{group}/{name}", lambda folder: launch(folder, nproc, settings))
    return run


# Python's warnings (UserWarning: ...) and torch's logged ones ([rank0]:W1126 12:00:00.1 ..., [W1126 ... reducer.cpp])
WARNING_LINE = re.compile(r"Warning\b|^(\[rank\d+\]:)?\[?[WE]\d{4} \d")


def stderr_of(run_dir: str) -> str:
    """What a shared run (launcher_once) printed on stderr."""
    with open(os.path.join(run_dir, "stderr.txt")) as f:
        return f.read()


def assert_quiet(stderr: str) -> None:
    """A healthy run printed no warning: nothing a user could take for a problem, or be unable to act on."""
    warnings = [line for line in stderr.splitlines() if WARNING_LINE.search(line)]
    assert not warnings, "\n".join(warnings)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict:
    """A small byte-level dataset from a few standard-library modules, prepared once."""
    stdlib = sysconfig.get_paths()["stdlib"]
    sources = [os.path.join(stdlib, "json", "*.py"), os.path.join(stdlib, "email", "*.py")]
    folder = shared(tmp_path_factory, "corpus", lambda folder: prepare_data(folder, sources, "bytes"))
    return dict(data_path=folder, data_source=f"[{', '.join(sources)}]")


# 24 sequences a step: 1, 2, 3 and 4 ranks each take whole micro-batches of 2
RUN = dict(train_batch=24, max_iters=6, save_interval=3, eval_interval=3)
# The runs many tests read: RUN's 6 steps, checkpoints at 3 and 6, each launched once per session.
CANONICAL = {  # name: (ranks, settings)
    "one": (1, dict(checkpoint_type="full")),
    # one process wrapped in FSDP2 all the same: what bench/gpu_check.sh runs on one GPU
    "forced": (1, dict(force_fsdp=True, checkpoint_type="sharded")),
    # with a text sample at each eval: the model generates between training steps
    "full2": (2, dict(checkpoint_type="full", sample_tokens=8)),
    # a unit a block (as models whose blocks compute long enough are laid out; the tiny model's auto
    # layout is one unit for the whole model: fsdp_units.py), a block's unit resharded after forward
    "sharded2": (2, dict(checkpoint_type="sharded", async_save=True, sample_tokens=8, fsdp_blocks_per_unit=1)),
    # with explicit prefetch: each block's forward and backward start the next block's all-gathers
    "FULL_SHARD": (4, dict(checkpoint_type="sharded", fsdp_prefetch=1, fsdp_blocks_per_unit=1)),  # 1: the most 2 blocks have
    "SHARD_GRAD_OP": (4, dict(sharding_strategy="SHARD_GRAD_OP", checkpoint_type="sharded")),
    "NO_SHARD": (4, dict(sharding_strategy="NO_SHARD", checkpoint_type="sharded")),
    "HYBRID_SHARD": (4, dict(sharding_strategy="HYBRID_SHARD", fsdp_size=2, checkpoint_type="sharded")),
    "DDP": (4, dict(fsdp=False, checkpoint_type="sharded")),
    # context parallelism: each row over 2 ranks, alone and beside 2-way data parallelism
    "cp2": (2, dict(cp_size=2, checkpoint_type="sharded")),
    "cp2_dp2": (4, dict(cp_size=2, checkpoint_type="sharded")),
    "cp2_hybrid": (4, dict(cp_size=2, sharding_strategy="HYBRID_SHARD", fsdp_size=2, checkpoint_type="sharded")),
    "cp2_ddp": (2, dict(cp_size=2, fsdp=False, checkpoint_type="sharded")),
}


@pytest.fixture(scope="session")
def run_of(corpus, tmp_path_factory):
    """run_of(name) -> the folder of the CANONICAL run `name`."""
    launch = launcher_once(tmp_path_factory, "canonical", **RUN, **corpus)
    return lambda name: launch(name, CANONICAL[name][0], **CANONICAL[name][1])


# The run the restart tests end as (a stopped rank, a killed worker, a lost node): TINY on 2 ranks for 12
# steps, a checkpoint every 2; what they add (timeouts, keep_last, folders) leaves the losses alone.
RESTARTED = dict(max_iters=12, save_interval=2)


@pytest.fixture(scope="session")
def uninterrupted(corpus, tmp_path_factory) -> str:
    """The folder of the RESTARTED run without a failure, launched once."""
    return launcher_once(tmp_path_factory, "restarted", **RESTARTED, **corpus)("uninterrupted", 2)


@pytest.fixture(scope="session")
def two_rank_runs(run_of):
    """{"full": ..., "sharded": ...}: the two 2-rank runs (the sharded one written async), each
    launched when first read."""
    class Runs:
        def __getitem__(self, kind):
            return run_of({"full": "full2", "sharded": "sharded2"}[kind])
    return Runs()


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

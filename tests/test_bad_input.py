"""Bad input: one clear line naming the problem, a non-zero exit, no traceback."""
import os
import shutil
import signal
import subprocess
import threading
import types

import pytest
import torch
import torch.distributed as dist

import train_fsdp
from fsdp_gpt.config import EP_STRATEGIES, FP8_LAYERS, FP8_RECIPES, OPTIMIZERS, exit_code
from fsdp_gpt.config_checks import archs_taking
from fsdp_gpt.config_parse import parse_args
from fsdp_gpt.families import ARCHS
from conftest import DEMO, ROOT, TINY, overrides, run_trainer


def assert_one_line_error(result, *phrases):
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    for phrase in phrases:
        assert phrase in errors[0], errors[0]


def train_in_process(argv, tmp_path, monkeypatch) -> int:
    """The trainer's body in this process, as its entry point runs it. However it ends, its watchdog
    ends with it: one left armed would end this process (the test session's worker) init_timeout later."""
    monkeypatch.chdir(tmp_path)
    try:
        return exit_code(lambda: train_fsdp.train(parse_args(argv)))
    finally:
        if dist.is_initialized():  # the failure came after the process group was made
            dist.destroy_process_group()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the trainer's handler
        for watchdog in (t for t in threading.enumerate() if t.name == "watchdog"):
            watchdog.join(timeout=5)
            assert not watchdog.is_alive(), "the trainer left its watchdog running"


def one_line(code, capsys, *phrases):
    out = capsys.readouterr()
    assert_one_line_error(types.SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err), *phrases)


@pytest.mark.parametrize("override, phrases", [
    ({"learning_rat": 0.1}, ["unknown config key 'learning_rat'", "did you mean 'learning_rate'"]),
    ({"max_iters": "many"}, ["'max_iters'", "must be int"]),
    ({"fsdp": 3}, ["'fsdp'", "must be bool"]),
    ({"train_batch": 10, "micro_batch": 4}, ["micro_batch=4 must divide train_batch=10"]),
    ({"n_embd": 64, "n_head": 5}, ["n_head=5 must divide n_embd=64"]),
    ({"sharding_strategy": "ZERO3"}, ["sharding_strategy 'ZERO3'"]),
    ({"fsdp_size": 0}, ["fsdp_size must be positive"]),
    ({"dtype": "fp16", "cpu_offload": True}, ["dtype fp16", "with cpu_offload: true is not supported"]),
    ({"force_fsdp": True, "fsdp": False}, ["force_fsdp: true needs fsdp: true"]),
    ({"fsdp_prefetch": -1}, ["fsdp_prefetch must be 0 or more blocks, got -1"]),
    ({"fsdp_prefetch": 1, "fsdp": False}, ["fsdp_prefetch needs fsdp: true"]),
    ({"arch": "llama", "moe_experts": 4, "ep_size": 2, "fsdp_prefetch": 1}, ["fsdp_prefetch with ep_size > 1"]),
    ({"n_layer": 4, "fsdp_prefetch": 100}, ["fsdp_prefetch=100 reaches past the model's 4 blocks: at most 3"]),
    ({"fsdp": False, "fsdp_blocks_per_unit": 2}, ["fsdp_blocks_per_unit needs fsdp: true (DDP has no FSDP units)"]),
    # lists of names are the tables' (config.py's, families/'s): a new entry needs no edit here
    ({"fp8": "e4m3"}, [f"fp8 'e4m3' is not one of {', '.join(FP8_RECIPES)} (null: off)", "tensorwise"]),
    ({"fp8": "tensorwise", "fp8_layers": "most"}, [f"fp8_layers 'most' is not one of {', '.join(FP8_LAYERS)}"]),
    ({"fp8_emulate": True}, [f"fp8_layers and fp8_emulate configure FP8 matmuls: set fp8 ({', '.join(FP8_RECIPES)})"]),
    ({"optimizer": "sgd"}, [f"optimizer 'sgd' is not one of {', '.join(OPTIMIZERS)}", "adamw"]),
    ({"sliding_window": 0}, ["sliding_window must be 1 or more tokens (null: full attention), got 0"]),
    ({"sliding_window": -4}, ["sliding_window must be 1 or more tokens", "got -4"]),
    ({"sliding_window": 8, "window_pattern": "[local, sliding]"},
     ["window_pattern must be a list of local and global", "got ['local', 'sliding']"]),
    ({"window_pattern": "[local, global]"}, ["window_pattern names local layers for sliding_window: set it"]),
    ({"rope_local_theta": 10000.0}, [f"rope_local_theta=10000.0 needs arch: {archs_taking('rope_local_theta')} (GPT-2"]),
    # no local layer: a Gemma 3 run (or its checkpoint resumed) without its window, or all layers global
    ({"arch": "gemma3", "rope_local_theta": 20000.0}, ["rope_local_theta=20000 is the local layers' RoPE base, and no "
                                                       "layer is local (sliding_window: null): make a layer local"]),
    ({"arch": "gemma3", "rope_local_theta": 2e4, "sliding_window": 8, "window_pattern": "[global]"},
     ["no layer is local (window_pattern ['global'] over 2 layers)", "or set rope_local_theta: null"]),
    # local layers without positions (SmolLM3's NoPE) take no base either
    ({"arch": "llama", "rope_local_theta": 2e4, "sliding_window": 8, "window_pattern": "[global, local]",
      "rope_pattern": "[rope, nope]", "n_layer": 4},
     ["rope_local_theta=20000 is the local layers' RoPE base, and no local layer rotates (rope_pattern ['rope', "
      "'nope'] leaves layers [1, 3] without positions): rotate a local layer (rope_pattern), or set rope_local_theta: null"]),
    ({"arch": "llama", "rope_pattern": "[rope, none]"}, ["rope_pattern must be a list of rope and nope", "got ['rope', 'none']"]),
    ({"arch": "llama", "rope_scaling": "{rope_type: yarn, factor: 4.0}"},
     ["rope_scaling: yarn RoPE scaling needs numbers for original_max_position_embeddings"]),
    ({"arch": "llama", "rope_scaling": "{rope_type: yarn, factor: 4.0, original_max_position_embeddings: 64, beta: 2}"},
     ["rope_scaling: yarn RoPE scaling has no beta (it takes factor, original_max_position_embeddings, beta_fast"]),
    ({"arch": "llama", "partial_rotary_factor": 0.3}, ["partial_rotary_factor=0.3 must be in (0, 1] and rotate an even "
                                                         "number of each head's 32 dimensions", "not 9"]),
    ({"partial_rotary_factor": 0.5}, [f"partial_rotary_factor=0.5 needs arch: {archs_taking('partial_rotary_factor')} (GPT-2"]),
    # the family's pattern where the key is null (SmolLM3's: layer 3 takes no positions), and a bad pattern
    # named as such before the window's check reads it
    ({"arch": "smollm3", "n_layer": 4, "sliding_window": 8, "window_pattern": "[global, global, global, local]",
      "rope_local_theta": 2e4}, ["no local layer rotates (rope_pattern ['rope', 'rope', 'rope', 'nope'] leaves layers [3]"]),
    ({"arch": "llama", "sliding_window": 8, "rope_local_theta": 2e4, "rope_pattern": "[none]"},
     ["rope_pattern must be a list of rope and nope", "got ['none']"]),
    ({"attn_scale_dim": 0}, ["attn_scale_dim must be positive (null: head_dim), got 0"]),
    ({"arch": "mamba"}, [f"arch 'mamba' is not one of {', '.join(ARCHS)}", "gpt2"]),
    ({"arch": "llama", "n_head": 4, "n_kv_head": 3}, ["n_kv_head=3 must divide n_head=4"]),
    ({"arch": "llama", "n_head": 2, "n_embd": 66}, ["head dimension n_embd / n_head = 33 must be even for RoPE"]),
    ({"qk_norm": True}, [f"qk_norm=True needs arch: {archs_taking('qk_norm')} (GPT-2 takes no qk_norm)"]),
    ({"arch": "llama", "moe_experts": 4, "moe_top_k": 5}, ["moe_top_k=5 must be 1 to moe_experts=4"]),
    ({"moe_experts": 4}, [f"moe_experts=4 needs arch: {archs_taking('moe_experts')} (GPT-2"]),
    ({"arch": "llama", "moe_experts": 4, "mlp": "relu2"}, ["MoE layers are built of gated experts (swiglu, geglu, clamped_swiglu): mlp: relu2"]),
    ({"moe_top_k": 1}, ["moe_top_k configure experts: set moe_experts"]),
    ({"arch": "gpt_oss", "moe_experts": 4, "dropout": 0.1}, ["dropout=0.1 with gpt-oss's attention sinks is not built"]),
    ({"arch": "llama", "moe_experts": 6, "ep_size": 4}, ["ep_size=4 must divide moe_experts=6"]),
    ({"ep_size": 2}, ["ep_size=2 splits a mixture's experts over ranks, and moe_experts: 0 is a dense model"]),
    ({"ep_size": 0}, ["ep_size must be 1 or more, got 0"]),
    ({"cp_size": 0}, ["cp_size must be 1 or more, got 0"]),
    # 0 is no width (null is the default one), and a negative clip would turn every gradient round
    ({"arch": "llama", "moe_experts": 4, "moe_hidden": 0}, ["moe_hidden must be positive (null: ffn_hidden / moe_top_k)",
                                                            "got 0, 0"]),
    ({"arch": "llama", "moe_experts": 4, "moe_hidden": -64}, ["moe_hidden must be positive", "got -64, 0"]),
    ({"grad_clip": -1.0}, ["grad_clip must be 0 (no clipping) or more, got -1.0"]),
    ({"arch": "llama", "moe_experts": 4, "ep_size": 2, "fsdp": False},
     [f"ep_size=2 needs FSDP with {', '.join(EP_STRATEGIES)} (DDP"]),
    ({"arch": "llama", "moe_experts": 4, "ep_size": 2, "sharding_strategy": "NO_SHARD"}, ["NO_SHARD hold every weight"]),
    ({"arch": "llama", "moe_experts": 4, "ep_size": 2}, ["ep_size=2 must divide the world size 1"]),
    ({"arch": "llama", "moe_experts": 4, "ep_size": 2, "reduce_dtype": "fp16"}, ["ep_size with reduce_dtype: fp16"]),
    ({"init_from": "no/such/folder"}, ["init_from: no/such/folder/ has no config.json"]),
    ({"sharding_strategy": "HYBRID_SHARD", "fsdp_size": 2}, ["HYBRID_SHARD with fsdp_size=2 needs at least 2 ranks"]),
    ({"data_source": None, "data_path": "no/such/folder"}, ["no prepared data in 'no/such/folder'"]),
    ({"mc_eval_path": "no/such/hellaswag_val.jsonl"}, ["multiple-choice file no/such/hellaswag_val.jsonl not found"]),
    ({"mc_eval_path": "[a, b]"}, ["'mc_eval_path'", "must be str or dict or null"]),
    ({"resume_from": "."}, [". is a folder, not a checkpoint file", "--checkpoint_dir=. and --resume_from=latest"]),
    ({"resume_from": "no/such/fsdp_sharded_cpt9_rank0.pth"},
     ["sharded checkpoint of step 9 not found in no/such/ (neither its marker nor a rank's file)"]),
    # an unprepared data_path of its own: the session's corpus may be prepared already
    ({"data_source": "no/such/*.txt", "data_path": "unprepared"}, ["data_source 'no/such/*.txt' matches no file"]),
])
def test_bad_config(override, phrases, corpus, tmp_path, monkeypatch, capsys):
    """In this process: the trainer's body as its entry point runs it (exit_code); what a separate
    process adds (the exit status itself) the tests below show."""
    one_line(train_in_process([DEMO] + overrides(**(TINY | corpus | override)), tmp_path, monkeypatch), capsys, *phrases)



@pytest.mark.parametrize("architecture, layers", [("KimiLinearForCausalLM", "Kimi Delta Attention (KDA) layers"),
                                                   ("GraniteMoeHybridForCausalLM", "Mamba 2 layers"),
                                                   ("Lfm2ForCausalLM", "convolution-only blocks")])
def test_a_hybrid_folder_of_layers_not_built_stops_in_one_line(architecture, layers, corpus, tmp_path, monkeypatch,
                                                               capsys):
    import json
    (tmp_path / "hybrid").mkdir()
    (tmp_path / "hybrid" / "config.json").write_text(json.dumps({"architectures": [architecture], "hidden_size": 64}))
    code = train_in_process([DEMO] + overrides(**(TINY | corpus | {"init_from": str(tmp_path / "hybrid")})), tmp_path,
                            monkeypatch)
    one_line(code, capsys, f"holds a {architecture} (config.json's architectures), whose {layers}", "not built here")


def test_a_finished_run_lets_go_of_its_folder(corpus, tmp_path, monkeypatch):
    """In one process (a notebook, a loop of one's own), a run that ended holds its folder no more: the
    next run takes it at once, not refused as a live run's (its pid is this process's, alive)."""
    argv = [DEMO] + overrides(**(TINY | corpus | dict(max_iters=2, save_interval=2, eval_interval=100,
                                                       checkpoint_dir="ckpt", tensorboard_dir="tb")))
    assert train_in_process(argv, tmp_path, monkeypatch) == 0
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["fsdp_cpt2.pth"]  # no run.lock
    assert train_in_process(argv + ["--resume_from=latest", "--max_iters=3"], tmp_path, monkeypatch) == 0
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["fsdp_cpt2.pth", "fsdp_cpt3.pth"]

DATA_DAMAGES = {  # what a damaged data folder holds -> what the one line says
    "meta.json empty": (lambda d: (d / "meta.json").write_text(""), ["meta.json is not JSON", "prepare the data again"]),
    "meta.json cut short": (lambda d: (d / "meta.json").write_text('{"tokenizer": "bytes", "dty'), ["meta.json is not JSON"]),
    "meta.json a list": (lambda d: (d / "meta.json").write_text("[1, 2]"), ["meta.json holds a JSON list, not an object"]),
    "meta.json without dtype": (lambda d: (d / "meta.json").write_text('{"tokenizer": "bytes"}'), ["meta.json lacks dtype"]),
    "meta.json of another dtype": (lambda d: (d / "meta.json").write_text('{"tokenizer": "bytes", "dtype": "int8"}'),
                                   ["dtype 'int8' is not uint16 or uint32"]),
    "train.bin cut mid-token": (lambda d: open(d / "train.bin", "ab").write(b"x"), ["train.bin holds", "prepare the data again"]),
}


@pytest.mark.parametrize("damage", DATA_DAMAGES)
def test_a_damaged_data_folder_is_named_in_one_line(damage, corpus, tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    shutil.copytree(corpus["data_path"], data)
    spoil, phrases = DATA_DAMAGES[damage]
    spoil(data)
    argv = [DEMO] + overrides(**(TINY | dict(data_path=str(data), data_source=None)))
    one_line(train_in_process(argv, tmp_path, monkeypatch), capsys, str(data), *phrases)




def test_missing_config_file(tmp_path):
    result = run_trainer(str(tmp_path), config="nope.yaml", check=False)
    assert_one_line_error(result, "config file not found: nope.yaml")


@pytest.fixture(scope="module")
def checkpoints(two_rank_runs):
    """{"full": folder, "sharded": folder} of the 2-rank runs: checkpoints of steps 3 and 6."""
    return {kind: os.path.join(two_rank_runs[kind], "ckpt") for kind in ("full", "sharded")}


def copy_of(checkpoints, kind, tmp_path) -> str:
    target = str(tmp_path / "ckpt")
    shutil.copytree(checkpoints[kind], target)
    return target


# cut to a few KB, torch's zip reader fails with an OSError (EINVAL), which is the file's, not the disk's
@pytest.mark.parametrize("keep", [0.5, 5000])
def test_truncated_checkpoint(keep, checkpoints, corpus, tmp_path):
    path = os.path.join(copy_of(checkpoints, "full", tmp_path), "fsdp_cpt6.pth")
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * keep) if keep < 1 else keep)
    result = run_trainer(str(tmp_path), resume_from=path, check=False, **corpus)
    assert_one_line_error(result, path, "corrupt or truncated")


def test_a_rank_file_renamed_is_no_full_checkpoint(checkpoints, corpus, tmp_path):
    path = str(tmp_path / "renamed.pth")
    shutil.copy(os.path.join(checkpoints["sharded"], "fsdp_sharded_cpt6_rank1.pth"), path)
    result = run_trainer(str(tmp_path), resume_from=path, check=False, **corpus)
    assert_one_line_error(result, path, "is rank 1's file of a sharded checkpoint of 2 ranks, not a full one")


def test_garbage_checkpoint(corpus, tmp_path):
    path = str(tmp_path / "fsdp_cpt9.pth")
    with open(path, "wb") as f:
        f.write(os.urandom(4096))
    result = run_trainer(str(tmp_path), resume_from=path, check=False, **corpus)
    assert_one_line_error(result, path, "corrupt or truncated")


def test_checkpoint_of_another_shape(checkpoints, corpus, tmp_path):
    path = os.path.join(checkpoints["full"], "fsdp_cpt6.pth")
    result = run_trainer(str(tmp_path), resume_from=path, n_embd=32, check=False, **corpus)
    assert_one_line_error(result, "n_embd=64", "n_embd=32", "--n_embd=64")


def test_missing_rank_file(checkpoints, corpus, tmp_path):
    directory = copy_of(checkpoints, "sharded", tmp_path)
    os.remove(os.path.join(directory, "fsdp_sharded_cpt6_rank0.pth"))
    marker = torch.load(os.path.join(directory, "fsdp_sharded_cpt6.complete"), weights_only=True)
    assert marker["world_size"] == 2
    result = run_trainer(str(tmp_path), resume_from=os.path.join(directory, "fsdp_sharded_cpt6_rank{rank}.pth"),
                         check=False, **corpus)
    assert_one_line_error(result, "not found", "fsdp_sharded_cpt6_rank0.pth")


def test_a_rank_file_the_set_lacks_is_not_the_set(checkpoints, corpus, tmp_path):
    """rank 5 of a 2-rank set: refused, not resumed as the set its name would stand for (it resumed)."""
    path = os.path.join(checkpoints["sharded"], "fsdp_sharded_cpt6_rank5.pth")
    result = run_trainer(str(tmp_path), resume_from=path, check=False, **corpus)
    assert_one_line_error(result, f"{path} not found: {checkpoints['sharded']}/ holds the files of ranks 0, 1 of step "
                                  f"6's sharded set")


def test_incomplete_sharded_checkpoint(checkpoints, corpus, tmp_path):
    directory = copy_of(checkpoints, "sharded", tmp_path)
    os.remove(os.path.join(directory, "fsdp_sharded_cpt6.complete"))
    result = run_trainer(str(tmp_path), resume_from=os.path.join(directory, "fsdp_sharded_cpt6_rank0.pth"),
                         check=False, **corpus)
    assert_one_line_error(result, "incomplete")


@pytest.mark.slow
def test_world_size_that_does_not_fit_the_mesh(corpus, tmp_path):
    result = run_trainer(str(tmp_path), nproc=3, sharding_strategy="HYBRID_SHARD", fsdp_size=2, check=False, **corpus)
    assert result.returncode != 0
    # torchrun reports its failed child with a traceback of its own (from site-packages, which may
    # lie inside the checkout, in a .venv); none from this project's files
    project_files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert project_files and not any(f'File "{os.path.join(ROOT, f)}"' in result.stderr for f in project_files)
    assert "[rank0]: Traceback" not in result.stderr
    assert result.stderr.count("error: ") == 1 and "error: fsdp_size=2 must divide the world size 3" in result.stderr

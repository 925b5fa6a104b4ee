"""The design card's files at the root: `from model import GPT, GPTConfig` and `from fsdp_ckpt import
CheckpointManager, load_gpt` work in a fresh clone (the files git tracks, nothing installed from
this checkout), and they are the package's own objects, not copies."""
import os
import shutil
import subprocess
import sys
import textwrap

from conftest import ROOT

import fsdp_ckpt
import model
from fsdp_gpt.checkpoint.ckpt_format import load_gpt
from fsdp_gpt.checkpoint.fsdp_ckpt import CheckpointManager
from fsdp_gpt.model import GPT, GPTConfig

# in the clone, one process: a model from the root's `model`, a checkpoint saved by the manager and
# read back by load_gpt, weights equal
ROUND_TRIP = textwrap.dedent("""
    import sys, torch, fsdp_gpt
    from model import GPT, GPTConfig
    from fsdp_ckpt import CheckpointManager, init_distributed, load_gpt, parse_args
    assert fsdp_gpt.__file__.startswith(sys.argv[1]), fsdp_gpt.__file__  # the clone's package, not this checkout's
    cfg = parse_args(["config/demo_cpu.yaml", "--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=8", "--vocab_size=64",
                      f"--checkpoint_dir={sys.argv[2]}"])
    topo = init_distributed(cfg)
    gpt = GPT(GPTConfig.of(cfg))
    optimizer = torch.optim.AdamW(gpt.parameters())
    ckpt = CheckpointManager(cfg, topo)
    ckpt.save(3, gpt, optimizer)
    ckpt.close()
    loaded, saved = load_gpt(sys.argv[2], "cpu")
    assert saved["step"] == 3
    assert all(torch.equal(a, b) for a, b in zip(gpt.state_dict().values(), loaded.state_dict().values()))
    print("round trip ok")
""")


def tracked_copy(folder: str) -> None:
    """The checkout's tracked files, as a fresh clone of it holds them (the working tree's versions)."""
    paths = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for path in filter(None, paths):
        if os.path.exists(os.path.join(ROOT, path)):  # a tracked file deleted in the working tree is not there
            os.makedirs(os.path.join(folder, os.path.dirname(path)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, path), os.path.join(folder, path))


def test_the_faces_are_the_packages_objects():
    assert (model.GPT, model.GPTConfig) == (GPT, GPTConfig)
    assert (fsdp_ckpt.CheckpointManager, fsdp_ckpt.load_gpt) == (CheckpointManager, load_gpt)


def test_a_fresh_clone_imports_the_faces_and_round_trips_a_checkpoint(tmp_path):
    clone = str(tmp_path / "clone")
    tracked_copy(clone)
    script = tmp_path / "round_trip.py"
    script.write_text(ROUND_TRIP)
    # run as a user would from the clone's root: the clone first on sys.path, this checkout nowhere
    result = subprocess.run([sys.executable, str(script), clone, str(tmp_path / "ckpt")], cwd=clone, capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, PYTHONPATH=clone))
    assert result.returncode == 0 and "round trip ok" in result.stdout, result.stdout[-2000:] + result.stderr[-3000:]

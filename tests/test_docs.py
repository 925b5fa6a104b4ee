"""What the docs tell users to type runs: every ```sh block of README.md and docs/*.md, as written,
at tiny size, in a folder of its own that holds the repository's files.

A block runs under bash, top to bottom, stopping at the first failure. `python SCRIPT` and
`torchrun` are shell functions there that append tiny overrides for the script they run (the
trainer: a 1-layer model, a few steps, compile off, the test corpus unless the block prepares
its own data; data.py: one worker and cl100k_base, offline where gpt2's file would need a
download; sample.py: a few tokens) and cap --nproc_per_node at 2. Blocks tagged ```text are
shown, not run (multi-node pairs, SLURM, outputs).
"""
import glob
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, free_port, overrides

pytestmark = pytest.mark.slow
SH_BLOCK = re.compile(r"^```sh\n(.*?)^```$", re.S | re.M)
DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))

PRELUDE = r"""
set -euo pipefail
tiny() {  # the overrides appended to a command that runs script $1
    case "$1" in
        train_fsdp.py|bench/compare_runs.py) echo "$TINY_TRAIN" ;;
        data.py) echo "--workers 1 --tokenizer cl100k_base" ;;
        sample.py) echo "--max_new_tokens 8" ;;
    esac
}
python() { "$PYTHON" "$@" $(tiny "$1"); }
torchrun() {
    local args=() a
    for a in "$@"; do
        case "$a" in
            --nproc_per_node=*) args+=("--nproc_per_node=$(( ${a#*=} < 2 ? ${a#*=} : 2 ))") ;;
            *) args+=("$a") ;;
        esac
    done
    "$PYTHON" -m torch.distributed.run "${args[@]}" $TINY_TRAIN
}
"""


def blocks() -> list[tuple[str, int, str]]:
    """(doc, block number, commands) of every ```sh block."""
    found = []
    for path in DOCS:
        with open(path) as f:
            for i, match in enumerate(SH_BLOCK.finditer(f.read())):
                found.append((os.path.relpath(path, ROOT), i, match.group(1)))
    return found


def sandbox(tmp_path) -> str:
    """A folder that looks like a fresh clone: the repository's files (links), nothing run yet."""
    for name in os.listdir(ROOT):
        if name.startswith(".") or name in ("data", "checkpoints", "tensorboard", "bench", "tests"):
            continue
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    (tmp_path / "bench").mkdir()  # real folder: bench tools write bench/runs/ beside themselves
    for name in glob.glob(os.path.join(ROOT, "bench", "*.*")):
        os.symlink(name, tmp_path / "bench" / os.path.basename(name))
    corpus = tmp_path / "corpus"  # what the docs' `corpus/` stands for: a few text documents
    corpus.mkdir()
    for name in ("json/decoder.py", "json/encoder.py", "email/utils.py", "email/message.py"):
        src = os.path.join(os.path.dirname(os.__file__), name)
        (corpus / name.replace("/", "_").replace(".py", ".txt")).write_text(open(src).read())
    return str(tmp_path)


@pytest.mark.parametrize("doc, number, commands", blocks(), ids=lambda v: str(v).split("\n")[0][:40])
def test_sh_block_runs(doc, number, commands, corpus, tmp_path):
    tiny = TINY | dict(n_layer=1, max_iters=4, save_interval=2, eval_interval=2, compile=False, world_size=None,
                       lr_decay_iters=4)
    if "data.py prepare" not in commands:  # a block that prepares its data trains on it
        tiny |= corpus
    env = dict(os.environ, PYTHON=sys.executable, TINY_TRAIN=" ".join(overrides(**tiny)), OMP_NUM_THREADS="1",
               PET_MASTER_PORT=str(free_port()))
    result = subprocess.run(["bash", "-c", PRELUDE + commands], cwd=sandbox(tmp_path), env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, f"{doc}, sh block {number}:\n{commands}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"

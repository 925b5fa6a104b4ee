"""What the docs tell users to type runs: every ```sh block of README.md and docs/*.md, as written,
at tiny size, in a folder of its own that holds the repository's files.

A block runs under bash, top to bottom, stopping at the first failure. `python SCRIPT` and
`torchrun` are shell functions there that run the script through the tests' zygote (as torchrun
would start its ranks, without importing torch again for each), append tiny overrides for the
script they run (the trainer: a 2-layer model, a few steps, compile off, for each key the command
doesn't set itself; data.py: one worker, and cl100k_base for gpt2, whose file would need a
download; sample.py: a few tokens; `python -c` and `-m` run the interpreter itself) and cap --nproc_per_node at 2. The folder's data/stdlib_bytes (the demo's data) is
the test corpus, prepared. Blocks tagged ```text are shown, not run (multi-node pairs, SLURM,
outputs, benchmarks that take minutes); every trainer command in them is still parsed against
the config (test_text_blocks_name_real_keys).

Beside the commands: every link and anchor a page, a docstring or a config gives into docs/ leads
somewhere, and the lists the pages share are the generated ones (fsdp_gpt/doc_tables.py), current.
"""
import glob
import importlib.util
import os
import re
import shlex
import subprocess

import pytest
import yaml

from conftest import ROOT, TINY, overrides, zygote_python
from launching import ZYGOTE
from fsdp_gpt import compat, doc_tables
from fsdp_gpt.data.prepare import prepare_data
from fsdp_gpt.families import FAMILIES

SH_BLOCK = re.compile(r"^```sh\n(.*?)^```$", re.S | re.M)
DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))

PRELUDE = r"""
set -euo pipefail
tiny() {  # $1: the script, then its arguments: the overrides appended to the command
    local script=$1 o
    shift
    case "$script" in
        data.py) echo -n "--workers 1 "; if [[ " $* " == *" gpt2 "* ]]; then echo "--tokenizer cl100k_base"; fi ;;
        sample.py) echo "--max_new_tokens 8" ;;
        train_fsdp.py|bench/compare_runs.py)
            for o in $TINY_TRAIN; do [[ " $* " == *" ${o%%=*}="* ]] || echo -n "$o "; done ;;
    esac
}
python() {  # python -c/-m: the real interpreter (tests/zygote_python)
    "$PYTHON" "$@" $(tiny "$@")
}
torchrun() {  # its own options (--standalone, --nproc_per_node, ...), then the script and its arguments
    local nproc=1
    while [[ $1 == --* ]]; do
        [[ $1 == --nproc_per_node=* ]] && nproc=$(( ${1#*=} < 2 ? ${1#*=} : 2 ))
        shift
    done
    "$ZYGOTE_INTERPRETER" "$ZYGOTE" --run "$ZYGOTE_SOCKET" "$nproc" "$@" $(tiny "$@")
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


def sandbox(tmp_path, corpus) -> str:
    """A folder that looks like a fresh clone: the repository's files (links), the demo's data
    (the test corpus), nothing run yet."""
    for name in os.listdir(ROOT):
        if name.startswith(".") or name in ("data", "checkpoints", "tensorboard", "bench", "tests"):
            continue
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    (tmp_path / "bench").mkdir()  # real folder: bench tools write bench/runs/ beside themselves
    for name in glob.glob(os.path.join(ROOT, "bench", "*.*")):
        os.symlink(name, tmp_path / "bench" / os.path.basename(name))
    (tmp_path / "data").mkdir()
    prepare_data(corpus["data_path"], yaml.safe_load(corpus["data_source"]), "bytes")
    os.symlink(corpus["data_path"], tmp_path / "data" / "stdlib_bytes")
    documents = tmp_path / "corpus"  # what the docs' `corpus/` stands for: a few text documents
    documents.mkdir()
    for name in ("json/decoder.py", "json/encoder.py", "email/utils.py", "email/message.py"):
        src = os.path.join(os.path.dirname(os.__file__), name)
        (documents / name.replace("/", "_").replace(".py", ".txt")).write_text(open(src).read())
    return str(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("doc, number, commands", blocks(), ids=lambda v: str(v).split("\n")[0][:40])
def test_sh_block_runs(doc, number, commands, corpus, tmp_path):
    if "--fp8=" in commands and not (compat.float8_training() and importlib.util.find_spec("torchao")):
        pytest.skip('fp8 needs torchao (pip install -e ".[fp8]") and torch 2.11+: the trainer refuses it here, '
                    'as tests/test_fp8.py checks')
    tiny = {k: v for k, v in TINY.items() if k != "tokenizer"} | dict(
        n_layer=2, max_iters=4, save_interval=2, eval_interval=2, compile=False, world_size=None, lr_decay_iters=4)
    env = dict(os.environ, TINY_TRAIN=" ".join(overrides(**tiny)), OMP_NUM_THREADS="1", ZYGOTE=ZYGOTE,
               **zygote_python())
    result = subprocess.run(["bash", "-c", PRELUDE + commands], cwd=sandbox(tmp_path, corpus), env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{doc}, sh block {number}:\n{commands}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)


def commands_in_docs():
    """(doc, command words) of every command line in every fenced block, continuations joined."""
    for path in DOCS:
        with open(path) as f:
            text = f.read()
        for _, body in FENCE.findall(text):
            for line in body.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                if "||" in line:  # a command shown failing on purpose
                    continue
                if line.startswith(("python ", "torchrun ", "bash ", "sbatch ", "MALLOC_MMAP_THRESHOLD_=")):
                    yield os.path.relpath(path, ROOT), shlex.split(line)


def test_text_blocks_name_real_keys_and_files():
    """Commands shown but not run still name files that exist and config keys that parse."""
    from fsdp_gpt.config_parse import parse_args
    checked = 0
    for doc, words in commands_in_docs():
        scripts = [w for w in words if w.endswith((".py", ".sh")) and not w.startswith("-")]
        for script in scripts:
            assert os.path.isfile(os.path.join(ROOT, script)), f"{doc}: {' '.join(words)}: no {script}"
        if "train_fsdp.py" in words:
            rest = words[words.index("train_fsdp.py") + 1:]
            if rest and rest[0] in ("CONFIG", "--help"):
                rest = [os.path.join(ROOT, "config", "demo_cpu.yaml")] + rest[1:] if rest[0] == "CONFIG" else []
            if rest:
                rest[0] = os.path.join(ROOT, rest[0]) if not os.path.isabs(rest[0]) else rest[0]
                parse_args(rest)  # a renamed key or a bad value raises UserError, naming it
                checked += 1
    assert checked > 10


def test_the_generated_parts_are_current():
    """A page's list of the families, the config keys or the TensorBoard tags is what their sources make."""
    assert not doc_tables.stale(), f"{doc_tables.stale()}: regenerate with python -m fsdp_gpt.doc_tables"


def test_no_page_lists_the_families_by_hand():
    """Outside the generated parts no paragraph names every family (or all but one): a list kept by hand
    would miss the next family."""
    names = [re.compile(rf"(?<![\w-]){re.escape(f.name)}(?![\w-])") for f in FAMILIES]
    for path in DOCS:
        for paragraph in re.split(r"\n\s*\n", doc_tables.PART.sub("", open(path).read())):
            named = sum(bool(name.search(paragraph)) for name in names)
            assert named < len(names) - 1, f"{os.path.relpath(path, ROOT)} names {named} families by hand: " \
                                          f"{paragraph[:200]}"


def anchors(path: str) -> set[str]:
    """The anchors GitHub gives a page's headings (code blocks' lines are no headings)."""
    text = FENCE.sub("", open(path).read())
    seen = {}
    for title in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


LINK = re.compile(r"\]\(([^)\s]+)\)")
DOC_MENTION = re.compile(r"\bdocs/([\w-]+\.md)(#[\w-]+)?")
SOURCES = ["*.py", "*.sh", "bench/*.py", "bench/*.sh", "config/*.yaml", "fsdp_gpt/**/*.py", "tests/*.py"]


def test_every_link_into_the_docs_leads_somewhere():
    """Each page's relative links name a file and, with #, a heading of it; so does every page and anchor
    that code, configs and tests mention (a page split or a heading renamed leaves none dangling)."""
    targets = []
    for path in DOCS:
        for link in LINK.findall(FENCE.sub("", open(path).read())):
            if not re.match(r"[a-z]+:", link):  # https:, mailto:
                file, _, anchor = link.partition("#")
                targets.append((path, os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path, anchor))
    for pattern in SOURCES:
        for path in glob.glob(os.path.join(ROOT, pattern), recursive=True):
            for name, anchor in DOC_MENTION.findall(open(path).read()):
                targets.append((path, os.path.join(ROOT, "docs", name), anchor[1:]))
    assert len(targets) > 50
    broken = [f"{os.path.relpath(source, ROOT)} -> {os.path.relpath(target, ROOT)}{'#' * bool(anchor)}{anchor}"
              for source, target, anchor in targets
              if not os.path.isfile(target) or (anchor and anchor not in anchors(target))]
    assert not broken, broken


def test_the_pages_stay_reference_sized():
    """A page says what is true now (the history of runs is docs/history.md's): none past 400 lines,
    the README's front page within 260."""
    sizes = {os.path.relpath(path, ROOT): len(open(path).read().splitlines()) for path in DOCS}
    limits = {page: 260 if page == "README.md" else 400 for page in sizes if page != "docs/history.md"}
    over = {page: f"{sizes[page]} lines, past {limit}" for page, limit in limits.items() if sizes[page] > limit}
    assert not over, over

"""The house's rules (docs/architecture.md), checked on the source: the root holds the programs a
user runs, each answering --help, and the design card's two faces; the package's layers import downwards only; the model knows
nothing of distribution, checkpoints or logging; no module grows past ~400 lines."""
import ast
import glob
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

PACKAGE = os.path.join(ROOT, "fsdp_gpt")
ENTRY_POINTS = ["train_fsdp.py", "sample.py", "evaluate.py", "export_hf.py", "data.py", "consolidate.py"]
FACES = ["model.py", "fsdp_ckpt.py"]  # the design card's files: the package's names for users' imports (test_faces.py)
# lowest first: a module imports from lower layers and from its own group, never from above or beside
LAYERS = [("families", "compat"), ("config", "model"), ("files",), ("hf_format", "resilience"), ("distributed",),
          ("data", "optim", "observe"), ("evaluation", "checkpoint"), ("doc_tables",)]
LAYER_OF = {group: i for i, groups in enumerate(LAYERS) for group in groups}


# modules at the package's top that belong to another's group
GROUP_OF = {"config_help": "config", "config_parse": "config", "config_checks": "config", "moe": "model", "attention": "model", "loss": "model",
            "attention_kernels": "model", "rope": "model", "linear_attention": "model", "latent_attention": "model",
            "hf_quantized": "hf_format",
            "model_keys": "families", "family_parts": "families", "safetensors_file": "hf_format",
            "hf_whole_folder": "hf_format", "mxfp4": "hf_format"}


def group(module: str) -> str:
    """fsdp_gpt.data.loader -> data; fsdp_gpt.config_help -> config; fsdp_gpt.moe, .attention -> model;
    fsdp_gpt.model_keys, .family_parts -> families."""
    name = module.split(".")[1]
    return GROUP_OF.get(name, name)


def modules() -> dict[str, str]:
    found = {}
    for path in glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True):
        name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
        found[name] = path
    return found


def imports(path: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_root_holds_the_entry_points_and_faces_only():
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py"))) == sorted(ENTRY_POINTS + FACES)


# Each script run as `python SCRIPT --help` runs it (sys.argv, sys.path[0] its folder, __main__), all in
# one fresh interpreter without PYTHONPATH: the imports a checkout needs are found, and torch is
# imported once instead of once a script (5 CPU-seconds each). os._exit, how entry points leave, ends
# the script alone. Prints {script: [exit code, what it printed]} as JSON.
ANSWER_HELP = """
import contextlib, io, json, os, runpy, sys
class Left(BaseException):
    pass
def leave(code):
    raise Left(code)
os._exit, answers = leave, {}
for script in sys.argv[1:]:
    printed, code = io.StringIO(), 0
    sys.argv, sys.path[0] = [script, "--help"], os.path.dirname(script)
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Left as e:
        code = e.args[0]
    answers[os.path.basename(script)] = [code, printed.getvalue()]
print(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def help_answers(tmp_path_factory) -> dict:
    scripts = [os.path.join(ROOT, script) for script in ENTRY_POINTS + ["fsdp_ckpt.py"]]
    result = subprocess.run([sys.executable, "-c", ANSWER_HELP, *scripts], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path_factory.mktemp("help"), env=dict(os.environ, PYTHONPATH=""))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@pytest.mark.parametrize("script", ENTRY_POINTS + ["fsdp_ckpt.py"])  # the face also runs: what a checkpoint holds
def test_entry_point_answers_help(script, help_answers):
    code, printed = help_answers[script]
    assert code == 0 and "usage" in printed.lower(), printed[-3000:]


def test_layers_import_downwards():
    wrong = []
    for name, path in modules().items():
        if name == "fsdp_gpt":
            continue
        mine = group(name)
        for target in imports(path):
            if target.startswith("fsdp_gpt.") and group(target) != mine and LAYER_OF[group(target)] >= LAYER_OF[mine]:
                wrong.append(f"{name} imports {target}")
    assert not wrong, wrong


MODEL_FILES = ["model.py", "moe.py", "attention.py", "attention_kernels.py", "loss.py", "rope.py", "linear_attention.py",
               "latent_attention.py"]


@pytest.mark.parametrize("module", MODEL_FILES)
def test_model_is_plain_pytorch(module):
    """The model's files import torch, not torch.distributed, and of the project only each other."""
    assert {name for name in imports(os.path.join(PACKAGE, module)) if name.startswith(("fsdp_gpt", "torch.distributed"))} \
        <= {f"fsdp_gpt.{name.removesuffix('.py')}" for name in MODEL_FILES} | {"fsdp_gpt.model_keys", "fsdp_gpt.compat"}


@pytest.mark.parametrize("module", sorted(os.path.relpath(path, PACKAGE) for path in glob.glob(os.path.join(PACKAGE, "families", "*.py")))
                         + ["family_parts.py", "model_keys.py"])
def test_the_families_and_model_keys_are_plain_python(module):
    """The config reads them without torch (data preparation's workers import no torch)."""
    assert {name.split(".")[0] for name in imports(os.path.join(PACKAGE, module))} <= {"dataclasses", "typing", "json",
                                                                                         "fsdp_gpt"}


def test_no_module_but_the_families_branches_on_arch():
    """A family's layout, keys, Hugging Face names and resumable keys are its entry's (families/):
    elsewhere `arch` is compared with nothing (`in ARCHS`, its check, aside)."""
    def is_arch(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "arch") or (
            isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "arch")
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops) \
                    and any(map(is_arch, [node.left, *node.comparators])) and not name.startswith("fsdp_gpt.families"):
                found.append(f"{name}:{node.lineno}")
    assert not found, found


def test_no_module_past_its_size():
    lines = {name: sum(1 for _ in open(path)) for name, path in modules().items()}
    assert max(lines.values()) <= 420, sorted(lines.items(), key=lambda kv: -kv[1])[:3]

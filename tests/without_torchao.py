"""Run by test_fp8.py: `python tests/without_torchao.py SCRIPT ARGS` runs SCRIPT as `python SCRIPT
ARGS` would on a machine where torchao is not installed (importing it fails as it would there)."""
import os
import runpy
import sys


class NoTorchao:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torchao":
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        return None


if "torchao" in sys.modules:
    raise SystemExit("without_torchao.py: torchao is imported already")
sys.meta_path.insert(0, NoTorchao())
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python SCRIPT` sets it
runpy.run_path(sys.argv[0], run_name="__main__")

"""Used by the tests' zygote (tests/zygote.py) when started with WITHOUT_TORCHAO=1 (test_fp8.py's
runs through `conftest.launch(..., env=WITHOUT_TORCHAO)`): its ranks run as they would on a machine
where torchao is not installed. Every importer and package finder looks past it (an import fails,
importlib.util.find_spec and importlib.metadata find nothing, as transformers asks them)."""
import sys


def hidden(name) -> bool:
    return (name or "").split(".")[0].lower() == "torchao"


class WithoutTorchao:
    """A finder of sys.meta_path that finds what it found before, but for torchao."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        return None if hidden(name) else self.finder.find_spec(name, path, target)

    def find_distributions(self, *args, **kwargs):
        find = getattr(self.finder, "find_distributions", None)
        return (d for d in find(*args, **kwargs) if not hidden(d.metadata["Name"])) if find else iter(())

    def __getattr__(self, name):  # invalidate_caches and the like
        return getattr(self.finder, name)


def hide_torchao() -> None:
    """From here on, this process (and its forks) can't find torchao: call it before anything imports it."""
    if "torchao" in sys.modules:
        raise SystemExit("without_torchao.py: torchao is imported already")
    sys.meta_path[:] = [WithoutTorchao(finder) for finder in sys.meta_path]

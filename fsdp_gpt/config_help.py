"""The config keys for people: `train_fsdp.py --help` and docs/config.md's tables, both rendered
from TrainConfig's own fields (their types, defaults and meanings)."""
import dataclasses
import textwrap
import typing

from fsdp_gpt.config import FIELDS
from fsdp_gpt.config_parse import USAGE
from fsdp_gpt.families import FAMILY_KEYS

# each group's first key, in the dataclass's order: --help and docs/config.md list the keys so
GROUPS = {"arch": "model", "data_path": "data", "train_batch": "batch", "optimizer": "optimizer and schedule",
          "fsdp": "distribution and precision", "checkpoint_dir": "checkpoints", "log_interval": "logging",
          "init_timeout": "failures", "dry_run": "dry run"}


def grouped_keys() -> dict[str, list[dataclasses.Field]]:
    groups = {}
    for f in FIELDS.values():
        groups.setdefault(GROUPS.get(f.name, next(reversed(groups), None)), []).append(f)
    return groups


def _type_name(f: dataclasses.Field) -> str:
    names = ["null" if t is type(None) else t.__name__ for t in typing.get_args(f.type) or (f.type,)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _default(f: dataclasses.Field) -> str:
    return "null" if f.default is None else str(f.default).lower() if isinstance(f.default, bool) else str(f.default)


def _meaning(f: dataclasses.Field) -> str:
    """A key's meaning, and for a key some family lacks where to read which take it (the checks refuse
    it for the others)."""
    lacked = " (not every family takes it: docs/families.md)" if f.name in FAMILY_KEYS else ""
    return f.metadata["meaning"] + lacked


def help_text() -> str:
    """What train_fsdp.py --help prints: every key by group, with its type, default and meaning."""
    lines = [USAGE, "", "Config keys: defaults < CONFIG.yaml < --key=value (the last one wins). Values read as YAML:",
             "3e-3 is a float, true a bool, null nothing. The same table: docs/config.md."]
    for group, fields in grouped_keys().items():
        lines += ["", group]
        for f in fields:  # the default as an override, then the meaning below it
            lines.append(f"  --{f.name}={_default(f)}  ({_type_name(f)})")
            lines += textwrap.wrap(_meaning(f), 100, initial_indent=" " * 6, subsequent_indent=" " * 6,
                                   break_on_hyphens=False)
    return "\n".join(lines)


def keys_markdown() -> str:
    """docs/config.md's tables: one per group (tests/test_config.py keeps the page equal to this)."""
    parts = []
    for group, fields in grouped_keys().items():
        parts += [f"### {group}", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        parts += [f"| `{f.name}` | {_type_name(f)} | `{_default(f)}` | {_meaning(f)} |" for f in fields]
        parts.append("")
    return "\n".join(parts)

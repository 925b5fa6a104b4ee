"""Reading a run's configuration: a YAML file, then --key=value overrides (the last one wins), typed
by TrainConfig's fields and validated once (config.py holds the keys and their checks; with init_from,
those of the model's keys after the folder has set them)."""
import difflib
import os
import typing

import yaml

from fsdp_gpt.config import FIELDS, TrainConfig, UserError
from fsdp_gpt.config_checks import validate, validate_run

USAGE = "usage: python train_fsdp.py CONFIG.yaml [--key=value ...]   (or under torchrun)"


def _parse_cli_value(text: str):
    """Read a command-line value as a user means it: 3e-3 is a float, null is None."""
    value = yaml.safe_load(text) if text != "" else ""
    if isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads '3e-3' as a string
        except ValueError:
            pass
    return value


def _coerce(key: str, value, where: str):
    allowed = typing.get_args(FIELDS[key].type) or (FIELDS[key].type,)
    if value is None and type(None) in allowed:
        return None
    if isinstance(value, str) and float in allowed:
        try:
            value = float(value)
        except ValueError:
            pass
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, float) and int in allowed and value.is_integer() and float not in allowed:
        return int(value)
    for t in allowed:
        if t is not type(None) and type(value) is t:
            return value
    names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
    raise UserError(f"config key '{key}' ({where}) must be {names}, got {value!r}")


def _check_key(key: str, where: str):
    if key not in FIELDS:
        near = difflib.get_close_matches(key, FIELDS, n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise UserError(f"unknown config key '{key}' ({where}){hint}")


def parse_args(argv: list[str]) -> TrainConfig:
    """argv: CONFIG.yaml followed by --key=value or --key value overrides (last one wins)."""
    if not argv or argv[0].startswith("--"):
        raise UserError(f"{USAGE}; --help lists the keys")
    path, rest = argv[0], argv[1:]
    if not os.path.isfile(path):
        raise UserError(f"config file not found: {path}")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise UserError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}")
    if not isinstance(raw, dict):
        raise UserError(f"config file {path} must be a mapping of key: value")
    values = {}
    for key, value in raw.items():
        _check_key(str(key), f"in {path}")
        values[key] = _coerce(key, value, f"in {path}")
    i = 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--"):
            raise UserError(f"unexpected argument '{arg}': overrides look like --key=value")
        key, eq, text = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(rest):
                raise UserError(f"override --{key} needs a value: --{key}=VALUE")
            i, text = i + 1, rest[i + 1]
        _check_key(key, f"from --{key}")
        values[key] = _coerce(key, _parse_cli_value(text), f"from --{key}")
        i += 1
    cfg = TrainConfig(**values)
    cfg.given = frozenset(values)  # the keys the file or the command line set (init_from may set the others)
    # init_from: the folder sets the model's keys once the process group exists (hf_format.define_model),
    # and the checks that read them run then
    (validate_run if cfg.init_from else validate)(cfg)
    return cfg

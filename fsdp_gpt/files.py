"""Reading the small files users hand the trainer and its tools (a data folder's meta.json, a
Hugging Face folder's JSON files): a broken one is one line that names it and says what to do,
never a traceback from the parser."""
import json

from fsdp_gpt.config import UserError


def read_json(path: str, remedy: str, keys: tuple[str, ...] = ()) -> dict:
    """The JSON object in `path`, which must hold `keys`; else a UserError naming the file and `remedy`."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not JSON ({e}): {remedy}") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} holds a JSON {type(value).__name__}, not an object: {remedy}")
    if missing := [key for key in keys if key not in value]:
        raise UserError(f"{path} lacks {', '.join(missing)}: {remedy}")
    return value

"""model.GPT <-> Hugging Face folders, for every family (families/ holds each one's class,
config.json's keys and weights' names): config.json and the weights both ways, read or written by
the names the entry gives.

Export builds the transformers model (export_hf.py); import (`init_from`) reads config.json and
the safetensors files directly (safetensors_file.py), so training from published weights needs no
transformers; a folder's quantized weights (quantization_config) are dequantized on the way in
(hf_quantized.py: fine-grained FP8, gpt-oss's MXFP4 experts).
"""
import dataclasses
import os
import re
from typing import NamedTuple

import torch

from fsdp_gpt.config import UserError
from fsdp_gpt.config_checks import check_rope_scaling, validate_model
from fsdp_gpt.families import FAMILIES
from fsdp_gpt.families.unbuilt import BUILT_MIXERS, UNBUILT_CLASSES
from fsdp_gpt.family_parts import Absent, Family, Rows
from fsdp_gpt.files import read_json
from fsdp_gpt.hf_quantized import full_precision, quantization_note, quantization_of
from fsdp_gpt.model import GPT, GPTConfig
from fsdp_gpt.safetensors_file import read_safetensors

def hf_refusal(cfg: GPTConfig) -> tuple[str, str] | None:
    """Where the family's Hugging Face class would compute another model than cfg's, (the key, why it
    can't, in words that name it); None where it computes this one."""
    family = cfg.family
    for key, holds, why in family.hf_limits:
        if not holds(cfg):
            return key, f"{key}: {getattr(cfg, key)}: {family.hf_class} {why}"
    if cfg.mlp not in family.hf_mlps:
        return "mlp", f"mlp: {cfg.mlp}: {family.hf_class} computes {' or '.join(family.hf_mlps)} MLPs only"
    return None


def hf_config(cfg: GPTConfig, eot: int | None, bos: int | None = None) -> dict:
    """config.json's keys for our model; a model Hugging Face's class would compute differently
    is refused, naming the key, rather than exported wrong. The beginning-of-text id is the
    tokenizer's own where it names one (bos), else the end-of-text id."""
    if refused := hf_refusal(cfg):
        raise UserError(f"{refused[1]}, so an export would compute other logits")
    keys = {"model_type": cfg.family.hf_model_type} | cfg.family.hf_config(cfg, eot)
    return keys | ({"bos_token_id": bos} if bos is not None and "bos_token_id" in keys else {})


def their_name(family: Family, name: str) -> tuple[str | Rows | Absent, str | None]:
    """What Hugging Face's class calls one of model.GPT's weights (a name, Rows or Absent, {i}
    filled in), and the name within its block (None outside the blocks)."""
    if name in family.hf_root:
        return family.hf_root[name], None
    _, i, inside = name.split(".", 2)
    theirs, prefix = family.hf_names.get(inside, inside), family.hf_block.format(i=i)
    if isinstance(theirs, Rows):
        return theirs._replace(parts=tuple(prefix + part for part in theirs.parts)), inside
    return (theirs if isinstance(theirs, Absent) else prefix + theirs), inside


def to_hf(state: dict, cfg: GPTConfig) -> dict:
    """model.GPT's state dict -> the Hugging Face model's, as its files hold it (one matrix per expert)."""
    family, out = cfg.family, {}
    if family.hf_zero_biases and not cfg.bias:  # the biases its class always has: zeros compute as none
        with torch.device("meta"):
            biased = GPT(dataclasses.replace(cfg, bias=True)).state_dict()
        state = state | {name: torch.zeros(biased[name].shape) for name in biased.keys() - state.keys()}
    for name, tensor in state.items():
        theirs, inside = their_name(family, name)
        if isinstance(theirs, Absent):
            if tensor.any():
                raise UserError(theirs.refusal)
            continue
        parts = theirs.parts if isinstance(theirs, Rows) else (theirs,)
        matrices = enumerate(tensor) if "{e}" in parts[0] else [(None, tensor)]  # {e}: one per expert, stacked in ours
        for e, matrix in matrices:
            if isinstance(theirs, Rows):
                pieces = matrix.split(theirs.widths(cfg) if theirs.widths else matrix.shape[0] // len(parts))
            else:
                pieces = [as_stored(family, inside, matrix)]
            out |= {part.format(e=e): piece for part, piece in zip(parts, pieces)}
    return {k: v.contiguous() for k, v in out.items()}


def as_stored(family: Family, inside: str | None, tensor: torch.Tensor) -> torch.Tensor:
    """One of our tensors as the family's files hold it: the gates' and ups' rows interleaved (hf_interleaved,
    dim 1 of stacked experts), then the last two dimensions swapped (hf_transposed)."""
    if inside in family.hf_interleaved:
        tensor = tensor.unflatten(1, (2, -1)).transpose(1, 2).flatten(1, 2)
    return tensor.transpose(-2, -1) if inside in family.hf_transposed else tensor


def as_ours(family: Family, inside: str | None, tensor: torch.Tensor) -> torch.Tensor:
    """as_stored undone."""
    if inside in family.hf_transposed:
        tensor = tensor.transpose(-2, -1)
    return tensor.unflatten(1, (-1, 2)).transpose(1, 2).flatten(1, 2) if inside in family.hf_interleaved else tensor


def their_weight(tensors: dict, family: Family, name: str, like: torch.Tensor, experts: int) -> torch.Tensor:
    """One of model.GPT's weights (`like`: its shape) from a folder's tensors, by the names the
    family gives (KeyError: a tensor the folder lacks, by its name there)."""
    theirs, inside = their_name(family, name)
    if name == "lm_head.weight" and theirs not in tensors:  # a tied head: the files hold the embedding only
        theirs = their_name(family, "wte.weight")[0]
    if isinstance(theirs, Absent):
        return torch.zeros(like.shape)
    parts = theirs.parts if isinstance(theirs, Rows) else (theirs,)

    def matrix(e: int | None) -> torch.Tensor:
        return as_ours(family, inside, torch.cat([tensors[part.format(e=e)] for part in parts]))
    return torch.stack([matrix(e) for e in range(experts)]) if "{e}" in parts[0] else matrix(None)


def fused_like(hf_state: dict, model_keys) -> dict:
    """The per-expert tensors stacked where the transformers model in memory holds its experts fused
    (transformers 5: experts.gate_up_proj (experts, 2 hidden, width), experts.down_proj)."""
    out = dict(hf_state)
    for key in model_keys:
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")) and key not in out:
            prefix, experts = key.rsplit("experts.", 1)[0] + "experts.", 0
            parts = ("gate_proj", "up_proj") if key.endswith("gate_up_proj") else ("down_proj",)
            while f"{prefix}{experts}.{parts[0]}.weight" in out:
                experts += 1
            out[key] = torch.stack([torch.cat([out.pop(f"{prefix}{e}.{p}.weight") for p in parts])
                                    for e in range(experts)])
    return out


def names_per_expert(family: Family) -> bool:
    """Whether the family's files hold each expert's matrices apart ({e} in its names: Qwen3-MoE's), not
    stacked as its class holds them (gpt-oss's)."""
    return any("{e}" in part for theirs in family.hf_names.values() if not isinstance(theirs, Absent)
               for part in (theirs.parts if isinstance(theirs, Rows) else (theirs,)))


def per_expert(tensors: dict) -> dict:
    """A file's experts held fused, as transformers 5's model holds them in memory (experts.gate_up_proj
    (experts, 2 hidden, width), experts.down_proj), as the per-expert tensors save_pretrained writes."""
    out = dict(tensors)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        prefix, parts = key.rsplit("experts.", 1)[0] + "experts.", ("gate_proj", "up_proj", "down_proj")
        parts = parts[:2] if key.endswith("gate_up_proj") else parts[2:]
        for e, matrix in enumerate(out.pop(key)):
            out |= {f"{prefix}{e}.{p}.weight": piece for p, piece in zip(parts, matrix.chunk(len(parts)))}
    return out


# ---- import: a Hugging Face folder -> model keys and model.GPT's state dict ----

def hf_model_keys(folder: str) -> tuple[dict, int]:
    """(the model keys a folder's config.json sets, as GPTConfig takes them; the longest context its
    positions allow). Where the family may change block_size on resume (rotary positions), it is
    not among the keys: it stays a training choice, up to max_position_embeddings; GPT-2's learned
    positions fix it."""
    keys = _config_keys(folder)[0]
    if "block_size" in GPTConfig(**keys).family.resumable:
        return {k: v for k, v in keys.items() if k != "block_size"}, keys["block_size"]
    return keys, keys["block_size"]


def _settled(keys: dict, key: str, value):
    """What `key` comes to in the model of the folder's keys with `value` for it (null: none, or the
    family's default where the family settles it: ModelKeys.settled)."""
    return getattr(GPTConfig(**keys | {key: value}), key)


def _shown(value) -> str:
    return "null" if value is None else str(value)


def define_model(cfg) -> list[str]:
    """init_from: the folder's config.json sets every model key of cfg. A key the config file or the
    command line gave (cfg.given), null included, that contradicts the folder is refused, naming both
    values, but for the context keys its family lets a resume change (Family.resumable: a window,
    RoPE's base or scaling; no weight changes), which change as on a resume. The notes returned say
    what changes, what the folder holds that is not trained here (Family.hf_unread: never read) and
    how quantized weights are read. A null that settles to the folder's value (n_kv_head: null beside
    a folder without grouped heads) contradicts nothing. A key the folder leaves unset is refused where
    the folder's class computes without it (a soft cap, value embeddings: hf_refusal, the export's own
    test). The run's tokenizer is the folder's unless one is named; block_size stays the config's, past
    the folder's positions only with a rotary layout (said in a note). Then the checks that read the
    model's keys run (the config's others were checked when it was read): a refusal that names a key
    the folder set says it is the folder's; for a multimodal folder, a note says which part of it trains."""
    keys, longest = hf_model_keys(cfg.init_from)
    found = read_folder_config(cfg.init_from)
    family = found.family
    notes = [*family.hf_unread(found.config), quantization_note(found.config, f"init_from: {cfg.init_from}/")]
    changes, changed = [], set()
    for key, value in keys.items():
        mine = getattr(cfg, key)
        if key in cfg.given and _settled(keys, key, mine) != _settled(keys, key, value):
            if key in family.resumable:
                changes.append(f"{key} {_shown(value)} -> {_shown(mine)}")
                changed.add(key)
                continue
            raise UserError(f"init_from {cfg.init_from} has {key}={_shown(value)} but the config sets "
                            f"{key}={_shown(mine)}: drop {key} from the config and the command line, or set "
                            f"--{key}={_shown(value)} (the folder defines the model)")
        setattr(cfg, key, value)
    if cfg.block_size > longest:  # rotary: no weights per position (GPT-2's learned ones are a key above)
        changes.append(f"block_size {cfg.block_size}, past the {longest} positions of its config.json")
    if "tokenizer" not in cfg.given and os.path.isfile(os.path.join(cfg.init_from, "tokenizer.json")):
        cfg.tokenizer = cfg.init_from
    try:
        validate_model(cfg)
    except UserError as e:  # e.g. ep_size=3 must divide moe_experts=8 (init_from FOLDER sets moe_experts=8)
        named = ", ".join(f"{key}={getattr(cfg, key)}" for key in keys
                          if key not in changed and re.search(rf"\b{key}\b", str(e)))
        raise UserError(f"{e} (init_from {cfg.init_from} sets {named})" if named else str(e)) from None
    if refused := hf_refusal(GPTConfig.of(cfg)):
        key, why = refused
        raise UserError(f"init_from {cfg.init_from} holds a {family.hf_class}: {why}, so the run would train another "
                        f"model than the folder's: drop {key} from the config and the command line")
    if changes:
        notes.append(f"the context changes from init_from {cfg.init_from}: {', '.join(changes)}; the weights are the "
                     f"folder's")
    if found.wrapper:
        notes.append(f"init_from {cfg.init_from} holds a {found.wrapper}: its language model ({found.key}) trains, as "
                     f"a {family.hf_class}; the rest ({', '.join(found.beside) or 'its other weights'}) is left in the "
                     f"folder as it is (export_hf.py --whole_folder writes the folder back with the trained language "
                     f"model)")
    return [note for note in notes if note]


class Folder(NamedTuple):
    """What a folder's config.json holds: the family, the config its hf_keys read (a multimodal class's
    language model's, under the wrapper's key), and where the folder is a wrapper its class, that key
    and the others' (its vision tower's config)."""
    family: Family
    config: dict
    wrapper: str | None = None
    key: str | None = None
    beside: tuple[str, ...] = ()


def hf_classes() -> dict[str, tuple[Family, str | None]]:
    """{class: (family, the key of its language model's config)} of every class init_from reads: each
    family's own (key None) and the multimodal classes that hold one (hf_wrappers)."""
    return {family.hf_class: (family, None) for family in FAMILIES} | {
        wrapper: (family, key) for family in FAMILIES for wrapper, key in family.hf_wrappers.items()}


def read_folder_config(folder: str) -> Folder:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"init_from: {folder}/ has no config.json (a Hugging Face model folder is needed)")
    config = read_json(path, "init_from: the folder is damaged: download the model again")
    # its class, or where config.json names none its model type
    field, architecture = "architectures", (config.get("architectures") or [None])[0]
    if architecture is None:
        field, model_type = "model_type", config.get("model_type")
        architecture = next((cls for cls, (mt, _) in UNBUILT_CLASSES.items() if mt == model_type),
                            next((family.hf_class for family in FAMILIES if family.hf_model_type == model_type),
                                 model_type))
    classes = hf_classes()
    if architecture in UNBUILT_CLASSES:  # a hybrid: named by the layers it holds
        raise UserError(f"init_from: {folder}/ holds a {architecture} (config.json's {field}), whose "
                        f"{UNBUILT_CLASSES[architecture][1]} are not built here; this trainer builds {BUILT_MIXERS} "
                        f"({', '.join(dict.fromkeys(f.hf_class for f in FAMILIES if 'linear' in f.attn_pattern))})")
    if architecture not in classes:
        raise UserError(f"init_from: {folder}/ holds a {architecture} (config.json's {field}); this trainer starts from "
                        f"{', '.join(classes)}")
    family, key = classes[architecture]
    if key is None:
        return Folder(family, config)
    if not isinstance(config.get(key), dict):
        raise UserError(f"init_from: {path} has no {key!r}, which a {architecture} config holds")
    # the language model's head is tied as the wrapper's config says (its class reads that, not text_config's)
    tied = {"tie_word_embeddings": config["tie_word_embeddings"]} if "tie_word_embeddings" in config else {}
    beside = tuple(other for other, value in config.items() if isinstance(value, dict) and other != key)
    return Folder(family, config[key] | tied, architecture, key, beside)


def _config_keys(folder: str) -> tuple[dict, dict]:
    """(the model keys a folder's config.json sets, the config they come from)."""
    found = read_folder_config(folder)
    try:
        keys = found.family.hf_keys(found.config)
    except KeyError as e:
        where = f"{found.wrapper} config's {found.key}" if found.wrapper else f"{found.family.hf_class} config"
        raise UserError(f"init_from: {os.path.join(folder, 'config.json')} has no {e.args[0]!r}, which a {where} holds")
    except ValueError as e:  # what the family does not build, in its words
        raise UserError(f"init_from: {folder}/ {e}")
    check_rope_scaling(keys.get("rope_scaling"), f"init_from: {folder}/")
    quantization_of(found.config, f"init_from: {folder}/")  # a method not built here refused before a tensor is read
    return keys, found.config


def unwrapped(tensors: dict, family: Family) -> dict:
    """A folder's tensors by the family's names: a multimodal folder's language model (and a CausalLM's
    saved from one) carries hf_wrapped[0] where they begin with hf_wrapped[1]; the rest (its vision
    tower) keeps its names, which no weight of model.GPT reads."""
    if family.hf_wrapped is None:
        return tensors
    theirs, ours = family.hf_wrapped
    return {ours + name[len(theirs):] if name.startswith(theirs) else name: t for name, t in tensors.items()}


def read_hf_folder(folder: str) -> tuple[dict, dict]:
    """(model keys as GPTConfig takes them, state dict in model.GPT's names) of a folder. A folder
    that is not what it claims (JSON, keys, tensors, file sizes) is refused with one line naming
    the file and what is wrong."""
    keys, config = _config_keys(folder)
    cfg = GPTConfig(**keys)
    tensors = full_precision(unwrapped(read_safetensors(folder), cfg.family), config, f"init_from: {folder}/")
    if names_per_expert(cfg.family):  # a file of transformers 5's fused experts read as the per-expert files
        tensors = per_expert(tensors)
    with torch.device("meta"):
        expected = GPT(cfg).state_dict()
    state = {}
    for name, like in expected.items():
        try:
            state[name] = their_weight(tensors, cfg.family, name, like, cfg.moe_experts).contiguous()
        except KeyError as e:
            raise UserError(f"init_from: {folder}/ has no tensor {e.args[0]!r}, which its config's "
                            f"{cfg.family.hf_class} holds")
        if not state[name].is_floating_point():
            raise UserError(f"init_from: {folder}/: {name} (model.GPT's name) is stored as {state[name].dtype} bytes, "
                            f"and config.json names no quantization that reads them")
        if state[name].shape != like.shape:
            raise UserError(f"init_from: {folder}/: {name} (model.GPT's name) has shape {list(state[name].shape)}, "
                            f"its config.json makes it {list(like.shape)}")
    return keys, state

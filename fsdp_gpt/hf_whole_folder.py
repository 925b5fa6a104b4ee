"""A trained model written into a copy of the Hugging Face folder its run started from (export_hf.py
--whole_folder): every file as it was (a multimodal model's vision tower, its processor and chat
template, the tokenizer, a multi-token-prediction head), the language model's tensors replaced by the
trained ones in the files and dtypes that held them, and config.json's language-model config updated
with what the run may have changed (a context key: RoPE's base or scaling, a window, a context longer
than the folder's; a shorter one keeps the folder's max_position_embeddings). Needs the
safetensors library (transformers' own dependency)."""
import json
import os
import shutil

import torch

from fsdp_gpt.config import UserError
from fsdp_gpt.family_parts import Family
from fsdp_gpt.files import read_json
from fsdp_gpt.hf_format import fused_like, read_folder_config

# config.json's keys the source keeps whatever the run wrote: its token ids (its tokenizer stays), its types
KEPT_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "model_type", "architectures", "torch_dtype", "dtype",
             "transformers_version")


def weight_files(source: str) -> list[str]:
    """The safetensors files holding a folder's weights: its index's, or model.safetensors."""
    index = os.path.join(source, "model.safetensors.index.json")
    if os.path.isfile(index):
        return sorted(set(read_json(index, "the folder is damaged", keys=("weight_map",))["weight_map"].values()))
    return ["model.safetensors"]


def merged(into: dict, update: dict) -> dict:
    """into with update's keys, dicts merged key by key (rope_parameters keeps the source's mrope_section)."""
    return into | {k: merged(into[k], v) if isinstance(v, dict) and isinstance(into.get(k), dict) else v
                   for k, v in update.items()}


def by_stored_name(trained: dict, stored: list[str], family: Family, tied: bool, source: str) -> dict:
    """The trained tensors (Hugging Face's names, one matrix per expert) by the names the source's files
    give them: a multimodal folder's language model's prefix, experts stored fused where the source's
    are. Every tensor of the source's language model (the family's blocks and root names) must be among
    them, or the source is another model than the run's."""
    theirs, ours = family.hf_wrapped or ("", "")
    family_name = {(ours + name[len(theirs):] if theirs and name.startswith(theirs) else name): name for name in stored}
    trained = fused_like(trained, family_name)
    out = {}
    for name, tensor in trained.items():
        if name in family_name:
            out[family_name[name]] = tensor
        elif not (name == "lm_head.weight" and tied):  # a tied head: the folder holds the embedding alone
            raise UserError(f"export_hf.py --whole_folder: {source}/ has no tensor {name!r} of the trained model: give "
                            f"the folder the run started from")
    block = family.hf_block.split("{i}")[0]
    stale = [stored_as for name, stored_as in family_name.items()
             if (name.startswith(block) or name in family.hf_root.values()) and stored_as not in out]
    if stale:
        raise UserError(f"export_hf.py --whole_folder: {source}/ holds {stale[0]!r}, which the trained model has no "
                        f"weight for: give the folder the run started from")
    return out


def write_whole_folder(trained: dict, keys: dict, family: Family, tied: bool, source: str, out_dir: str,
                       dtype: torch.dtype | None) -> str:
    """source's files into out_dir, its language model's tensors the trained ones (in `dtype`, or each in
    the dtype the source stored it in), config.json's language-model config merged with `keys` (hf_config's:
    transformers 5's rope_parameters among them). Returns the source's class."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig
    if os.path.realpath(source) == os.path.realpath(out_dir):
        raise UserError(f"export_hf.py --whole_folder: {out_dir} is the source folder itself: export into another")
    found = read_folder_config(source)
    if found.family.name != family.name:
        raise UserError(f"export_hf.py --whole_folder: {source}/ holds a {found.family.name} model, the checkpoint a "
                        f"{family.name} one: give the folder the run started from")
    files = weight_files(source)
    stored = {}
    for file in files:
        with safe_open(os.path.join(source, file), "pt") as f:
            stored |= {name: file for name in f.keys()}
    replaced = by_stored_name(trained, list(stored), family, tied, source)
    os.makedirs(out_dir, exist_ok=True)
    sizes = {}
    for file in files:
        with safe_open(os.path.join(source, file), "pt") as f:
            metadata, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
        for name in tensors.keys() & replaced.keys():
            if replaced[name].shape != tensors[name].shape:
                raise UserError(f"export_hf.py --whole_folder: {source}/'s {name} has shape {list(tensors[name].shape)}, "
                                f"the trained model's {list(replaced[name].shape)}: give the folder the run started from")
            tensors[name] = replaced[name].to(dtype or tensors[name].dtype).contiguous()
        sizes |= {name: t.numel() * t.element_size() for name, t in tensors.items()}
        save_file(tensors, os.path.join(out_dir, file), metadata=metadata or {"format": "pt"})
    index = os.path.join(source, "model.safetensors.index.json")
    if os.path.isfile(index):
        written = read_json(index, "the folder is damaged")
        written["metadata"] = dict(written.get("metadata") or {}, total_size=sum(sizes.values()))
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(written, f, indent=2)
    for entry in os.listdir(source):  # every other file as it was
        path, weights = os.path.join(source, entry), set(files) | {"model.safetensors.index.json", "config.json"}
        if entry in weights:
            continue
        if os.path.isdir(path):
            shutil.copytree(path, os.path.join(out_dir, entry), dirs_exist_ok=True)
        else:
            shutil.copy2(path, out_dir)
    # config.json: the language model's config with the keys the run defines, in transformers 5's form too
    config = read_json(os.path.join(source, "config.json"), "the folder is damaged")
    # (a copy: AutoConfig writes into the dicts it takes)
    as_5 = AutoConfig.for_model(family.hf_model_type, **{k: v for k, v in json.loads(json.dumps(keys)).items()
                                                         if k != "model_type"}).to_dict()
    update = {k: v for k, v in keys.items() if k not in KEPT_KEYS} | (
        {"rope_parameters": as_5["rope_parameters"]} if as_5.get("rope_parameters") else {})
    target = config[found.key] if found.key else config
    if isinstance(target.get("max_position_embeddings"), int):  # rows shorter than the folder's: its context stays
        update["max_position_embeddings"] = max(update.get("max_position_embeddings", 0), target["max_position_embeddings"])
    config = merged(config, {found.key: update}) if found.key else merged(config, update)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return found.wrapper or found.family.hf_class

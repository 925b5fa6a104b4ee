"""model.GPT <-> Hugging Face folders: GPT2LMHeadModel (arch gpt2), LlamaForCausalLM (arch llama),
Qwen3ForCausalLM (arch llama with qk_norm). Names, layouts and config keys, both ways.

Export builds the transformers model (export_hf.py); import (`init_from`) reads config.json and
the safetensors files directly, so training from published weights needs no transformers.
"""
import json
import math
import os
import re

import torch

from fsdp_gpt.config import LLAMA3_SCALING, UserError, check_rope_scaling, validate_model
from fsdp_gpt.files import read_json
from fsdp_gpt.model import GPT, GPTConfig

# model.GPT uses nn.Linear (out, in); GPT-2's Conv1D stores the transpose (in, out)
CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
GPT2_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal masks older GPT-2 files carry
# llama block parameters: ours -> Hugging Face's, under model.layers.{i}.
LLAMA_BLOCK = {"ln_1.weight": "input_layernorm.weight", "ln_2.weight": "post_attention_layernorm.weight",
               "attn.c_proj.weight": "self_attn.o_proj.weight", "mlp.c_proj.weight": "mlp.down_proj.weight",
               "attn.ln_q.weight": "self_attn.q_norm.weight", "attn.ln_k.weight": "self_attn.k_norm.weight"}
LLAMA_ROOT = {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
              "lm_head.weight": "lm_head.weight"}


def hf_architecture(cfg: GPTConfig) -> str:
    if cfg.arch == "gpt2":
        return "GPT2LMHeadModel"
    if cfg.moe_experts:
        return "Qwen3MoeForCausalLM"
    return "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"


# what Qwen3MoeForCausalLM computes otherwise than a mixture with these keys: (refused unless, why)
QWEN3_MOE_LIMITS = (("qk_norm", lambda cfg: cfg.qk_norm, "normalises q and k (qk_norm: true)"),
                    ("moe_shared", lambda cfg: cfg.moe_shared == 0, "has no shared experts"),
                    ("moe_score", lambda cfg: cfg.moe_score == "softmax", "scores experts by softmax"))


# (arch, mlp) -> the activation Hugging Face's model names: the pairs it can express (its Llama and
# Qwen3 MLPs are always gated, GPT-2's never)
HF_ACTIVATIONS = {("gpt2", "gelu"): "gelu_new", ("gpt2", "relu2"): "relu2", ("llama", "swiglu"): "silu"}


def hf_config(cfg: GPTConfig, eot: int | None) -> dict:
    """config.json's keys for our model; a model Hugging Face's classes would compute differently
    is refused, naming the key, rather than exported wrong."""
    for key, holds, why in QWEN3_MOE_LIMITS if cfg.moe_experts else ():
        if not holds(cfg):
            raise UserError(f"{key}: {getattr(cfg, key)} with moe_experts: Qwen3MoeForCausalLM {why}, so an export "
                            f"would compute other logits")
    if cfg.logit_softcap:
        raise UserError(f"logit_softcap: {cfg.logit_softcap}: {hf_architecture(cfg)} has no logit soft cap, so "
                        f"an export would compute other logits")
    if cfg.value_embeds:
        raise UserError(f"value_embeds: {cfg.value_embeds}: {hf_architecture(cfg)} has no value embeddings, so an "
                        f"export would compute other logits")
    if (cfg.arch, cfg.mlp) not in HF_ACTIVATIONS:
        raise UserError(f"mlp: {cfg.mlp} with arch: {cfg.arch}: {hf_architecture(cfg)}'s MLP is "
                        f"{'gated (SwiGLU)' if cfg.arch == 'llama' else 'not gated'}, so an export would compute "
                        f"other logits")
    activation = HF_ACTIVATIONS[cfg.arch, cfg.mlp]
    if cfg.arch == "gpt2":
        return dict(model_type="gpt2", vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
                    n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=cfg.ffn_hidden, activation_function=activation,
                    layer_norm_epsilon=cfg.norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                    tie_word_embeddings=True, bos_token_id=eot, eos_token_id=eot)
    return dict(model_type="qwen3" if cfg.qk_norm else "llama", vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd,
                intermediate_size=cfg.ffn_hidden, num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                num_key_value_heads=cfg.n_kv_head, head_dim=cfg.head_dim, max_position_embeddings=cfg.block_size,
                rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
                hidden_act=activation, attention_bias=False, mlp_bias=False, bos_token_id=eot, eos_token_id=eot) | (
        # the legacy key, which transformers 4 reads and 5 converts (into rope_parameters)
        {"rope_scaling": dict(cfg.rope_scaling)} if cfg.rope_scaling else {}) | (_qwen3_moe_config(cfg) if cfg.moe_experts else {})


def _qwen3_moe_config(cfg: GPTConfig) -> dict:
    """The experts' count under both names: num_experts (transformers 4), num_local_experts (5)."""
    return dict(model_type="qwen3_moe", num_experts=cfg.moe_experts, num_local_experts=cfg.moe_experts,
                num_experts_per_tok=cfg.moe_top_k, moe_intermediate_size=cfg.moe_hidden, norm_topk_prob=cfg.moe_norm_top_k,
                decoder_sparse_step=1, mlp_only_layers=list(range(cfg.moe_dense_layers)))


def to_hf(state: dict, cfg: GPTConfig) -> dict:
    """model.GPT's state dict -> the Hugging Face model's."""
    out = {}
    for name, tensor in state.items():
        out |= (_gpt2_to_hf if cfg.arch == "gpt2" else _llama_to_hf)(name, tensor, cfg)
    return {k: v.contiguous() for k, v in out.items()}


def _gpt2_to_hf(name: str, tensor: torch.Tensor, cfg: GPTConfig) -> dict:
    out = {"lm_head.weight" if name == "lm_head.weight" else "transformer." + name.replace("blocks.", "h."):
           tensor.t() if name.endswith(CONV1D_SUFFIXES) else tensor}
    if not cfg.bias and not name.endswith(("wte.weight", "wpe.weight", "lm_head.weight")):
        # GPT-2 always has biases: zeros compute the same as none
        hf_name = next(iter(out))
        out[hf_name.removesuffix("weight") + "bias"] = torch.zeros(out[hf_name].shape[-1])  # the output width
    return out


def _llama_to_hf(name: str, tensor: torch.Tensor, cfg: GPTConfig) -> dict:
    if name in LLAMA_ROOT:
        return {LLAMA_ROOT[name]: tensor}
    _, i, rest = name.split(".", 2)
    prefix = f"model.layers.{i}."
    if rest == "attn.c_attn.weight":  # q, k, v stacked by rows
        q, k, v = tensor.split([cfg.n_head * cfg.head_dim] + [cfg.n_kv_head * cfg.head_dim] * 2)
        return {prefix + "self_attn.q_proj.weight": q, prefix + "self_attn.k_proj.weight": k,
                prefix + "self_attn.v_proj.weight": v}
    if rest == "mlp.c_fc.weight":  # SwiGLU's gate, then up
        gate, up = tensor.chunk(2)
        return {prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up}
    if rest.startswith(("mlp.router.", "mlp.experts.", "mlp.expert_bias")):
        return _experts_to_hf(prefix + "mlp.", rest.removeprefix("mlp."), tensor)
    return {prefix + LLAMA_BLOCK[rest]: tensor}


def _experts_to_hf(prefix: str, name: str, tensor: torch.Tensor) -> dict:
    """An MoE layer's tensors as the files hold them (both transformers 4 and 5): one gate, up and
    down matrix per expert. A selection bias that training moved has no place there."""
    if name == "expert_bias":
        if tensor.any():
            raise UserError("moe_bias_rate trained a selection bias, which Qwen3MoeForCausalLM has no place for, so an "
                            "export would route otherwise")
        return {}
    if name == "router.weight":
        return {prefix + "gate.weight": tensor}
    if name == "experts.c_proj":
        return {f"{prefix}experts.{e}.down_proj.weight": w for e, w in enumerate(tensor)}
    out = {}
    for e, w in enumerate(tensor):  # experts.c_fc: each expert's gate rows, then its up rows
        gate, up = w.chunk(2)
        out |= {f"{prefix}experts.{e}.gate_proj.weight": gate, f"{prefix}experts.{e}.up_proj.weight": up}
    return out


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


# ---- import: a Hugging Face folder -> model keys and model.GPT's state dict ----

def hf_model_keys(folder: str) -> tuple[dict, int]:
    """(the model keys a folder's config.json sets, as GPTConfig takes them; the longest context its
    positions allow). For the rotary layouts block_size is not among the keys: it stays a training
    choice, up to max_position_embeddings; GPT-2's learned positions fix it."""
    keys = _config_keys(folder)
    if keys["arch"] == "gpt2":
        return keys, keys["block_size"]
    return {k: v for k, v in keys.items() if k != "block_size"}, keys["block_size"]


def define_model(cfg) -> None:
    """init_from: the folder's config.json sets every model key of cfg. A key the config file or the
    command line gave (cfg.given) that contradicts the folder is refused, naming both values; the
    run's tokenizer is the folder's unless one is named; block_size stays the config's, up to what
    the folder's positions allow. Then the checks that read the model's keys run (the config's others
    were checked when it was read): a refusal that names a key the folder set says it is the folder's."""
    keys, longest = hf_model_keys(cfg.init_from)
    for key, value in keys.items():
        mine = getattr(cfg, key)
        if key in cfg.given and mine is not None and mine != value:
            raise UserError(f"init_from {cfg.init_from} has {key}={value} but the config sets {key}={mine}: drop "
                            f"{key} from the config and the command line (the folder defines the model)")
        setattr(cfg, key, value)
    if cfg.block_size > longest:
        raise UserError(f"block_size={cfg.block_size} exceeds what init_from {cfg.init_from} was built for "
                        f"({longest} positions): set --block_size={longest} or less")
    if "tokenizer" not in cfg.given and os.path.isfile(os.path.join(cfg.init_from, "tokenizer.json")):
        cfg.tokenizer = cfg.init_from
    try:
        validate_model(cfg)
    except UserError as e:  # e.g. ep_size=3 must divide moe_experts=8 (init_from FOLDER sets moe_experts=8)
        named = ", ".join(f"{key}={getattr(cfg, key)}" for key in keys if re.search(rf"\b{key}\b", str(e)))
        raise UserError(f"{e} (init_from {cfg.init_from} sets {named})" if named else str(e)) from None


def _config_keys(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"init_from: {folder}/ has no config.json (a Hugging Face model folder is needed)")
    config = read_json(path, "init_from: the folder is damaged: download the model again")
    architecture = (config.get("architectures") or ["?"])[0]
    readers = {"GPT2LMHeadModel": _gpt2_keys, "LlamaForCausalLM": _llama_keys, "Qwen3ForCausalLM": _llama_keys,
               "Qwen3MoeForCausalLM": _qwen3_moe_keys}
    if architecture not in readers:
        raise UserError(f"init_from: {folder}/ holds a {architecture}; this trainer starts from "
                        f"{', '.join(readers)}")
    try:
        return readers[architecture](config, folder)
    except KeyError as e:
        raise UserError(f"init_from: {path} has no {e.args[0]!r}, which a {architecture} config holds")


def read_hf_folder(folder: str) -> tuple[dict, dict]:
    """(model keys as GPTConfig takes them, state dict in model.GPT's names) of a folder. A folder
    that is not what it claims (JSON, keys, tensors, file sizes) is refused with one line naming
    the file and what is wrong."""
    keys = _config_keys(folder)
    architecture = hf_architecture(GPTConfig(**keys))
    tensors = read_safetensors(folder)
    cfg = GPTConfig(**keys)
    try:
        state = _gpt2_from_hf(tensors) if cfg.arch == "gpt2" else _llama_from_hf(tensors, cfg)
    except KeyError as e:
        raise UserError(f"init_from: {folder}/ has no tensor {e.args[0]!r}, which its config's {architecture} holds")
    with torch.device("meta"):
        expected = GPT(cfg).state_dict()
    for name, tensor in expected.items():
        if name not in state:
            raise UserError(f"init_from: {folder}/ has no tensor for {name} (model.GPT's name), which its config's "
                            f"{architecture} holds")
        if state[name].shape != tensor.shape:
            raise UserError(f"init_from: {folder}/: {name} (model.GPT's name) has shape {list(state[name].shape)}, "
                            f"its config.json makes it {list(tensor.shape)}")
    return keys, state


GPT2_MLPS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu2": "relu2"}  # GPT-2's activations built here


def _gpt2_keys(config: dict, folder: str) -> dict:
    activation = config.get("activation_function", "gelu_new")
    if activation not in GPT2_MLPS:
        raise UserError(f"init_from: {folder}/ uses activation {activation}; built here: {', '.join(GPT2_MLPS)}")
    return dict(arch="gpt2", mlp=GPT2_MLPS[activation], vocab_size=config["vocab_size"],
                block_size=config["n_positions"], n_layer=config["n_layer"], n_head=config["n_head"],
                n_embd=config["n_embd"], bias=True, ffn_hidden=config.get("n_inner") or 4 * config["n_embd"],
                norm_eps=config.get("layer_norm_epsilon", 1e-5),
                tie_embeddings=config.get("tie_word_embeddings", True), moe_experts=0)


def _llama_keys(config: dict, folder: str) -> dict:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = None if kind == "default" else {"rope_type": kind} | {k: rope.get(k) for k in LLAMA3_SCALING}
    check_rope_scaling(scaling, f"init_from: {folder}/")
    n_head = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    return dict(arch="llama", vocab_size=config["vocab_size"], block_size=config["max_position_embeddings"],
                n_layer=config["num_hidden_layers"], n_head=n_head, n_embd=config["hidden_size"],
                n_kv_head=config.get("num_key_value_heads", n_head), bias=False,
                head_dim=None if head_dim * n_head == config["hidden_size"] else head_dim,
                rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))), rope_scaling=scaling,
                qk_norm=config["architectures"][0] == "Qwen3ForCausalLM", ffn_hidden=config["intermediate_size"],
                norm_eps=config.get("rms_norm_eps", 1e-6), tie_embeddings=config.get("tie_word_embeddings", False),
                moe_experts=0)


def _qwen3_moe_keys(config: dict, folder: str) -> dict:
    """Qwen3-MoE: Qwen3's attention, the MoE keys from config.json (the experts' count is num_experts
    in transformers 4, num_local_experts in 5). Its dense layers must be the first ones."""
    keys = _llama_keys(config | {"architectures": ["Qwen3ForCausalLM"]}, folder)
    experts = config["num_experts"] if "num_experts" in config else config["num_local_experts"]
    every, dense = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers") or []
    sparse = [i for i in range(keys["n_layer"]) if i not in dense and (i + 1) % every == 0]
    first = keys["n_layer"] - len(sparse)
    if sparse != list(range(first, keys["n_layer"])):
        raise UserError(f"init_from: {folder}/ has dense MLPs between its MoE layers (decoder_sparse_step={every}, "
                        f"mlp_only_layers={dense}); built here: the first moe_dense_layers blocks dense, then experts")
    return keys | dict(moe_experts=experts, moe_top_k=config["num_experts_per_tok"],
                       moe_hidden=config["moe_intermediate_size"], moe_norm_top_k=config.get("norm_topk_prob", False),
                       moe_dense_layers=first, moe_shared=0, moe_score="softmax")


def _gpt2_from_hf(tensors: dict) -> dict:
    state = {}
    for hf_name, tensor in tensors.items():
        name = hf_name.removeprefix("transformer.")
        if name.endswith(GPT2_BUFFERS):
            continue
        name = name.replace("h.", "blocks.", 1) if name.startswith("h.") else name
        state[name] = tensor.t() if name.endswith(CONV1D_SUFFIXES) else tensor
    state.setdefault("lm_head.weight", state["wte.weight"])
    return state


def _llama_from_hf(tensors: dict, cfg: GPTConfig) -> dict:
    state = {ours: tensors[theirs] for ours, theirs in LLAMA_ROOT.items() if theirs in tensors}
    state.setdefault("lm_head.weight", tensors[LLAMA_ROOT["wte.weight"]])  # tied: no lm_head in the file
    for i in range(cfg.n_layer):
        prefix = f"model.layers.{i}."
        block = dict(LLAMA_BLOCK)
        if not cfg.qk_norm:
            del block["attn.ln_q.weight"], block["attn.ln_k.weight"]
        if cfg.moe_experts and i >= cfg.moe_dense_layers:
            del block["mlp.c_proj.weight"]
            state |= _experts_from_hf(tensors, prefix + "mlp.", f"blocks.{i}.mlp.", cfg.moe_experts)
        else:
            state[f"blocks.{i}.mlp.c_fc.weight"] = torch.cat([tensors[prefix + "mlp.gate_proj.weight"],
                                                              tensors[prefix + "mlp.up_proj.weight"]])
        state |= {f"blocks.{i}.{ours}": tensors[prefix + theirs] for ours, theirs in block.items()}
        state[f"blocks.{i}.attn.c_attn.weight"] = torch.cat([tensors[f"{prefix}self_attn.{p}_proj.weight"] for p in "qkv"])
    return state


def _experts_from_hf(tensors: dict, theirs: str, ours: str, experts: int) -> dict:
    """An MoE layer: per-expert matrices stacked (or a file's fused ones taken as they are)."""
    fused = fused_like({k: tensors[k] for k in tensors if k.startswith(theirs + "experts.")},
                       [theirs + "experts.gate_up_proj", theirs + "experts.down_proj"])
    return {ours + "router.weight": tensors[theirs + "gate.weight"], ours + "expert_bias": torch.zeros(experts),
            ours + "experts.c_fc": fused[theirs + "experts.gate_up_proj"],
            ours + "experts.c_proj": fused[theirs + "experts.down_proj"]}


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_safetensors(folder: str) -> dict:
    """Every tensor of model.safetensors, or of the files model.safetensors.index.json names, as fp32."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index, "init_from: the folder is damaged: download the model again",
                               keys=("weight_map",))["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise UserError(f"init_from: {path} is missing (only safetensors weights are read)")
        tensors |= _read_safetensors_file(path)
    return tensors


def _read_safetensors_file(path: str) -> dict:
    """The format: an 8-byte little-endian header length, a JSON header ({name: dtype, shape,
    data_offsets}), then the raw bytes. Checked against the file's size before anything is read."""
    def refuse(what: str) -> UserError:
        return UserError(f"init_from: {path}: {what}")

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < 8:
            raise refuse(f"truncated: {size} bytes, shorter than the header's length field")
        header_size = int.from_bytes(f.read(8), "little")
        if 8 + header_size > size:
            raise refuse(f"the header claims {header_size:,} bytes, more than the {size - 8:,} after its length: "
                         f"truncated, or not a safetensors file")
        try:
            header = json.loads(f.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise refuse(f"the header is not JSON ({e})")
        data_size, tensors = size - 8 - header_size, {}
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            try:
                dtype, shape, (start, end) = meta["dtype"], meta["shape"], meta["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise refuse(f"tensor {key}'s header entry lacks dtype, shape or data_offsets")
            if dtype not in SAFETENSORS_DTYPES:
                raise refuse(f"tensor {key} is {dtype}; F32, F16 and BF16 are read")
            needed = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
            if not 0 <= start <= end <= data_size:
                raise refuse(f"tensor {key} lies at data bytes {start:,}..{end:,}, past the data's end ({data_size:,} "
                             f"bytes): a truncated download? fetch it again")
            if end - start != needed:
                raise refuse(f"tensor {key} of shape {shape} needs {needed:,} bytes, its offsets hold {end - start:,}")
            f.seek(8 + header_size + start)  # one tensor in memory at a time, besides the fp32 copies
            raw = torch.frombuffer(bytearray(f.read(needed)), dtype=torch.uint8) if needed else \
                torch.empty(0, dtype=torch.uint8)
            tensors[key] = raw.view(SAFETENSORS_DTYPES[dtype]).reshape(shape).float()
    return tensors

"""The families of Llama's layout continued most beside it, each Llama's entry with what differs: Qwen2
(q, k and v with biases), Mistral (one window), OLMo 2 (norms after each sublayer), OLMo 3 (OLMo 2's
with windows on some layers), Phi-3 (fused projections in its files; Phi-4-mini's partial RoPE),
SmolLM3 (layers without RoPE)."""
from dataclasses import replace

from fsdp_gpt.families.llama import LLAMA, LLAMA_DEFAULTS, llama_config, llama_keys
from fsdp_gpt.family_parts import (ONE_WINDOW, PLAIN_ATTENTION, PLAIN_HEAD, PLAIN_SCORES, QK_NORMED, Rows, refuse_unbuilt,
                                   repeating, window_keys, window_layer_types)


# ---- Qwen2 (Qwen2.5): Llama's layout, q, k and v with biases ----

def qwen2_config(cfg, eot: int | None) -> dict:
    """Llama's keys but the bias keys (its q, k and v always have biases, o and the MLP never), and no
    window: transformers 4.5x masks by sliding_window in every layer whatever use_sliding_window says."""
    keys = {k: v for k, v in llama_config(cfg, eot).items() if k not in ("attention_bias", "mlp_bias")}
    return keys | dict(use_sliding_window=False, sliding_window=None)


def qwen2_keys(config: dict) -> dict:
    refuse_unbuilt(config, (("use_sliding_window", lambda window: not window, "full attention in every layer"),))
    return llama_keys(config) | dict(arch="qwen2", bias=True)


QWEN2 = replace(
    LLAMA, name="Qwen2", arch="qwen2", biases=("attn.c_attn",), takes=LLAMA.takes | {"bias"},
    hf_class="Qwen2ForCausalLM", hf_model_type="qwen2", hf_config=qwen2_config, hf_keys=qwen2_keys,
    hf_names=LLAMA.hf_names | {"attn.c_attn.bias": Rows(("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                          "self_attn.v_proj.bias"), lambda cfg: cfg.qkv_widths)},
    hf_zero_biases=True)  # its class always has them: zeros where bias is false



# ---- Mistral: Llama's layout, a sliding window on every layer (v0.1's 4,096) or none (v0.3) ----

def mistral_config(cfg, eot: int | None) -> dict:
    keys = {k: v for k, v in llama_config(cfg, eot).items() if k not in ("attention_bias", "mlp_bias")}
    return keys | dict(sliding_window=cfg.window_of(0))  # every layer's (ONE_WINDOW): none where all are global


MISTRAL = replace(
    LLAMA, name="Mistral", arch="mistral", hf_class="MistralForCausalLM", hf_model_type="mistral",
    hf_config=mistral_config,
    hf_keys=lambda config: llama_keys(config) | dict(arch="mistral", sliding_window=config.get("sliding_window", 4096)),
    hf_limits=PLAIN_HEAD + (ONE_WINDOW,) + PLAIN_SCORES)


# ---- OLMo 2: no norm before a sublayer but one on its output, before the residual add; q and k normalised
# over their whole projections ----

def olmo2_config(cfg, eot: int | None) -> dict:
    """Llama's keys; no pad token (its class's default, 1, would keep that row of the embedding from
    training in transformers, where this trainer trains every row)."""
    return {k: v for k, v in llama_config(cfg, eot).items() if k != "mlp_bias"} | dict(pad_token_id=None)


OLMO2 = replace(
    LLAMA, name="OLMo 2", arch="olmo2", norms="after", qk_norm=True, qk_norm_scope="projection",
    takes=LLAMA.takes | {"qk_norm"}, hf_class="Olmo2ForCausalLM", hf_model_type="olmo2", hf_config=olmo2_config,
    hf_keys=lambda config: llama_keys(config, LLAMA_DEFAULTS | {"rms_norm_eps": 1e-5}) | dict(arch="olmo2", qk_norm=True),
    # Llama's names but for the norms: post_attention_layernorm normalises the attention's output here
    hf_names={ours: theirs for ours, theirs in LLAMA.hf_names.items() if not ours.startswith(("ln_1", "ln_2"))} | {
        "ln_attn_out.weight": "post_attention_layernorm.weight", "ln_mlp_out.weight": "post_feedforward_layernorm.weight"},
    hf_limits=(QK_NORMED,) + PLAIN_HEAD + PLAIN_ATTENTION)


# ---- OLMo 3: OLMo 2's block, a sliding window on the layers layer_types names (three of four by its class's
# default), the full-attention layers' RoPE alone scaled (YaRN in the long-context models) ----

OLMO3_DEFAULTS = LLAMA_DEFAULTS | {"rms_norm_eps": 1e-5, "rope_theta": 5e5}  # Olmo3Config's


def olmo3_config(cfg, eot: int | None) -> dict:
    """OLMo 2's keys, layer_types and the window; RoPE per layer type as transformers 5 reads it (the
    sliding layers' unscaled, on rope_local_theta where set), rope_theta and rope_scaling beside it for 4.5x."""
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta} | (cfg.rope_scaling or {})
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    return olmo2_config(cfg, eot) | dict(layer_types=window_layer_types(cfg), sliding_window=cfg.sliding_window,
                                         rope_parameters={"full_attention": full, "sliding_attention": local})


def olmo3_keys(config: dict) -> dict:
    """OLMo 2's keys from config.json, the windows from layer_types (absent: its class's default, every
    fourth layer full), each layer type's RoPE base: the sliding layers' is rope_local_theta where it
    differs from the full layers' or these are scaled (rope_scaling is theirs alone)."""
    n_layer, rope = config["num_hidden_layers"], config.get("rope_parameters") or {}
    types = config.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                                          for i in range(n_layer)]
    full, sliding = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    keys = llama_keys(config | {"rope_parameters": full or None}, OLMO3_DEFAULTS)
    windows = window_keys(types, config.get("sliding_window", 4096))  # its class's default
    local_theta = float(sliding.get("rope_theta") or keys["rope_theta"])
    apart = windows["sliding_window"] is not None and (local_theta != keys["rope_theta"] or keys["rope_scaling"] is not None)
    return keys | windows | dict(arch="olmo3", qk_norm=True, rope_local_theta=local_theta if apart else None)


OLMO3 = replace(
    OLMO2, name="OLMo 3", arch="olmo3", hf_class="Olmo3ForCausalLM", hf_model_type="olmo3", hf_config=olmo3_config,
    hf_keys=olmo3_keys,
    hf_limits=(QK_NORMED,) + PLAIN_HEAD + tuple(row for row in PLAIN_SCORES if row[0] != "rope_local_theta") + (
        ("rope_local_theta", lambda cfg: not cfg.rope_scaling or cfg.rope_local_theta or not cfg.sliding_window,
         "scales the full-attention layers' RoPE alone: set rope_local_theta (rope_theta's value) for unscaled local "
         "layers"),))


# ---- Phi-3: Llama's layout, its folders holding q, k and v in one matrix (qkv_proj: our c_attn as it is) and the
# MLP's gate and up in another (gate_up_proj: our c_fc), a sliding window on every layer (Phi-3-mini-4k's 2,047) ----

# its RoPE beside plain RoPE, as config.json sets it (rope_scaling's type: transformers 5's rope_parameters or 4's)
PHI3_UNBUILT = (("rope_scaling", lambda kind: kind == "default",
                 "plain RoPE (longrope, the long-context models' and Phi-3.5's, is not built)"),)


def phi3_config(cfg, eot: int | None) -> dict:
    """Llama's keys, one window or none, the fraction of each head RoPE rotates (top-level, where
    transformers 4 reads it; 5 moves it into rope_parameters); no pad token (its class's default,
    32000, is past a smaller vocabulary, and would keep that embedding row from training in transformers)."""
    keys = {k: v for k, v in llama_config(cfg, eot).items() if k not in ("attention_bias", "mlp_bias")}
    return keys | dict(sliding_window=cfg.window_of(0), partial_rotary_factor=cfg.partial_rotary_factor,
                       pad_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0)


def phi3_keys(config: dict) -> dict:
    """Llama's keys, the window, and partial_rotary_factor (Phi-4-mini's 0.75) from rope_parameters
    (transformers 5) or the top level (4)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    refuse_unbuilt({"rope_scaling": rope.get("rope_type", rope.get("type", "default"))}, PHI3_UNBUILT)
    return llama_keys(config, LLAMA_DEFAULTS | {"rms_norm_eps": 1e-5}) | dict(
        arch="phi3", sliding_window=config.get("sliding_window"),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))))


PHI3 = replace(
    LLAMA, name="Phi-3", arch="phi3", takes=LLAMA.takes - {"rope_scaling"},
    resumable=tuple(key for key in LLAMA.resumable if key != "rope_scaling"),
    hf_class="Phi3ForCausalLM", hf_model_type="phi3", hf_config=phi3_config, hf_keys=phi3_keys,
    hf_names=LLAMA.hf_names | {"attn.c_attn.weight": "self_attn.qkv_proj.weight",  # [q | k | v], as ours
                               "mlp.c_fc.weight": "mlp.gate_up_proj.weight"},  # [gate | up], as ours
    hf_limits=PLAIN_HEAD + (ONE_WINDOW,) + tuple(row for row in PLAIN_SCORES if row[0] != "partial_rotary_factor"))


# ---- SmolLM3: Llama's layout, every fourth layer without RoPE (its NoPE layers), the head tied ----

def smollm3_config(cfg, eot: int | None) -> dict:
    """Llama's keys and no_rope_layers (1: the layer rotates q and k, 0: it does not); no window, no pad
    token (its class's default, 128004, is past a smaller vocabulary)."""
    return llama_config(cfg, eot) | dict(no_rope_layers=[int(cfg.rotates(layer)) for layer in range(cfg.n_layer)],
                                         use_sliding_window=False, sliding_window=None, pad_token_id=None)


def smollm3_keys(config: dict) -> dict:
    """rope_pattern from no_rope_layers, or where config.json has none its class's default: every
    no_rope_layer_interval-th layer (4) without RoPE."""
    refuse_unbuilt(config, (("use_sliding_window", lambda window: not window, "full attention in every layer"),))
    every, n_layer = config.get("no_rope_layer_interval", 4), config["num_hidden_layers"]
    rotates = config.get("no_rope_layers") or [(layer + 1) % every != 0 for layer in range(n_layer)]
    return llama_keys(config, LLAMA_DEFAULTS | {"rope_theta": 2e6}) | dict(arch="smollm3", rope_pattern=repeating(["rope" if r else "nope" for r in rotates]),
                                     tie_embeddings=config.get("tie_word_embeddings", True))


SMOLLM3 = replace(
    LLAMA, name="SmolLM3", arch="smollm3", tied=True, rope_pattern=("rope", "rope", "rope", "nope"),
    hf_class="SmolLM3ForCausalLM", hf_model_type="smollm3", hf_config=smollm3_config, hf_keys=smollm3_keys,
    hf_limits=PLAIN_HEAD + tuple(row for row in PLAIN_ATTENTION if row[0] != "rope_pattern"))  # its class has NoPE

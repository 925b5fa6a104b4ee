"""Model families, one entry each: how its layout is built (model.py reads the entry), which keys it
takes (config.py's checks), what a resume may change (checkpoint/ckpt_format.py), and its Hugging
Face class, config.json's keys and the weights' names both ways (hf_format.py). No other module
branches on a family: a new one is an entry here, its tests and its row in docs/models.md
(docs/architecture.md: adding a family); what an entry is made of is family_parts.py.

A family builds one layout, the `arch` key (gpt2, llama). The table runs from a layout's plain
family to its refinements, each applying where its `when` keys are set: Llama with qk_norm is
Qwen3, with experts Qwen3-MoE. Plain Python, no torch: the config's checks read it too.
"""
from dataclasses import replace
from typing import Callable

from fsdp_gpt.family_parts import (ALL_BIASES, LLAMA3_SCALING, NO_VALUE_EMBEDS, ONE_WINDOW, PLAIN_ATTENTION, PLAIN_HEAD,
                                   PLAIN_SCORES, QK_NORMED, WINDOW_KEYS, Absent, Family, Rows, refuse_unbuilt)


# ---- GPT-2 ----

GPT2_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu2": "relu2"}  # its names -> our mlp


def gpt2_config(cfg, eot: int | None) -> dict:
    return dict(vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                n_head=cfg.n_head, n_inner=cfg.ffn_hidden, activation_function=GPT2.hf_mlps[cfg.mlp],
                layer_norm_epsilon=cfg.norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                tie_word_embeddings=True, bos_token_id=eot, eos_token_id=eot)


def gpt2_keys(config: dict) -> dict:
    activation = config.get("activation_function", "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise ValueError(f"uses activation {activation}; built here: {', '.join(GPT2_ACTIVATIONS)}")
    return dict(arch="gpt2", mlp=GPT2_ACTIVATIONS[activation], vocab_size=config["vocab_size"],
                block_size=config["n_positions"], n_layer=config["n_layer"], n_head=config["n_head"],
                n_embd=config["n_embd"], bias=True, ffn_hidden=config.get("n_inner") or 4 * config["n_embd"],
                norm_eps=config.get("layer_norm_epsilon", 1e-5),
                tie_embeddings=config.get("tie_word_embeddings", True), moe_experts=0)


GPT2 = Family(
    name="GPT-2", arch="gpt2", when=(), norm="layernorm", positions="learned", mlp="gelu", tied=True, biases=ALL_BIASES,
    init_std=0.02, takes=frozenset({"bias"}), resumable=WINDOW_KEYS,
    hf_class="GPT2LMHeadModel", hf_model_type="gpt2", hf_mlps={"gelu": "gelu_new", "relu2": "relu2"},
    hf_config=gpt2_config, hf_keys=gpt2_keys,
    hf_root={"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight",
             "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias",
             "lm_head.weight": "lm_head.weight"},
    hf_block="transformer.h.{i}.",
    hf_transposed=("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"),
    hf_zero_biases=True, hf_limits=PLAIN_HEAD + PLAIN_ATTENTION)


def repeating(kinds: list[str]) -> list[str]:
    """The shortest list that, repeated from the first layer, gives each layer's kind (a *_pattern key's value)."""
    return next(kinds[:p] for p in range(1, len(kinds) + 1) if all(kind == kinds[i % p] for i, kind in enumerate(kinds)))


# ---- Llama, and Qwen3 on its layout ----

def llama_config(cfg, eot: int | None) -> dict:
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.ffn_hidden,
                num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                head_dim=cfg.head_dim, max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps,
                rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings, hidden_act=LLAMA.hf_mlps[cfg.mlp],
                attention_bias=False, mlp_bias=False, bos_token_id=eot, eos_token_id=eot) | (
        # the legacy key, which transformers 4 reads and 5 converts (into rope_parameters)
        {"rope_scaling": dict(cfg.rope_scaling)} if cfg.rope_scaling else {})


# what a folder of Llama's layout may set that is not built here: (key, built(its value), what is built), refused by name
LLAMA_UNBUILT = (("hidden_act", lambda act: act in (None, "silu"), "silu (SwiGLU)"),
                 ("attention_bias", lambda bias: not bias, "attention without biases"),
                 ("mlp_bias", lambda bias: not bias, "an MLP without biases"),
                 ("attn_logit_softcapping", lambda cap: cap is None, "attention without a soft cap"))


# what LlamaForCausalLM takes where config.json is silent (its configuration class's defaults); a
# family whose class defaults otherwise passes its own
LLAMA_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0}


def llama_keys(config: dict, defaults: dict = LLAMA_DEFAULTS) -> dict:
    refuse_unbuilt(config, LLAMA_UNBUILT)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    n_head = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    return dict(arch="llama", vocab_size=config["vocab_size"], block_size=config["max_position_embeddings"],
                n_layer=config["num_hidden_layers"], n_head=n_head, n_embd=config["hidden_size"],
                n_kv_head=config.get("num_key_value_heads", n_head), bias=False,
                head_dim=None if head_dim * n_head == config["hidden_size"] else head_dim,
                rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or defaults["rope_theta"]),
                rope_scaling=None if kind == "default" else {"rope_type": kind} | {k: rope.get(k) for k in LLAMA3_SCALING},
                qk_norm=False, ffn_hidden=config["intermediate_size"],
                norm_eps=config.get("rms_norm_eps", defaults["rms_norm_eps"]),
                tie_embeddings=config.get("tie_word_embeddings", False), moe_experts=0)


LLAMA = Family(
    name="Llama", arch="llama", when=(), norm="rmsnorm", positions="rope", mlp="swiglu", tied=False, biases=(),
    init_std=0.02,
    takes=frozenset({"n_kv_head", "head_dim", "rope_theta", "rope_scaling", "rope_local_theta", "rope_pattern",
                     "tie_embeddings"}),
    resumable=("block_size", "rope_theta", "rope_scaling", "rope_local_theta") + WINDOW_KEYS,
    hf_class="LlamaForCausalLM", hf_model_type="llama", hf_mlps={"swiglu": "silu"},
    hf_config=llama_config, hf_keys=llama_keys,
    hf_root={"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"},
    hf_block="model.layers.{i}.",
    hf_names={"ln_1.weight": "input_layernorm.weight", "ln_2.weight": "post_attention_layernorm.weight",
              "attn.c_attn.weight": Rows(("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                          "self_attn.v_proj.weight"), lambda cfg: cfg.qkv_widths),
              "attn.c_proj.weight": "self_attn.o_proj.weight",
              "attn.ln_q.weight": "self_attn.q_norm.weight", "attn.ln_k.weight": "self_attn.k_norm.weight",
              "mlp.c_fc.weight": Rows(("mlp.gate_proj.weight", "mlp.up_proj.weight")),  # SwiGLU's gate, then up
              "mlp.c_proj.weight": "mlp.down_proj.weight"},
    hf_limits=PLAIN_HEAD + PLAIN_ATTENTION)

QWEN3 = replace(LLAMA, name="Qwen3", when=("qk_norm",), takes=LLAMA.takes | {"qk_norm"}, hf_class="Qwen3ForCausalLM",
                hf_model_type="qwen3", hf_keys=lambda config: llama_keys(config) | dict(qk_norm=True))


# ---- Qwen3-MoE: Qwen3's attention, a mixture of experts in its MLPs ----

def qwen3_moe_config(cfg, eot: int | None) -> dict:
    """The experts' count under both names: num_experts (transformers 4), num_local_experts (5)."""
    return llama_config(cfg, eot) | dict(
        num_experts=cfg.moe_experts, num_local_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_top_k,
        moe_intermediate_size=cfg.moe_hidden, norm_topk_prob=cfg.moe_norm_top_k, decoder_sparse_step=1,
        mlp_only_layers=list(range(cfg.moe_dense_layers)))


def qwen3_moe_keys(config: dict) -> dict:
    """The MoE keys from config.json (the experts' count is num_experts in transformers 4,
    num_local_experts in 5). Its dense layers must be the first ones."""
    keys = QWEN3.hf_keys(config)
    experts = config["num_experts"] if "num_experts" in config else config["num_local_experts"]
    every, dense = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers") or []
    sparse = [i for i in range(keys["n_layer"]) if i not in dense and (i + 1) % every == 0]
    first = keys["n_layer"] - len(sparse)
    if sparse != list(range(first, keys["n_layer"])):
        raise ValueError(f"has dense MLPs between its MoE layers (decoder_sparse_step={every}, mlp_only_layers={dense}); "
                         f"built here: the first moe_dense_layers blocks dense, then experts")
    return keys | dict(moe_experts=experts, moe_top_k=config["num_experts_per_tok"],
                       moe_hidden=config["moe_intermediate_size"], moe_norm_top_k=config.get("norm_topk_prob", False),
                       moe_dense_layers=first, moe_shared=0, moe_score="softmax")


QWEN3_MOE = replace(
    QWEN3, name="Qwen3-MoE", when=("moe_experts",), takes=QWEN3.takes | {"moe_experts"},
    hf_class="Qwen3MoeForCausalLM", hf_model_type="qwen3_moe", hf_config=qwen3_moe_config, hf_keys=qwen3_moe_keys,
    # its files hold one gate, up and down matrix per expert (transformers 4 and 5 alike)
    hf_names=QWEN3.hf_names | {
        "mlp.router.weight": "mlp.gate.weight",
        "mlp.experts.c_fc": Rows(("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")),
        "mlp.experts.c_proj": "mlp.experts.{e}.down_proj.weight",
        "mlp.expert_bias": Absent("moe_bias_rate trained a selection bias, which Qwen3MoeForCausalLM has no place for, "
                                  "so an export would route otherwise")},
    hf_limits=(QK_NORMED,
               ("moe_shared", lambda cfg: cfg.moe_shared == 0, "has no shared experts"),
               ("moe_score", lambda cfg: cfg.moe_score == "softmax", "scores experts by softmax")) + PLAIN_HEAD
    + PLAIN_ATTENTION)


# ---- Gemma 3: Llama's names, four (1 + weight) norms a block, scaled embeddings, GeGLU, q and k
# normalised, local (sliding-window) and global layers with a RoPE base each ----

GEMMA3_LAYERS = {"sliding_attention": "local", "full_attention": "global"}  # config.json's layer_types -> ours


def gemma3_layer_types(cfg) -> list[str]:
    return ["sliding_attention" if cfg.window_of(i) else "full_attention" for i in range(cfg.n_layer)]


def sliding_window_pattern(cfg) -> int | None:
    """transformers 4.5x's sliding_window_pattern N (layer i global where (i + 1) % N == 0) that
    gives the model's layers, or None where none does."""
    kinds = gemma3_layer_types(cfg)
    return next((n for n in range(1, cfg.n_layer + 2)
                 if all((kind == "full_attention") == ((i + 1) % n == 0) for i, kind in enumerate(kinds))), None)


def gemma3_config(cfg, eot: int | None) -> dict:
    """What transformers 4.5x reads (the pattern, both RoPE bases) and what 5.x reads (layer_types)
    together: both load the folder alike. The window is always a number there (null fails to load)."""
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.ffn_hidden,
                num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                head_dim=cfg.head_dim, max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps,
                hidden_activation=GEMMA3.hf_mlps[cfg.mlp], query_pre_attn_scalar=cfg.attn_scale_dim or cfg.head_dim,
                sliding_window=cfg.sliding_window or cfg.block_size, layer_types=gemma3_layer_types(cfg),
                sliding_window_pattern=sliding_window_pattern(cfg), rope_theta=cfg.rope_theta,
                rope_local_base_freq=cfg.rope_local_theta or cfg.rope_theta, final_logit_softcapping=cfg.logit_softcap,
                attn_logit_softcapping=None, attention_bias=False, tie_word_embeddings=cfg.tie_embeddings,
                bos_token_id=eot, eos_token_id=eot)


def gemma3_keys(config: dict) -> dict:
    """Our keys from a Gemma 3 text config.json: transformers 5's (layer_types, rope_parameters per
    layer type) or 4.5x's (sliding_window_pattern, rope_theta, rope_local_base_freq)."""
    if config.get("use_bidirectional_attention"):
        raise ValueError("has use_bidirectional_attention: true (EmbeddingGemma's); built here: causal attention")
    if config.get("attention_bias"):
        raise ValueError("has attention_bias: true; built here: Gemma 3's attention without biases")
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"uses hidden_activation {activation}; built here: gelu_pytorch_tanh")
    n_layer, rope = config["num_hidden_layers"], config.get("rope_parameters") or {}
    pattern = config.get("sliding_window_pattern") or 6
    types = config.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                          for i in range(n_layer)]
    if set(types) - set(GEMMA3_LAYERS):
        raise ValueError(f"has layer_types {sorted(set(types) - set(GEMMA3_LAYERS))} (layer_types); built here: "
                         f"{', '.join(GEMMA3_LAYERS)}")
    if (rope.get("full_attention") or {}).get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise ValueError("scales its global layers' RoPE (rope_scaling: Gemma 3 4B and up); built here: unscaled RoPE")
    kinds = [GEMMA3_LAYERS[kind] for kind in types]
    n_head, n_embd = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or n_embd // n_head
    scale_dim = config.get("query_pre_attn_scalar") or head_dim
    return dict(arch="gemma3", vocab_size=config["vocab_size"], block_size=config["max_position_embeddings"],
                n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_kv_head=config.get("num_key_value_heads", n_head),
                bias=False, head_dim=None if head_dim * n_head == n_embd else head_dim,
                rope_theta=float((rope.get("full_attention") or {}).get("rope_theta") or config.get("rope_theta") or 1e6),
                rope_local_theta=float((rope.get("sliding_attention") or {}).get("rope_theta")
                                       or config.get("rope_local_base_freq") or 1e4) if "local" in kinds else None,
                sliding_window=config["sliding_window"] if "local" in kinds else None,
                window_pattern=repeating(kinds) if "local" in kinds and "global" in kinds else None,
                attn_scale_dim=None if scale_dim == head_dim else scale_dim, qk_norm=True, mlp="geglu",
                ffn_hidden=config["intermediate_size"], norm_eps=config.get("rms_norm_eps", 1e-6),
                logit_softcap=config.get("final_logit_softcapping"), rope_scaling=None,
                tie_embeddings=config.get("tie_word_embeddings", True), moe_experts=0)


GEMMA3 = Family(
    name="Gemma 3", arch="gemma3", when=(), norm="rmsnorm_offset", positions="rope", mlp="geglu", tied=True,
    biases=(), init_std=0.02,
    takes=frozenset({"n_kv_head", "head_dim", "rope_theta", "rope_local_theta", "tie_embeddings", "qk_norm"}),
    resumable=("block_size", "rope_theta", "rope_local_theta") + WINDOW_KEYS,
    hf_class="Gemma3ForCausalLM", hf_model_type="gemma3_text", hf_mlps={"geglu": "gelu_pytorch_tanh"},
    hf_config=gemma3_config, hf_keys=gemma3_keys, hf_root=LLAMA.hf_root, hf_block=LLAMA.hf_block,
    # Llama's names but for the norms: ln_2 is its pre_feedforward_layernorm, post_attention_layernorm
    # normalises the attention's output
    hf_names=LLAMA.hf_names | {"ln_2.weight": "pre_feedforward_layernorm.weight",
                               "ln_attn_out.weight": "post_attention_layernorm.weight",
                               "ln_mlp_out.weight": "post_feedforward_layernorm.weight"},
    hf_limits=(QK_NORMED,
               ("window_pattern", lambda cfg: sliding_window_pattern(cfg) is not None,
                "reads N - 1 local layers then a global one, repeated (transformers 4.5x's sliding_window_pattern)"),
               ("n_head", lambda cfg: cfg.n_embd % cfg.n_head == 0, "needs n_embd a multiple of n_head (transformers 5)"),
               NO_VALUE_EMBEDS),
    norms="both", qk_norm=True, embed_scale=True)


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


# ---- Phi-3: Llama's layout, its folders holding q, k and v in one matrix (qkv_proj: our c_attn as it is) and the
# MLP's gate and up in another (gate_up_proj: our c_fc), a sliding window on every layer (Phi-3-mini-4k's 2,047) ----

# its RoPE beside plain RoPE, as config.json sets it (rope_scaling's type: transformers 5's rope_parameters or 4's)
PHI3_UNBUILT = (("rope_scaling", lambda kind: kind == "default",
                 "plain RoPE (longrope, the long-context models' and Phi-3.5's, is not built)"),
                ("partial_rotary_factor", lambda factor: factor == 1.0, "RoPE over the whole head"))


def phi3_config(cfg, eot: int | None) -> dict:
    """Llama's keys, one window or none; no pad token (its class's default, 32000, is past a smaller
    vocabulary, and would keep that embedding row from training in transformers)."""
    keys = {k: v for k, v in llama_config(cfg, eot).items() if k not in ("attention_bias", "mlp_bias")}
    return keys | dict(sliding_window=cfg.window_of(0), pad_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0)


def phi3_keys(config: dict) -> dict:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    refuse_unbuilt({"rope_scaling": rope.get("rope_type", rope.get("type", "default")),
                    "partial_rotary_factor": rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))},
                   PHI3_UNBUILT)
    return llama_keys(config, LLAMA_DEFAULTS | {"rms_norm_eps": 1e-5}) | dict(arch="phi3",
                                                                             sliding_window=config.get("sliding_window"))


PHI3 = replace(
    LLAMA, name="Phi-3", arch="phi3", takes=LLAMA.takes - {"rope_scaling"},
    resumable=tuple(key for key in LLAMA.resumable if key != "rope_scaling"),
    hf_class="Phi3ForCausalLM", hf_model_type="phi3", hf_config=phi3_config, hf_keys=phi3_keys,
    hf_names=LLAMA.hf_names | {"attn.c_attn.weight": "self_attn.qkv_proj.weight",  # [q | k | v], as ours
                               "mlp.c_fc.weight": "mlp.gate_up_proj.weight"},  # [gate | up], as ours
    hf_limits=PLAIN_HEAD + (ONE_WINDOW,) + PLAIN_SCORES)


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

FAMILIES = (GPT2, LLAMA, QWEN3, QWEN3_MOE, GEMMA3,  # each layout's plain family first, its refinements after it
            QWEN2, MISTRAL, OLMO2, PHI3, SMOLLM3)
ARCHS = tuple(dict.fromkeys(family.arch for family in FAMILIES))
FAMILY_KEYS = frozenset().union(*(family.takes for family in FAMILIES))  # the keys some family lacks


def layouts() -> str:
    """Each layout with its families, a refinement with the keys that make it (the arch key's meaning)."""
    def named(family: Family) -> str:
        return family.name + (f" with {', '.join(family.when)}" if family.when else "")
    return ", ".join(f"{arch} ({'; '.join(named(f) for f in FAMILIES if f.arch == arch)})" for arch in ARCHS)


def family_of(arch: str, is_set: Callable[[str], bool]) -> Family:
    """The family of a model of layout `arch`: its last entry whose `when` keys are all set (is_set)."""
    return [family for family in FAMILIES if family.arch == arch and all(map(is_set, family.when))][-1]

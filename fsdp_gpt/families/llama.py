"""Llama, and the refinements on its layout: Qwen3 (q and k normalised), Qwen3-MoE (experts in its MLPs)."""
from dataclasses import replace

from fsdp_gpt.family_parts import (LINEAR_KEYS, PLAIN_ATTENTION, PLAIN_HEAD, QK_NORMED, ROPE_SCALINGS, WINDOW_KEYS,
                                   Absent, Family, Rows, refuse_unbuilt)


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


def rope_scaling(kind: str, rope: dict, config: dict) -> dict:
    """The rope_scaling key from config.json's scaling of type `kind`: the numbers its type needs, and those
    of the others it may have that the folder sets (YaRN's factor, where DeepSeek's folders leave it unset,
    is the positions' over the original's). A type not built keeps its name alone, which the checks refuse."""
    needs, may = ROPE_SCALINGS.get(kind, ((), ()))
    scaling = {"rope_type": kind} | {k: rope.get(k) for k in needs} | {k: rope[k] for k in may if rope.get(k) is not None}
    if kind == "yarn" and scaling["factor"] is None and rope.get("original_max_position_embeddings"):
        scaling["factor"] = config["max_position_embeddings"] / rope["original_max_position_embeddings"]
    return scaling


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
                rope_scaling=None if kind == "default" else rope_scaling(kind, rope, config),
                qk_norm=False, ffn_hidden=config["intermediate_size"],
                norm_eps=config.get("rms_norm_eps", defaults["rms_norm_eps"]),
                tie_embeddings=config.get("tie_word_embeddings", False), moe_experts=0)


LLAMA = Family(
    name="Llama", arch="llama", when=(), norm="rmsnorm", positions="rope", mlp="swiglu", tied=False, biases=(),
    init_std=0.02,
    takes=frozenset({"n_kv_head", "head_dim", "rope_theta", "rope_scaling", "rope_local_theta", "rope_pattern",
                     "partial_rotary_factor", "tie_embeddings", "attn_pattern"}) | frozenset(LINEAR_KEYS),
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

"""gpt-oss (OpenAI's gpt-oss-20b and -120b): Llama's block with biases on q, k, v and o, an attention sink
per head, sliding-window and full layers by turns, YaRN RoPE, and a mixture of experts in every layer
whose router and experts have biases and whose experts are a clamped SwiGLU. Its folders hold the
experts fused as its class does (gate_up_proj (experts, width, 2 hidden), the gate and up columns
interleaved; down_proj (experts, hidden, width)), the published ones in MXFP4 (mxfp4.py)."""
from fsdp_gpt.families.llama import LLAMA, rope_scaling
from fsdp_gpt.family_parts import PLAIN_HEAD, PLAIN_SCORES, WINDOW_KEYS, Absent, Family, Rows, refuse_unbuilt, repeating

GPT_OSS_LAYERS = {"sliding_attention": "local", "full_attention": "global"}  # config.json's layer_types -> ours
# GptOssConfig's own defaults, where config.json is silent: YaRN stretching 4,096 positions 32 times
GPT_OSS_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096)
GPT_OSS_DEFAULTS = dict(rope_theta=150000.0, sliding_window=128, rms_norm_eps=1e-5, head_dim=64, num_key_value_heads=8)

# what a gpt-oss folder may set that is not built here: (key, built(its value), what is built)
GPT_OSS_UNBUILT = (("swiglu_alpha", lambda alpha: alpha in (None, 1.702), "the experts' sigmoid gain 1.702"),
                   ("swiglu_limit", lambda limit: limit in (None, 7.0), "the experts' clamp at 7.0"),
                   ("attention_bias", lambda bias: bias in (None, True), "q, k, v and o with biases"))


def gpt_oss_layer_types(cfg) -> list[str]:
    return ["sliding_attention" if cfg.window_of(i) else "full_attention" for i in range(cfg.n_layer)]


def gpt_oss_config(cfg, eot: int | None) -> dict:
    """config.json for transformers 4.55+ and 5 alike: RoPE's scaling always written (its class's default,
    where none is given, is YaRN's), the positions YaRN reaches where it scales."""
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else {"rope_type": "default"}
    reach = int(scaling["factor"] * scaling["original_max_position_embeddings"]) if scaling["rope_type"] == "yarn" else 0
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.moe_hidden,
                num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                head_dim=cfg.head_dim, max_position_embeddings=max(cfg.block_size, reach), rms_norm_eps=cfg.norm_eps,
                rope_theta=cfg.rope_theta, rope_scaling=scaling, tie_word_embeddings=cfg.tie_embeddings,
                hidden_act=GPT_OSS.hf_mlps[cfg.mlp], attention_bias=True, num_local_experts=cfg.moe_experts,
                num_experts_per_tok=cfg.moe_top_k, sliding_window=cfg.sliding_window or cfg.block_size,
                layer_types=gpt_oss_layer_types(cfg), swiglu_limit=7.0, router_aux_loss_coef=cfg.moe_aux_loss,
                bos_token_id=eot, eos_token_id=eot)


def gpt_oss_keys(config: dict) -> dict:
    """Our keys from a GptOssForCausalLM config.json: transformers 5's (rope_parameters) or 4.55's
    (rope_scaling, rope_theta); what it leaves unset, its class's defaults."""
    refuse_unbuilt(config, GPT_OSS_UNBUILT)
    n_layer, n_head, n_embd = config["num_hidden_layers"], config["num_attention_heads"], config["hidden_size"]
    types = config.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layer)]
    if set(types) - set(GPT_OSS_LAYERS):
        raise ValueError(f"has layer_types {sorted(set(types) - set(GPT_OSS_LAYERS))} (layer_types); built here: "
                         f"{', '.join(GPT_OSS_LAYERS)}")
    window = config.get("sliding_window", GPT_OSS_DEFAULTS["sliding_window"])  # null: no layer slides
    kinds = [GPT_OSS_LAYERS[kind] if window else "global" for kind in types]
    rope = config.get("rope_parameters") or config.get("rope_scaling") or GPT_OSS_ROPE
    kind = rope.get("rope_type", rope.get("type", "default"))
    # its class's: 64-wide heads and 8 key/value heads unless config.json says, n_embd / n_head and n_head where null
    head_dim = config.get("head_dim", GPT_OSS_DEFAULTS["head_dim"]) or n_embd // n_head
    experts = config["num_local_experts"] if "num_local_experts" in config else config["num_experts"]
    return dict(arch="gpt_oss", vocab_size=config["vocab_size"], block_size=config["max_position_embeddings"],
                n_layer=n_layer, n_head=n_head, n_embd=n_embd, bias=True,
                n_kv_head=config.get("num_key_value_heads", GPT_OSS_DEFAULTS["num_key_value_heads"]) or n_head,
                head_dim=None if head_dim * n_head == n_embd else head_dim,
                rope_theta=float(rope.get("rope_theta") or config.get("rope_theta") or GPT_OSS_DEFAULTS["rope_theta"]),
                rope_scaling=None if kind == "default" else rope_scaling(kind, rope, config),
                sliding_window=window if "local" in kinds else None,
                window_pattern=repeating(kinds) if "local" in kinds and "global" in kinds else None,
                mlp="clamped_swiglu", norm_eps=config.get("rms_norm_eps", GPT_OSS_DEFAULTS["rms_norm_eps"]),
                tie_embeddings=config.get("tie_word_embeddings", False), moe_experts=experts,
                moe_top_k=config["num_experts_per_tok"], moe_hidden=config["intermediate_size"], moe_norm_top_k=True,
                moe_score="softmax", moe_shared=0, moe_dense_layers=0)


GPT_OSS = Family(
    name="gpt-oss", arch="gpt_oss", when=(), norm="rmsnorm", positions="rope", mlp="clamped_swiglu", tied=False,
    # every linear of a block (the dense MLP's too, where moe_experts is 0: the mixture's dense twin)
    biases=("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj", "mlp.router", "mlp.experts"), init_std=0.02,
    takes=frozenset({"bias", "n_kv_head", "head_dim", "rope_theta", "rope_scaling", "tie_embeddings", "moe_experts"}),
    resumable=("block_size", "rope_theta", "rope_scaling") + WINDOW_KEYS,
    hf_class="GptOssForCausalLM", hf_model_type="gpt_oss", hf_mlps={"clamped_swiglu": "silu"},
    hf_config=gpt_oss_config, hf_keys=gpt_oss_keys, hf_root=LLAMA.hf_root, hf_block=LLAMA.hf_block,
    hf_names={"ln_1.weight": "input_layernorm.weight", "ln_2.weight": "post_attention_layernorm.weight",
              "attn.c_attn.weight": LLAMA.hf_names["attn.c_attn.weight"],
              "attn.c_attn.bias": Rows(("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
                                       lambda cfg: cfg.qkv_widths),
              "attn.c_proj.weight": "self_attn.o_proj.weight", "attn.c_proj.bias": "self_attn.o_proj.bias",
              "attn.sinks": "self_attn.sinks",  # the router's names are ours: mlp.router.weight and .bias
              "mlp.experts.c_fc": "mlp.experts.gate_up_proj", "mlp.experts.c_fc_bias": "mlp.experts.gate_up_proj_bias",
              "mlp.experts.c_proj": "mlp.experts.down_proj", "mlp.experts.c_proj_bias": "mlp.experts.down_proj_bias",
              "mlp.expert_bias": Absent("moe_bias_rate trained a selection bias, which GptOssForCausalLM has no place "
                                        "for (its router's bias weighs the experts too), so an export would route "
                                        "otherwise")},
    hf_transposed=("mlp.experts.c_fc", "mlp.experts.c_proj"),  # (experts, in, out) in its files
    hf_interleaved=("mlp.experts.c_fc", "mlp.experts.c_fc_bias"),  # gate, up, gate, up, ... in its files
    hf_zero_biases=True,  # its class has every bias: zeros where bias is false
    hf_quantized="the experts in MXFP4 (quantization_config mxfp4)",
    hf_limits=(("moe_experts", lambda cfg: cfg.moe_experts > 0, "has experts in every layer (no dense MLP)"),
               ("moe_dense_layers", lambda cfg: cfg.moe_dense_layers == 0, "has experts in every layer"),
               ("moe_shared", lambda cfg: cfg.moe_shared == 0, "has no shared experts"),
               ("moe_score", lambda cfg: cfg.moe_score == "softmax", "weighs the chosen experts by a softmax"),
               ("moe_norm_top_k", lambda cfg: cfg.moe_norm_top_k,
                "weighs the chosen experts by a softmax over their scores alone (moe_norm_top_k: true)"))
    + PLAIN_HEAD + PLAIN_SCORES,
    sinks=True)

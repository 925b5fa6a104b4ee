"""DeepSeek's layout: multi-head latent attention (latent_attention.py) and DeepSeekMoE (the first
blocks dense, then routed experts beside shared ones). DeepSeek V3's entry is also Moonlight's and Kimi
K2's (DeepseekV3ForCausalLM: sigmoid scores, a selection bias, grouped choice); DeepSeek-V2's
(DeepseekV2ForCausalLM, V2-Lite among them: softmax scores, no selection bias, always RoPE by pairs).

Their folders name what this trainer doesn't train: multi-token-prediction layers
(num_nextn_predict_layers, stored as the layers after num_hidden_layers) are skipped with a note.
"""
from fsdp_gpt.families.llama import LLAMA, rope_scaling
from fsdp_gpt.family_parts import NO_WINDOW, PLAIN_HEAD, WINDOW_KEYS, Absent, Family, Rows, refuse_unbuilt

# what DeepseekV3Config and DeepseekV2Config take where config.json is silent (their classes' defaults)
V3_DEFAULTS = dict(q_lora_rank=1536, n_shared_experts=1, routed_scaling_factor=2.5, n_group=8, topk_group=4,
                   first_k_dense_replace=3, norm_topk_prob=True)
V2_DEFAULTS = dict(q_lora_rank=1536, n_shared_experts=2, routed_scaling_factor=1.0, n_group=None, topk_group=None,
                   first_k_dense_replace=0, norm_topk_prob=False)
# what either class computes one way whatever config.json says, refused where it says otherwise
DEEPSEEK_UNBUILT = (("hidden_act", lambda act: act in (None, "silu"), "silu (SwiGLU)"),
                    ("attention_bias", lambda bias: not bias, "attention without biases"),
                    ("mlp_bias", lambda bias: not bias, "an MLP without biases"),
                    ("moe_layer_freq", lambda every: every in (None, 1), "experts in every block after the dense ones"))
V3_UNBUILT = DEEPSEEK_UNBUILT + (
    ("scoring_func", lambda score: score in (None, "sigmoid"), "sigmoid scores (DeepseekV3ForCausalLM's)"),
    ("topk_method", lambda method: method in (None, "noaux_tc"), "noaux_tc, the choice by scores and their bias"))
V2_UNBUILT = DEEPSEEK_UNBUILT + (
    ("scoring_func", lambda score: score in (None, "softmax"), "softmax scores (DeepseekV2ForCausalLM's)"),
    ("topk_method", lambda method: method in (None, "greedy", "group_limited_greedy"), "greedy or group_limited_greedy"),
    ("norm_topk_prob", lambda norm: not norm, "the chosen experts' scores as they are (DeepseekV2ForCausalLM never "
                                              "renormalises them)"))


def deepseek_keys(config: dict, arch: str, defaults: dict) -> dict:
    """Our keys from either class's config.json: latent attention, then the experts (none where every
    layer is dense)."""
    n_head, n_layer = config["num_attention_heads"], config["num_hidden_layers"]
    if config.get("num_key_value_heads", n_head) != n_head:  # its class would repeat kv_b's heads to these
        raise ValueError(f"has num_key_value_heads: {config['num_key_value_heads']} beside num_attention_heads: "
                         f"{n_head}; built here: latent attention's own key and value per head")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    keys = dict(arch=arch, vocab_size=config["vocab_size"], block_size=config["max_position_embeddings"],
                n_layer=n_layer, n_head=n_head, n_embd=config["hidden_size"], bias=False,
                ffn_hidden=config["intermediate_size"], norm_eps=config.get("rms_norm_eps", 1e-6),
                rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                rope_scaling=None if kind == "default" else rope_scaling(kind, rope, config),
                tie_embeddings=config.get("tie_word_embeddings", False),
                q_lora_rank=config.get("q_lora_rank", defaults["q_lora_rank"]), kv_lora_rank=config["kv_lora_rank"],
                qk_rope_head_dim=config["qk_rope_head_dim"], qk_nope_head_dim=config["qk_nope_head_dim"],
                v_head_dim=config["v_head_dim"], rope_interleave=config.get("rope_interleave", True), moe_experts=0)
    dense = config.get("first_k_dense_replace", defaults["first_k_dense_replace"])
    if dense >= n_layer:  # its class builds no MoE layer
        return keys
    setting = lambda name: config.get(name, defaults[name])  # noqa: E731 - config.json's, or its class's default
    return keys | dict(moe_experts=config["n_routed_experts"], moe_top_k=config["num_experts_per_tok"],
                       moe_hidden=config["moe_intermediate_size"], moe_shared=setting("n_shared_experts"),
                       moe_dense_layers=dense, moe_norm_top_k=bool(setting("norm_topk_prob")),
                       moe_scale=float(setting("routed_scaling_factor")), moe_groups=setting("n_group") or 1,
                       moe_top_groups=setting("topk_group") or 1)


def v3_keys(config: dict) -> dict:
    """The scores are the family's (moe_score null: sigmoid)."""
    refuse_unbuilt(config, V3_UNBUILT)
    return deepseek_keys(config, "deepseek_v3", V3_DEFAULTS)


def v2_keys(config: dict) -> dict:
    """The scores are the family's (moe_score null: softmax); its class turns q and k by pairs whatever
    rope_interleave says, and its greedy choice takes no groups whatever n_group says
    (group_limited_greedy ranks them by their best expert)."""
    refuse_unbuilt(config, V2_UNBUILT)
    keys = deepseek_keys(config, "deepseek_v2", V2_DEFAULTS) | dict(rope_interleave=True)
    if config.get("topk_method", "greedy") == "greedy":
        keys |= {"moe_groups": 1, "moe_top_groups": 1} if keys["moe_experts"] else {}
    return keys


def deepseek_config(cfg, eot: int | None) -> dict:
    """Both classes' config.json: latent attention, the experts (every layer dense where there are none:
    first_k_dense_replace the depth), no multi-token-prediction layer (none is trained here)."""
    experts = cfg.moe_experts
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.ffn_hidden,
                num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head,
                max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
                tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu", attention_bias=False, mlp_bias=False,
                q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
                qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim,
                first_k_dense_replace=cfg.moe_dense_layers if experts else cfg.n_layer, moe_layer_freq=1,
                n_routed_experts=experts or 1, num_experts_per_tok=cfg.moe_top_k, moe_intermediate_size=cfg.moe_hidden,
                n_shared_experts=cfg.moe_shared, routed_scaling_factor=cfg.moe_scale, n_group=cfg.moe_groups,
                topk_group=cfg.moe_top_groups, norm_topk_prob=cfg.moe_norm_top_k, num_nextn_predict_layers=0,
                bos_token_id=eot, eos_token_id=eot) | (
        # the legacy key, which transformers 4 reads and 5 converts (into rope_parameters)
        {"rope_scaling": dict(cfg.rope_scaling)} if cfg.rope_scaling else {})


def v3_config(cfg, eot: int | None) -> dict:
    return deepseek_config(cfg, eot) | dict(rope_interleave=cfg.rope_interleave, scoring_func="sigmoid",
                                            topk_method="noaux_tc")


def v2_config(cfg, eot: int | None) -> dict:
    return deepseek_config(cfg, eot) | dict(scoring_func="softmax", topk_method="group_limited_greedy"
                                            if cfg.moe_groups > 1 else "greedy")


def multi_token_prediction(config: dict) -> tuple[str, ...]:
    """The note on the multi-token-prediction layers a config.json names (DeepSeek V3's one), which the
    Hub's files hold as the layers after num_hidden_layers: never read here, none written on export."""
    extra = config.get("num_nextn_predict_layers") or 0
    if not extra:
        return ()
    first = config["num_hidden_layers"]
    layers = f"model.layers.{first}" + (f" to {first + extra - 1}" if extra > 1 else "")
    return (f"config.json names {extra} multi-token-prediction layer{'s' * (extra > 1)} (num_nextn_predict_layers: "
            f"{extra}; {layers} in the Hub's files): not trained here, so never read, and an export names none",)


# a block's names in both classes' folders (the experts one matrix each, as the Hub holds them)
DEEPSEEK_NAMES = {
    "ln_1.weight": "input_layernorm.weight", "ln_2.weight": "post_attention_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight", "attn.q_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_a_norm.weight": "self_attn.q_a_layernorm.weight", "attn.q_b.weight": "self_attn.q_b_proj.weight",
    "attn.kv_a.weight": "self_attn.kv_a_proj_with_mqa.weight", "attn.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.kv_b.weight": "self_attn.kv_b_proj.weight", "attn.c_proj.weight": "self_attn.o_proj.weight",
    "mlp.c_fc.weight": LLAMA.hf_names["mlp.c_fc.weight"], "mlp.c_proj.weight": LLAMA.hf_names["mlp.c_proj.weight"],
    "mlp.router.weight": "mlp.gate.weight", "mlp.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.experts.c_fc": Rows(("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")),
    "mlp.experts.c_proj": "mlp.experts.{e}.down_proj.weight",
    "mlp.shared.c_fc.weight": Rows(("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight")),
    "mlp.shared.c_proj.weight": "mlp.shared_experts.down_proj.weight"}

# what neither class computes otherwise, on export
DEEPSEEK_LIMITS = PLAIN_HEAD + (
    NO_WINDOW,
    ("attn_scale_dim", lambda cfg: cfg.attn_scale_dim in (None, cfg.head_widths[0]),
     "scales attention by 1/sqrt(qk_nope_head_dim + qk_rope_head_dim)"),
    ("moe_shared", lambda cfg: cfg.moe_shared or not cfg.moe_experts, "has shared experts beside the routed ones"))

DEEPSEEK_V3 = Family(
    name="DeepSeek V3", arch="deepseek_v3", when=(), norm="rmsnorm", positions="rope", mlp="swiglu", tied=False,
    biases=(), init_std=0.02,
    takes=frozenset({"rope_theta", "rope_scaling", "tie_embeddings", "moe_experts", "moe_scale", "moe_groups",
                     "moe_top_groups", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                     "v_head_dim", "rope_interleave"}),
    resumable=("block_size", "rope_theta", "rope_scaling") + WINDOW_KEYS,
    hf_class="DeepseekV3ForCausalLM", hf_model_type="deepseek_v3", hf_mlps={"swiglu": "silu"},
    hf_config=v3_config, hf_keys=v3_keys, hf_root=LLAMA.hf_root, hf_block=LLAMA.hf_block, hf_names=DEEPSEEK_NAMES,
    hf_limits=DEEPSEEK_LIMITS + (("moe_score", lambda cfg: cfg.moe_score == "sigmoid", "scores experts by sigmoid"),),
    hf_unread=multi_token_prediction, attention="latent", moe_score="sigmoid", moe_group_score="top2")

DEEPSEEK_V2 = Family(
    name="DeepSeek-V2", arch="deepseek_v2", when=(), norm="rmsnorm", positions="rope", mlp="swiglu", tied=False,
    biases=(), init_std=0.02, takes=DEEPSEEK_V3.takes, resumable=DEEPSEEK_V3.resumable,
    hf_class="DeepseekV2ForCausalLM", hf_model_type="deepseek_v2", hf_mlps={"swiglu": "silu"},
    hf_config=v2_config, hf_keys=v2_keys, hf_root=LLAMA.hf_root, hf_block=LLAMA.hf_block,
    hf_names=DEEPSEEK_NAMES | {"mlp.expert_bias": Absent(
        "moe_bias_rate trained a selection bias, which DeepseekV2ForCausalLM has no place for, so an export would "
        "route otherwise")},
    hf_limits=DEEPSEEK_LIMITS + (
        ("moe_score", lambda cfg: cfg.moe_score == "softmax", "scores experts by softmax"),
        ("moe_norm_top_k", lambda cfg: not cfg.moe_norm_top_k or not cfg.moe_experts,
         "weighs the chosen experts by their scores as they are (no renormalising)"),
        ("rope_interleave", lambda cfg: cfg.rope_interleave, "turns q and k by adjacent pairs (rope_interleave: true)")),
    hf_unread=multi_token_prediction, attention="latent", moe_score="softmax", moe_group_score="best")

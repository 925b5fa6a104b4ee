"""Gemma 3: Llama's names, four (1 + weight) norms a block, scaled embeddings, GeGLU, q and k normalised,
local (sliding-window) and global layers with a RoPE base each."""
from fsdp_gpt.families.llama import LLAMA
from fsdp_gpt.family_parts import (NO_VALUE_EMBEDS, QK_NORMED, WINDOW_KEYS, Family, window_keys,
                                   window_layer_types)


def sliding_window_pattern(cfg) -> int | None:
    """transformers 4.5x's sliding_window_pattern N (layer i global where (i + 1) % N == 0) that
    gives the model's layers, or None where none does."""
    kinds = window_layer_types(cfg)
    return next((n for n in range(1, cfg.n_layer + 2)
                 if all((kind == "full_attention") == ((i + 1) % n == 0) for i, kind in enumerate(kinds))), None)


def gemma3_config(cfg, eot: int | None) -> dict:
    """What transformers 4.5x reads (the pattern, both RoPE bases) and what 5.x reads (layer_types)
    together: both load the folder alike. The window is always a number there (null fails to load)."""
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.ffn_hidden,
                num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                head_dim=cfg.head_dim, max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps,
                hidden_activation=GEMMA3.hf_mlps[cfg.mlp], query_pre_attn_scalar=cfg.attn_scale_dim or cfg.head_dim,
                sliding_window=cfg.sliding_window or cfg.block_size, layer_types=window_layer_types(cfg),
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
    windows = window_keys(types, config.get("sliding_window", 4096))  # its class's default
    if (rope.get("full_attention") or {}).get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise ValueError("scales its global layers' RoPE (rope_scaling: Gemma 3 4B and up); built here: unscaled RoPE")
    local = windows["sliding_window"] is not None
    n_head, n_embd = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or n_embd // n_head
    scale_dim = config.get("query_pre_attn_scalar") or head_dim
    return dict(arch="gemma3", vocab_size=config["vocab_size"], block_size=config["max_position_embeddings"],
                n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_kv_head=config.get("num_key_value_heads", n_head),
                bias=False, head_dim=None if head_dim * n_head == n_embd else head_dim,
                rope_theta=float((rope.get("full_attention") or {}).get("rope_theta") or config.get("rope_theta") or 1e6),
                rope_local_theta=float((rope.get("sliding_attention") or {}).get("rope_theta")
                                       or config.get("rope_local_base_freq") or 1e4) if local else None,
                **windows, attn_scale_dim=None if scale_dim == head_dim else scale_dim, qk_norm=True, mlp="geglu",
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

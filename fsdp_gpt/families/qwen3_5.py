"""Qwen3.5 (dense) and Qwen3.5-MoE: Llama's layout with (1 + weight) norms, three Gated DeltaNet layers
(linear_attention.py) to each full-attention layer, that one gated (q_proj holds each head's query and
then its output gate), q and k normalised per head, RoPE on the first quarter of each head; the MoE's
routed experts beside a shared expert gated by a sigmoid of x. Published as
multimodal folders (Qwen3_5ForConditionalGeneration): the language model under config.json's
text_config and model.language_model.*, which init_from takes, leaving the vision tower."""
from dataclasses import replace

from fsdp_gpt.families.llama import LLAMA, rope_scaling
from fsdp_gpt.family_parts import (LINEAR_KEYS, NO_WINDOW, PLAIN_HEAD, PLAIN_SCORES, QK_NORMED, WINDOW_KEYS, Absent,
                                   Family, Rows, refuse_unbuilt, repeating)

# config.json's layer_types -> the attn_pattern key's kinds (linear: Gated DeltaNet, linear_attention.py)
QWEN3_5_LAYERS = {"full_attention": "full", "linear_attention": "linear"}
# the linear layers' keys <- config.json's, and the defaults of Qwen3_5TextConfig where it is silent
LINEAR_CONFIG = {"linear_key_heads": ("linear_num_key_heads", 16), "linear_value_heads": ("linear_num_value_heads", 32),
                 "linear_key_dim": ("linear_key_head_dim", 128), "linear_value_dim": ("linear_value_head_dim", 128),
                 "linear_conv": ("linear_conv_kernel_dim", 4)}
# a linear layer's weights, named alike but for the prefix: our attn. is its linear_attn.
LINEAR_WEIGHTS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight",
                  "dt_bias", "A_log", "norm.weight", "out_proj.weight")
# what a Qwen3.5 folder may set that is not built here: (key, built(its value), what is built), refused by name
QWEN3_5_UNBUILT = (("hidden_act", lambda act: act in (None, "silu"), "silu (SwiGLU)"),
                   ("attention_bias", lambda bias: not bias, "attention without biases"))


def rope_parameters(cfg) -> dict:
    """transformers 5's RoPE settings: the base, the fraction of each head rotated, a scaling's numbers."""
    return {"rope_type": "default", "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary_factor} | (cfg.rope_scaling or {})


def qwen3_5_config(cfg, eot: int | None) -> dict:
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.ffn_hidden,
                num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                head_dim=cfg.head_dim, max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps,
                rope_parameters=rope_parameters(cfg), tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu",
                attention_bias=False, bos_token_id=eot, eos_token_id=eot,
                layer_types=[f"{cfg.mixer_of(layer)}_attention" for layer in range(cfg.n_layer)]) | {
        theirs: getattr(cfg, ours) for ours, (theirs, _) in LINEAR_CONFIG.items()}


def qwen3_5_keys(config: dict) -> dict:
    """Our keys from a Qwen3.5 text config (a folder's config.json, or a multimodal one's text_config):
    what config.json leaves unset is Qwen3_5TextConfig's default (head_dim 256, a quarter of each head
    rotated, rms_norm_eps 1e-6, the head untied). mrope_section and mrope_interleaved give text tokens,
    whose three position ids are equal, plain RoPE."""
    refuse_unbuilt(config, QWEN3_5_UNBUILT)
    n_layer = config["num_hidden_layers"]
    every = config.get("full_attention_interval", 4)  # its class's layer_types where config.json has none
    types = config.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                          for i in range(n_layer)]
    if unbuilt := sorted(set(types) - set(QWEN3_5_LAYERS)):
        raise ValueError(f"has layer_types {unbuilt} (layer_types); built here: {', '.join(QWEN3_5_LAYERS)}")
    kinds = [QWEN3_5_LAYERS[kind] for kind in types]
    linear = {ours: config.get(theirs, default) for ours, (theirs, default) in LINEAR_CONFIG.items()} \
        if "linear" in kinds else {}
    rope = config.get("rope_parameters") or {}
    kind = rope.get("rope_type", "default")
    n_head, n_embd = config["num_attention_heads"], config["hidden_size"]
    return dict(arch="qwen3_5", vocab_size=config["vocab_size"], block_size=config.get("max_position_embeddings", 32768),
                n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_kv_head=config.get("num_key_value_heads", n_head),
                bias=False, head_dim=config.get("head_dim") or 256, qk_norm=True,
                rope_theta=float(rope.get("rope_theta") or config.get("rope_theta") or 1e4),
                rope_scaling=None if kind == "default" else rope_scaling(kind, rope, config),
                partial_rotary_factor=float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))),
                ffn_hidden=config["intermediate_size"], norm_eps=config.get("rms_norm_eps", 1e-6),
                tie_embeddings=config.get("tie_word_embeddings", False), moe_experts=0,
                attn_pattern=repeating(kinds)) | linear


QWEN3_5 = Family(
    name="Qwen3.5", arch="qwen3_5", when=(), norm="rmsnorm_offset", positions="rope", mlp="swiglu", tied=False, biases=(),
    init_std=0.02,
    takes=frozenset({"n_kv_head", "head_dim", "rope_theta", "rope_scaling", "partial_rotary_factor", "tie_embeddings",
                     "qk_norm", "attn_pattern"}) | frozenset(LINEAR_KEYS),
    resumable=("block_size", "rope_theta", "rope_scaling") + WINDOW_KEYS,
    hf_class="Qwen3_5ForCausalLM", hf_model_type="qwen3_5_text", hf_mlps={"swiglu": "silu"},
    hf_config=qwen3_5_config, hf_keys=qwen3_5_keys, hf_root=LLAMA.hf_root, hf_block=LLAMA.hf_block,
    # Llama's names in the full-attention layers (q_proj holds each head's query rows then its gate's, as our
    # c_attn's first part does), the linear layers' as they are under linear_attn.
    hf_names=LLAMA.hf_names | {f"attn.{name}": f"linear_attn.{name}" for name in LINEAR_WEIGHTS},
    hf_limits=(QK_NORMED,) + PLAIN_HEAD + (NO_WINDOW, PLAIN_SCORES[0]),
    qk_norm=True, partial_rotary=0.25, attn_gate=True, attn_pattern=("linear", "linear", "linear", "full"),
    hf_wrappers={"Qwen3_5ForConditionalGeneration": "text_config"}, hf_wrapped=("model.language_model.", "model."))


# ---- Qwen3.5-MoE: every layer's MLP routed experts (softmax, the top k renormalised) beside a gated shared one ----

def qwen3_5_moe_config(cfg, eot: int | None) -> dict:
    keys = {k: v for k, v in qwen3_5_config(cfg, eot).items() if k != "intermediate_size"}  # its class has none
    return keys | dict(num_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_top_k, moe_intermediate_size=cfg.moe_hidden,
                       shared_expert_intermediate_size=cfg.moe_shared * cfg.moe_hidden)


def qwen3_5_moe_keys(config: dict) -> dict:
    """The MoE's keys: its shared expert is moe_shared experts of moe_hidden wide, so its width must be a
    multiple of theirs."""
    hidden, shared = config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
    if shared % hidden:
        raise ValueError(f"has shared_expert_intermediate_size: {shared}, not a multiple of moe_intermediate_size "
                         f"{hidden}; built here: a shared expert of moe_shared x moe_hidden")
    return qwen3_5_keys(config | {"intermediate_size": hidden}) | dict(
        moe_experts=config["num_experts"], moe_top_k=config["num_experts_per_tok"], moe_hidden=hidden,
        moe_shared=shared // hidden, moe_norm_top_k=True, moe_dense_layers=0, moe_score="softmax", ffn_hidden=None)


QWEN3_5_MOE = replace(
    QWEN3_5, name="Qwen3.5-MoE", when=("moe_experts",), takes=QWEN3_5.takes | {"moe_experts"},
    hf_class="Qwen3_5MoeForCausalLM", hf_model_type="qwen3_5_moe_text", hf_config=qwen3_5_moe_config,
    hf_keys=qwen3_5_moe_keys,
    # its files hold one gate, up and down matrix per expert, the shared expert's as a dense MLP's
    hf_names=QWEN3_5.hf_names | {
        "mlp.router.weight": "mlp.gate.weight",
        "mlp.experts.c_fc": Rows(("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")),
        "mlp.experts.c_proj": "mlp.experts.{e}.down_proj.weight",
        "mlp.shared.c_fc.weight": Rows(("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight")),
        "mlp.shared.c_proj.weight": "mlp.shared_expert.down_proj.weight",
        "mlp.shared_gate.weight": "mlp.shared_expert_gate.weight",
        "mlp.expert_bias": Absent("moe_bias_rate trained a selection bias, which Qwen3_5MoeForCausalLM has no place for, "
                                  "so an export would route otherwise")},
    hf_limits=QWEN3_5.hf_limits + (
        ("moe_shared", lambda cfg: cfg.moe_shared >= 1, "has a shared expert beside the routed ones (moe_shared 1 or more)"),
        ("moe_dense_layers", lambda cfg: cfg.moe_dense_layers == 0, "has experts in every layer"),
        ("moe_norm_top_k", lambda cfg: cfg.moe_norm_top_k, "renormalises the chosen experts' weights"),
        ("moe_score", lambda cfg: cfg.moe_score == "softmax", "scores experts by softmax")),
    shared_expert_gate=True, hf_wrappers={"Qwen3_5MoeForConditionalGeneration": "text_config"})

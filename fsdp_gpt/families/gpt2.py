"""GPT-2: learned positions, LayerNorm and tanh GELU, biases in every linear, the head tied."""
from fsdp_gpt.family_parts import ALL_BIASES, PLAIN_ATTENTION, PLAIN_HEAD, WINDOW_KEYS, Family

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

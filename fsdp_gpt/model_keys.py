"""The model's keys, defined once: each with its type, default and meaning. GPTConfig (model.py) is
these keys with every null default settled by the model's family (families/); TrainConfig
(config.py) is these keys and the run's; --help, docs/config.md and the checks read them from there.
Plain Python, no torch: the config reads them without building a model.

What a checkpoint keeps of the model is one rule, said by each key (key()'s `defines`): a key that
changes what the model computes from its weights (their shapes, the positions, attention's windows
and scale, the head's cap, the routing) defines the model. A checkpoint's `model_config` holds every
defining key and nothing else (model_config below); a resume must have each alike, but for those its
family lets a resume change (Family.resumable, checkpoint/ckpt_format.check_model_shape); sample.py,
evaluate.py and export_hf.py build the model from them. A key that only says how the model trains
(dropout's rate, how the weights start, a loss's coefficient) defines nothing: `defines=False`, kept
in the checkpoint's run config alone, free to change on resume. tests/test_model.py holds every key
to the rule (a defining key's change shows in the weights or the logits; another's does not)."""
import dataclasses
from dataclasses import dataclass

from fsdp_gpt.families import FAMILY_KEYS, family_of, layouts
from fsdp_gpt.family_parts import Family


# the mlp key's values: whether c_fc holds a gate beside the up projection (twice as many rows), the
# one place gatedness is decided
MLPS = {"gelu": False, "swiglu": True, "relu2": False, "geglu": True, "clamped_swiglu": True}
# what window_pattern names a layer: local (its attention within sliding_window) or global (full)
WINDOW_KINDS = ("local", "global")
# what rope_pattern names a layer: rope (q and k rotated) or nope (no positions: SmolLM3's NoPE layers)
ROPE_KINDS = ("rope", "nope")
# what attn_pattern names a layer: full (attention) or linear (Gated DeltaNet: linear_attention.py)
MIXER_KINDS = ("full", "linear")


def key(default, meaning: str, defines: bool = True):
    """A config key: its default and a one-line meaning (train_fsdp.py --help, docs/config.md).
    defines (model keys): whether it changes what the model computes from its weights, so that a
    checkpoint keeps it as the model's (the rule: this module's docstring); False for a key that only
    says how the model trains."""
    return dataclasses.field(default=default, metadata={"meaning": meaning, "defines": defines})


@dataclass
class ModelKeys:
    arch: str = key("gpt2", f"the layout, as fsdp_gpt/families/ names it, and its families: {layouts()}; "
                            f"docs/families.md describes each")
    vocab_size: int | None = key(None, "embedding rows; null: the data's vocabulary (or the tokenizer's), rounded "
                                       "up to a multiple of 64")
    block_size: int = key(1024, "tokens per sequence (the context length)")
    n_layer: int = key(12, "DecoderBlocks (each is one FSDP unit)")
    n_head: int = key(12, "attention (query) heads; must divide n_embd")
    n_embd: int = key(768, "model width")
    dropout: float = key(0.0, "dropout rate after embeddings, in attention and after each sublayer (0: none)",
                         defines=False)
    bias: bool = key(True, "biases in the linears and norms the family gives them (GPT-2: all; Qwen2: q, k and v's)")
    n_kv_head: int | None = key(None, "key/value heads (grouped-query attention), dividing n_head; null: n_head")
    head_dim: int | None = key(None, "width of each attention head; null: n_embd / n_head (Qwen3 sets its own)")
    rope_theta: float = key(10000.0, "the base of RoPE's frequencies (the global layers', where rope_local_theta is set)")
    rope_scaling: dict | None = key(None, "RoPE frequency scaling, Llama 3.1's {rope_type: llama3, factor, "
                                          "low_freq_factor, high_freq_factor, original_max_position_embeddings} or "
                                          "YaRN's {rope_type: yarn, factor, original_max_position_embeddings, and "
                                          "optionally beta_fast, beta_slow, attention_factor, mscale and mscale_all_dim (DeepSeek's), "
                                          "truncate}; null: plain RoPE")
    qk_norm: bool | None = key(None, "RMSNorm of each head's q and k; null: the family's (llama: off, on exports as "
                                     "Qwen3ForCausalLM; gemma3: on)")
    tie_embeddings: bool | None = key(None, "LM head shares the token embedding; null: the family's (true for gpt2, "
                                            "false for llama)")
    ffn_hidden: int | None = key(None, "MLP width; null: 8/3 n_embd rounded up to 256 (swiglu), else 4 n_embd")
    norm_eps: float = key(1e-5, "epsilon of LayerNorm / RMSNorm")
    mlp: str | None = key(None, "the MLP: gelu, swiglu (gated SiLU), geglu (gated tanh GELU), clamped_swiglu "
                                "(gpt-oss's: (up + 1) * SiLU-like gate, both clamped at 7) or relu2 (relu(x)^2); "
                                "null: the family's (gelu for gpt2, swiglu for llama, geglu for gemma3, "
                                "clamped_swiglu for gpt_oss)")
    sliding_window: int | None = key(None, "sliding-window attention: each query attends to this many keys up to "
                                           "itself, in the layers window_pattern makes local; null: full attention")
    window_pattern: list | None = key(None, "which layers slide: local (sliding_window) and global (full attention) "
                                            "in a list repeated over the layers from the first (Gemma 3: five local, "
                                            "one global); null: every layer local")
    rope_local_theta: float | None = key(None, "rope: the local layers' RoPE base (Gemma 3: 10,000 beside rope_theta "
                                               "1,000,000); null: rope_theta, with rope_scaling")
    rope_pattern: list | None = key(None, "which layers rotate q and k, rope or nope (no positions), in a list "
                                          "repeated over the layers from the first (SmolLM3: three rope, one nope); "
                                          "null: the family's (every layer but in SmolLM3)")
    partial_rotary_factor: float | None = key(None, "the fraction of each head's dimensions RoPE rotates, the first "
                                                    "ones (Phi-4-mini: 0.75, Qwen3.5: 0.25; the others carry no "
                                                    "position); null: the family's (1: the whole head, but in Qwen3.5)")
    attn_pattern: list | None = key(None, "which layers attend, full (attention) or linear (Gated DeltaNet, "
                                          "Qwen3.5's linear attention), in a list repeated over the layers from the "
                                          "first (Qwen3.5: three linear, one full); null: the family's (every layer "
                                          "full, but in Qwen3.5)")
    linear_key_heads: int | None = key(None, "linear layers: query and key heads; null: n_head")
    linear_value_heads: int | None = key(None, "linear layers: value heads, a multiple of linear_key_heads (each key "
                                               "head serves value_heads / key_heads of them); null: linear_key_heads")
    linear_key_dim: int | None = key(None, "linear layers: width of each query and key head; null: head_dim")
    linear_value_dim: int | None = key(None, "linear layers: width of each value head; null: linear_key_dim")
    linear_conv: int = key(4, "linear layers: the causal convolution's kernel over q, k and v, in tokens")
    linear_chunk: int = key(64, "linear layers: tokens a chunk of the chunked delta rule (how it computes, not what: "
                                "memory a layer grows with it, the steps of its scan shrink)", defines=False)
    attn_scale_dim: int | None = key(None, "attention's scores scaled by 1/sqrt(attn_scale_dim) (Gemma 3's "
                                           "query_pre_attn_scalar); null: head_dim")
    logit_softcap: float | None = key(None, "squash logits into (-cap, cap) with cap * tanh(logits / cap), in fp32; "
                                            "null: off")
    zero_init_proj: bool = key(False, "attention and MLP output projections start at zero", defines=False)
    value_embeds: int = key(0, "the first N blocks mix an embedding of the input tokens into attention's values "
                               "(a vocab_size-row table each)")
    moe_experts: int = key(0, "routed experts in each MoE MLP, which replaces the dense one (0: dense; "
                              "docs/models.md)")
    moe_top_k: int = key(2, "MoE: experts each token is routed to (every token reaches them: dropless)")
    moe_hidden: int | None = key(None, "MoE: each expert's hidden width; null: ffn_hidden / moe_top_k")
    moe_shared: int = key(0, "MoE: shared experts that see every token (one MLP moe_shared x moe_hidden wide)")
    moe_dense_layers: int = key(0, "MoE: the first N blocks keep a dense MLP (DeepSeek-V3)")
    moe_score: str | None = key(None, "MoE: the router's scores, softmax (Qwen3, OLMoE) or sigmoid (DeepSeek-V3); "
                                      "null: the family's (sigmoid for deepseek_v3, else softmax)")
    moe_norm_top_k: bool = key(True, "MoE: renormalise the chosen experts' weights to sum to 1")
    moe_scale: float = key(1.0, "MoE: the routed experts' weights times this, after any renormalising (DeepSeek's "
                                "routed_scaling_factor: V3's 2.5)")
    moe_groups: int = key(1, "MoE: the experts in this many groups of consecutive ones, each token's top-k chosen "
                             "within its moe_top_groups best groups (DeepSeek's n_group; 1: no groups)")
    moe_top_groups: int = key(1, "MoE: the groups a token's experts are chosen from (DeepSeek's topk_group)")
    # multi-head latent attention (DeepSeek's MLA: the families whose attention is latent, latent_attention.py)
    q_lora_rank: int | None = key(None, "MLA: q made through a low rank, normed between its two matrices "
                                        "(DeepSeek V3's 1536); null: one matrix (V2-Lite's, Moonlight's)")
    kv_lora_rank: int = key(512, "MLA: the latent each token's k and v are made from, normed (one a token, shared "
                                 "by the heads)")
    qk_rope_head_dim: int = key(64, "MLA: the part of each head's q and k that RoPE turns, k's one for every head")
    qk_nope_head_dim: int = key(128, "MLA: the part of each head's q and k without positions")
    v_head_dim: int = key(128, "MLA: each head's v (and output) width")
    rope_interleave: bool = key(True, "MLA: RoPE turns adjacent pairs of q and k, as DeepSeek's folders hold them; "
                                      "false: the halves (rotate_half, Llama's)")
    moe_aux_loss: float = key(0.0, "MoE: the load-balancing loss's coefficient (Qwen3's router_aux_loss_coef; 0: "
                                   "off)", defines=False)

    @classmethod
    def of(cls, keys: "ModelKeys"):
        """The model keys of `keys` (a TrainConfig, say) as a `cls`."""
        return cls(**{name: getattr(keys, name) for name in MODEL_FIELDS})

    @property
    def family(self) -> Family:
        return family_of(self.arch, lambda name: bool(getattr(self, name)))

    @property
    def model_config(self) -> dict:
        """The keys that define the model (DEFINING_KEYS): what a checkpoint's model_config holds."""
        return {name: getattr(self, name) for name in DEFINING_KEYS}

    def settled(self) -> dict:
        """What the keys the family settles come to: each null default, and bias where the family has
        none. The one place the model's defaults resolve (GPTConfig applies it)."""
        family = self.family
        mlp = self.mlp or family.mlp
        ffn_hidden = self.ffn_hidden
        if ffn_hidden is None:  # a gated MLP's 8/3 n_embd (rounded up to 256) holds as many weights as 4 n_embd ungated
            ffn_hidden = 256 * -(-(8 * self.n_embd // 3) // 256) if MLPS.get(mlp) else 4 * self.n_embd
        head_dim = self.head_dim or self.n_embd // self.n_head
        key_heads, key_dim = self.linear_key_heads or self.n_head, self.linear_key_dim or head_dim
        return dict(n_kv_head=self.n_kv_head or self.n_head, bias=self.bias and bool(family.biases), mlp=mlp,
                    qk_norm=family.qk_norm if self.qk_norm is None else self.qk_norm,
                    ffn_hidden=ffn_hidden, head_dim=head_dim, linear_key_heads=key_heads, linear_key_dim=key_dim,
                    linear_value_heads=self.linear_value_heads or key_heads,
                    linear_value_dim=self.linear_value_dim or key_dim,
                    tie_embeddings=family.tied if self.tie_embeddings is None else self.tie_embeddings,
                    partial_rotary_factor=family.partial_rotary if self.partial_rotary_factor is None else
                    self.partial_rotary_factor,
                    moe_score=self.moe_score or family.moe_score,
                    # (a moe_top_k under 1 is refused by the checks, which read these values first)
                    moe_hidden=self.moe_hidden or max(ffn_hidden // max(self.moe_top_k, 1), 1))

    def window_of(self, layer: int) -> int | None:
        """The sliding window of block `layer`: sliding_window where window_pattern makes the layer
        local, else None (full attention)."""
        pattern = self.window_pattern or ["local"]
        return self.sliding_window if pattern[layer % len(pattern)] == "local" else None

    def mixer_of(self, layer: int) -> str:
        """Block `layer`'s token mixer, as attn_pattern makes it: full (attention) or linear (Gated DeltaNet)."""
        pattern = self.attn_pattern or self.family.attn_pattern
        return pattern[layer % len(pattern)]

    def rotates(self, layer: int) -> bool:
        """Whether block `layer` rotates q and k (RoPE), as rope_pattern or the family's makes it."""
        pattern = self.rope_pattern or self.family.rope_pattern
        return pattern[layer % len(pattern)] == "rope"

    def rope_base(self, layer: int) -> tuple[str, float] | None:
        """(key, value) of the RoPE base block `layer` rotates with (model.rotaries): rope_local_theta
        for a local layer where it is set, else rope_theta; None for a layer without positions (NoPE)."""
        if not self.rotates(layer):
            return None
        local = self.rope_local_theta and self.window_of(layer)
        return ("rope_local_theta", self.rope_local_theta) if local else ("rope_theta", self.rope_theta)

    def foreign_keys(self) -> dict:
        """{key: value} of the keys given here that the family does not take: such a key keeps its
        default, or states what the family makes of it (GPT-2's n_kv_head: n_head)."""
        lacked = [name for name in MODEL_FIELDS if name in FAMILY_KEYS - self.family.takes]
        defaults = {name: MODEL_FIELDS[name].default for name in lacked}
        settled = dataclasses.replace(self, **defaults).settled()
        return {name: getattr(self, name) for name in lacked
                if getattr(self, name) not in (defaults[name], settled.get(name, defaults[name]))}


MODEL_FIELDS = {f.name: f for f in dataclasses.fields(ModelKeys)}
# arch first: a checkpoint of another layout is reported as that, not as its first consequence (bias)
DEFINING_KEYS = tuple(name for name, f in MODEL_FIELDS.items() if f.metadata["defines"])

"""What a model family's entry is made of (families/ holds the entries): the entry's type, Hugging
Face's matrices stacked into one of ours (Rows) or absent (Absent), the rows of what a class
computes otherwise (an entry's hf_limits), and a folder's config.json refused by name where it sets
what is not built. Plain Python, no torch."""
import json
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

# the RoPE scalings built (the rope_scaling key's rope_type): (the numbers each needs, those it may have), as
# config.json and the rope_scaling key hold them: Llama 3.1's, and YaRN (OLMo 3's, DeepSeek's, Qwen3's long context)
ROPE_SCALINGS = {"llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
                 "yarn": (("factor", "original_max_position_embeddings"),
                          ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"))}


class Rows(NamedTuple):
    """Hugging Face's matrices stacked by rows into one of ours: `parts` in order, of the widths
    widths(cfg) gives (None: equal)."""
    parts: tuple[str, ...]
    widths: Callable | None = None


class Absent(NamedTuple):
    """One of our weights Hugging Face's class has no place for: zeros on import; an export of
    anything but zeros is refused with `refusal`."""
    refusal: str


@dataclass(frozen=True)
class Family:
    name: str  # as the docs and messages name it
    arch: str  # the layout it builds (the arch key)
    when: tuple[str, ...]  # the keys that, all set, make an `arch` model this family (a refinement)
    # the layout, as model.py's tables build it
    norm: str  # model.NORMS: layernorm or rmsnorm
    positions: str  # model.POSITIONS: learned (an embedding per position) or rope (q and k rotated)
    mlp: str  # the MLP where the mlp key is null (model.ACTIVATIONS)
    tied: bool  # the LM head is the token embedding where tie_embeddings is null
    biases: tuple[str, ...]  # the block's linears the bias key gives a bias (ALL_BIASES; (): none, whatever it says)
    init_std: float  # matrices start as N(0, init_std^2), residual projections scaled by 1/sqrt(2 n_layer)
    takes: frozenset[str]  # of the keys some family lacks (FAMILY_KEYS), the ones it takes
    resumable: tuple[str, ...]  # the keys a resume may change (RoPE keeps no weights per position)
    # Hugging Face: its class, config.json both ways, the weights' names both ways
    hf_class: str
    hf_model_type: str
    hf_mlps: dict[str, str]  # our mlp -> the activation config.json names: the MLPs its class computes
    hf_config: Callable  # (GPTConfig, eot) -> config.json's keys
    hf_keys: Callable  # config.json -> our model keys (ValueError: what is not built here)
    hf_root: dict[str, str]  # our names outside the blocks -> its
    hf_block: str  # its prefix of block {i}
    # a block's names, ours -> its (with {e}: one per expert, stacked in ours), Rows or Absent; unlisted: alike
    hf_names: dict = field(default_factory=dict)
    hf_transposed: tuple[str, ...] = ()  # ours its files hold transposed (GPT-2's Conv1D, gpt-oss's experts)
    hf_interleaved: tuple[str, ...] = ()  # ours whose gate and up rows its files interleave (gpt-oss's gate_up_proj)
    hf_quantized: str = ""  # what its published folders hold quantized: init_from reads it, an export writes it plain
    hf_zero_biases: bool = False  # its class has a bias in every layer: zeros stand in where ours has none
    hf_limits: tuple = ()  # (key, holds(cfg), why): what its class computes otherwise, refused on export
    # config.json -> a note each on what its folders hold that is not trained here (said at start-up, never read)
    hf_unread: Callable = lambda config: ()
    # more of a block's structure, where a family differs from most (model.py reads each in one place)
    norms: str = "before"  # where a block's norms sit around each sublayer (model.NORM_PLACES): before, after or both
    qk_norm: bool = False  # q and k normalised where the qk_norm key is null
    qk_norm_scope: str = "head"  # what one qk norm spans (model.QK_NORM_WIDTHS): each head, or the whole projection
    rope_pattern: tuple[str, ...] = ("rope",)  # which layers rotate q and k where the rope_pattern key is null
    attn_pattern: tuple[str, ...] = ("full",)  # which layers attend (full) or are linear where the attn_pattern key is null
    embed_scale: bool = False  # token embeddings times sqrt(n_embd) (in fp32, whatever their dtype)
    partial_rotary: float = 1.0  # the fraction of each head RoPE rotates where the partial_rotary_factor key is null
    attn_gate: bool = False  # attention's output times a sigmoid gate, its rows in c_attn after each head's query's
    shared_expert_gate: bool = False  # the shared experts' output times a sigmoid of one linear of x (Qwen3.5-MoE)
    # Hugging Face folders that hold this family's model inside another's (a multimodal class's language model):
    # {their class: the key of config.json holding its config}; such a folder's weights, and a CausalLM's saved
    # from one, carry the prefix hf_wrapped[0] where the family's names begin with hf_wrapped[1]
    hf_wrappers: dict = field(default_factory=dict)
    hf_wrapped: tuple[str, str] | None = None
    attention: str = "mha"  # model.ATTENTIONS: multi-head (grouped-query) attention, or DeepSeek's latent one
    moe_score: str = "softmax"  # the router's scores where the moe_score key is null: softmax or sigmoid
    moe_group_score: str = "top2"  # moe.GROUP_SCORES: what ranks a group of experts where moe_groups is set
    sinks: bool = False  # a learned logit per head in every row's softmax denominator (gpt-oss's attention sinks)


# the block's linears, by their names in model.DecoderBlock: a family with biases everywhere (GPT-2) lists them all
ALL_BIASES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")

# what no class below computes: an export of a model with them is refused, naming the key
NO_VALUE_EMBEDS = ("value_embeds", lambda cfg: not cfg.value_embeds, "has no value embeddings")
PLAIN_HEAD = (("logit_softcap", lambda cfg: not cfg.logit_softcap, "has no logit soft cap"), NO_VALUE_EMBEDS)
# what only some classes compute beside these: windows (Mistral's one on every layer, Gemma 3's local and global
# layers), another attention scale, a second RoPE base (Gemma 3's), layers without RoPE (SmolLM3's), linear
# layers (Qwen3.5's Gated DeltaNet)
NO_WINDOW = ("sliding_window", lambda cfg: cfg.sliding_window is None,
             "attends to every earlier token (no sliding window)")
ONE_WINDOW = ("window_pattern", lambda cfg: len(set(map(cfg.window_of, range(cfg.n_layer)))) == 1,
              "slides one window over every layer (sliding_window), or none")
PLAIN_SCORES = (
    ("attn_scale_dim", lambda cfg: cfg.attn_scale_dim in (None, cfg.head_dim), "scales attention by 1/sqrt(head_dim)"),
    ("rope_local_theta", lambda cfg: cfg.rope_local_theta in (None, cfg.rope_theta), "has one RoPE base"),
    ("rope_pattern", lambda cfg: all(map(cfg.rotates, range(cfg.n_layer))), "rotates q and k in every layer"),
    ("partial_rotary_factor", lambda cfg: cfg.partial_rotary_factor == 1.0, "rotates the whole of each head"),
    ("attn_pattern", lambda cfg: all(cfg.mixer_of(layer) == "full" for layer in range(cfg.n_layer)),
     "attends in every layer (no linear-attention layers)"))
PLAIN_ATTENTION = (NO_WINDOW,) + PLAIN_SCORES
QK_NORMED = ("qk_norm", lambda cfg: cfg.qk_norm, "normalises q and k (qk_norm: true)")  # a class that always does
# what a resume may change in every family: a window holds no weights
WINDOW_KEYS = ("sliding_window", "window_pattern")
# the keys of the linear layers (model_keys.py; refused where attn_pattern makes none)
LINEAR_KEYS = ("linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim", "linear_conv",
               "linear_chunk")


def refuse_unbuilt(config: dict, unbuilt: tuple) -> None:
    """A ValueError naming the first key of config.json whose value is not built here."""
    for key, built, what in unbuilt:
        if not built(config.get(key)):
            raise ValueError(f"has {key}: {json.dumps(config[key])}; built here: {what}")


# config.json's layer_types where a class slides a window over some layers (Gemma 3's, OLMo 3's) -> window_pattern's
WINDOW_LAYERS = {"sliding_attention": "local", "full_attention": "global"}


def window_layer_types(cfg) -> list[str]:
    """config.json's layer_types of the model's layers: sliding_attention where a window slides."""
    return ["sliding_attention" if cfg.window_of(i) else "full_attention" for i in range(cfg.n_layer)]


def window_keys(types: list[str], window: int | None) -> dict:
    """sliding_window and window_pattern from config.json's layer_types and window (ValueError: a type
    not built here, named)."""
    if unbuilt := sorted(set(types) - set(WINDOW_LAYERS)):
        raise ValueError(f"has layer_types {unbuilt} (layer_types); built here: {', '.join(WINDOW_LAYERS)}")
    kinds = [WINDOW_LAYERS[kind] for kind in types]
    return dict(sliding_window=window if "local" in kinds else None,
                window_pattern=repeating(kinds) if len(set(kinds)) == 2 else None)


def repeating(kinds: list[str]) -> list[str]:
    """The shortest list that, repeated from the first layer, gives each layer's kind (a *_pattern key's value)."""
    return next(kinds[:p] for p in range(1, len(kinds) + 1) if all(kind == kinds[i % p] for i, kind in enumerate(kinds)))


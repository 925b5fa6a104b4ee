"""The config's checks, run once as it is read (config_parse.py): a bad value stops the run with one
line (UserError) before anything starts. With init_from the model's keys are the folder's:
validate_run when the config is read, validate_model once the folder has set them
(hf_format.define_model). The checks that need the launch (world size, devices) live with it.
"""
import dataclasses
import re

from fsdp_gpt.config import (COMPILE_MODES, CP_MODES, DECAY_SHAPES, DTYPES, EP_STRATEGIES, FP8_LAYERS, FP8_RECIPES,
                             LR_SCHEDULES, MOE_SCORES, MUON_COEFFICIENTS, OPTIMIZERS, PLANNED_GPUS, STRATEGIES, TrainConfig,
                             UserError, named_paths)
from fsdp_gpt.families import ARCHS, FAMILIES
from fsdp_gpt.family_parts import LINEAR_KEYS, ROPE_SCALINGS
from fsdp_gpt.model_keys import MLPS, MIXER_KINDS, MODEL_FIELDS, ROPE_KINDS, WINDOW_KINDS


def require(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


def validate(cfg: TrainConfig) -> None:
    """Checks that need no knowledge of the launch (world size checks live with the mesh). With
    init_from, the model's keys are the folder's: validate_run when the config is read, validate_model
    once the folder has set them (hf_format.define_model)."""
    validate_run(cfg)
    validate_model(cfg)


def archs_taking(key: str) -> str:
    """The layouts whose families take a model key, as a refusal names them ("llama or gemma3")."""
    return " or ".join(dict.fromkeys(family.arch for family in FAMILIES if key in family.takes))


def validate_model(cfg: TrainConfig) -> None:
    """The model's keys, and the others' checks that read them."""
    for key in ("n_layer", "n_head", "n_embd"):
        require(getattr(cfg, key) > 0, f"config key '{key}' must be positive, got {getattr(cfg, key)}")
    require(cfg.arch in ARCHS, f"arch '{cfg.arch}' is not one of {', '.join(ARCHS)}")
    for key, value in cfg.foreign_keys().items():  # e.g. qk_norm with GPT-2's layout
        raise UserError(f"{key}={value} needs arch: {archs_taking(key)} ({cfg.family.name} takes no {key})")
    require(cfg.head_dim is not None or cfg.n_embd % cfg.n_head == 0,
            f"n_head={cfg.n_head} must divide n_embd={cfg.n_embd}: pick n_embd as a multiple of n_head")
    require(cfg.head_dim is None or cfg.head_dim > 0, f"head_dim must be positive, got {cfg.head_dim}")
    require(cfg.n_kv_head is None or (cfg.n_kv_head > 0 and cfg.n_head % cfg.n_kv_head == 0),
            f"n_kv_head={cfg.n_kv_head} must divide n_head={cfg.n_head} (each key/value head serves "
            f"n_head / n_kv_head query heads)")
    head_dim = cfg.head_dim or cfg.n_embd // cfg.n_head
    # checked where RoPE turns the heads: GPT-2's learned positions take any head_dim, and latent attention
    # turns its own part of each head (qk_rope_head_dim, check_latent)
    turns_heads = cfg.family.positions == "rope" and cfg.family.attention != "latent"
    require(not turns_heads or head_dim % 2 == 0,
            f"head dimension {'n_embd / n_head = ' * (cfg.head_dim is None)}{head_dim} must be even for RoPE")
    check_latent(cfg)
    require(cfg.rope_theta > 0, f"rope_theta must be positive, got {cfg.rope_theta}")
    factor = cfg.settled()["partial_rotary_factor"]
    require(not turns_heads or (0 < factor <= 1 and int(head_dim * factor) % 2 == 0
                                               and int(head_dim * factor) > 0),
            f"partial_rotary_factor={factor} must be in (0, 1] and rotate an even number of each head's {head_dim} "
            f"dimensions (RoPE turns them in pairs), not {int(head_dim * factor)}")
    check_rope_scaling(cfg.rope_scaling, "rope_scaling")
    require(cfg.ffn_hidden is None or cfg.ffn_hidden > 0, f"ffn_hidden must be positive, got {cfg.ffn_hidden}")
    require(0 <= cfg.value_embeds <= cfg.n_layer, f"value_embeds must be 0 to n_layer={cfg.n_layer}, got {cfg.value_embeds}")
    require(cfg.mlp is None or cfg.mlp in MLPS, f"mlp '{cfg.mlp}' is not one of {', '.join(MLPS)}")
    pattern = cfg.rope_pattern
    require(pattern is None or (isinstance(pattern, list) and pattern and all(kind in ROPE_KINDS for kind in pattern)),
            f"rope_pattern must be a list of {' and '.join(ROPE_KINDS)} (each layer's, repeated over the layers), got "
            f"{pattern}")
    check_window(cfg)  # after rope_pattern: it reads which layers rotate
    check_linear(cfg)
    require(not (cfg.family.sinks and cfg.dropout),
            f"dropout={cfg.dropout} with {cfg.family.name}'s attention sinks is not built (the kernels whose "
            f"log-sum-exp a sink joins take no dropout): use dropout 0")
    require(cfg.logit_softcap is None or cfg.logit_softcap > 0,
            f"logit_softcap must be positive (or null: off), got {cfg.logit_softcap}")
    # each unit starts the gathers of the ones after it, a unit holding a block or more: a depth past the
    # last block can't be run by any layout (init_from's folder sets n_layer, so this waits for the model's
    # keys); one past the units that fsdp_blocks_per_unit makes is cut to them, said at start-up (parallelize)
    require(cfg.fsdp_prefetch < max(cfg.n_layer, 2),
            f"fsdp_prefetch={cfg.fsdp_prefetch} reaches past the model's {cfg.n_layer} blocks: at most "
            f"{max(cfg.n_layer - 1, 1)} (each unit, of one block or more, prefetches the units after it)")
    check_moe(cfg)
    check_context_parallel(cfg)
    # resolved, as the run prints its config and its checkpoints keep it: a reader of the checkpoint
    # (a tool of an older version among them) takes the head's tying as it is, not its family's default
    cfg.tie_embeddings = cfg.settled()["tie_embeddings"]


def validate_run(cfg: TrainConfig) -> None:
    """The keys a Hugging Face folder never sets, as far as the process group and meshes read them."""
    for key in ("block_size", "train_batch", "micro_batch", "log_interval", "eval_interval", "eval_iters", "save_interval"):
        require(getattr(cfg, key) > 0, f"config key '{key}' must be positive, got {getattr(cfg, key)}")
    require(cfg.max_iters >= 0, f"max_iters must be 0 or more, got {cfg.max_iters}")
    require(cfg.sample_tokens >= 0, f"sample_tokens must be 0 or more, got {cfg.sample_tokens}")
    require(cfg.muon_coefficients in MUON_COEFFICIENTS,
            f"muon_coefficients '{cfg.muon_coefficients}' is not one of {', '.join(MUON_COEFFICIENTS)}")
    require(cfg.train_batch % cfg.micro_batch == 0,
            f"micro_batch={cfg.micro_batch} must divide train_batch={cfg.train_batch}")
    require(cfg.sharding_strategy in STRATEGIES,
            f"sharding_strategy '{cfg.sharding_strategy}' is not one of {', '.join(STRATEGIES)}")
    require(cfg.dtype in DTYPES, f"dtype '{cfg.dtype}' is not one of {', '.join(DTYPES)}")
    require(cfg.compile_mode in COMPILE_MODES, f"compile_mode '{cfg.compile_mode}' is not one of {', '.join(COMPILE_MODES)}")
    require(cfg.reduce_dtype in DTYPES[1:], f"reduce_dtype '{cfg.reduce_dtype}' is not one of bf16, fp16, fp32")
    require(cfg.checkpoint_type in ("full", "sharded"),
            f"checkpoint_type '{cfg.checkpoint_type}' must be 'full' or 'sharded'")
    require(0.0 <= cfg.dropout < 1.0, f"dropout must be in [0, 1), got {cfg.dropout}")
    require(cfg.fsdp_size is None or cfg.fsdp_size > 0, f"fsdp_size must be positive, got {cfg.fsdp_size}")
    require(cfg.fsdp_prefetch >= 0, f"fsdp_prefetch must be 0 or more blocks, got {cfg.fsdp_prefetch}")
    require(cfg.fsdp or not cfg.fsdp_prefetch, "fsdp_prefetch needs fsdp: true (DDP has no all-gathers to prefetch)")
    require(cfg.fsdp or cfg.fsdp_blocks_per_unit == "auto", "fsdp_blocks_per_unit needs fsdp: true (DDP has no FSDP units)")
    require(cfg.fsdp_blocks_per_unit == "auto" or (type(cfg.fsdp_blocks_per_unit) is int and cfg.fsdp_blocks_per_unit >= 1),
            f"fsdp_blocks_per_unit must be auto or 1 or more blocks, got {cfg.fsdp_blocks_per_unit!r}")
    # the experts are FSDP units of their own, which the blocks' lists would skip: their gathers
    # would wait behind the prefetched blocks'
    require(cfg.ep_size == 1 or not cfg.fsdp_prefetch, "fsdp_prefetch with ep_size > 1 is not built: use 0")
    require(cfg.cp_size >= 1, f"cp_size must be 1 or more, got {cfg.cp_size}")
    require(cfg.cp_mode in CP_MODES, f"cp_mode '{cfg.cp_mode}' is not one of {', '.join(CP_MODES)}")
    require(cfg.ep_size >= 1, f"ep_size must be 1 or more, got {cfg.ep_size}")
    require(cfg.ep_size == 1 or (cfg.fsdp and cfg.sharding_strategy in EP_STRATEGIES),
            f"ep_size={cfg.ep_size} needs FSDP with {', '.join(EP_STRATEGIES)} (DDP and NO_SHARD hold every weight "
            f"whole on every rank): ep_size must be 1 otherwise")
    require(cfg.fp8 is None or cfg.fp8 in FP8_RECIPES,
            f"fp8 '{cfg.fp8}' is not one of {', '.join(FP8_RECIPES)} (null: off)")
    require(cfg.fp8_layers in FP8_LAYERS, f"fp8_layers '{cfg.fp8_layers}' is not one of {', '.join(FP8_LAYERS)}")
    require(cfg.fp8 is not None or (cfg.fp8_layers == "auto" and not cfg.fp8_emulate),
            f"fp8_layers and fp8_emulate configure FP8 matmuls: set fp8 ({', '.join(FP8_RECIPES)})")
    require(cfg.fsdp or not cfg.cpu_offload,
            "cpu_offload: true needs fsdp: true (DDP keeps every parameter and optimizer state on the GPU)")
    require(cfg.fsdp or not cfg.force_fsdp, "force_fsdp: true needs fsdp: true (it wraps one process in FSDP2)")
    require(cfg.keep_last >= 0, f"keep_last must be 0 (keep all) or positive, got {cfg.keep_last}")
    require(cfg.optimizer in OPTIMIZERS, f"optimizer '{cfg.optimizer}' is not one of {', '.join(OPTIMIZERS)}")
    require(0.0 <= cfg.muon_momentum < 1.0, f"muon_momentum must be in [0, 1), got {cfg.muon_momentum}")
    require(cfg.optimizer == "muon" or not (cfg.normuon or cfg.cautious_weight_decay),
            "normuon and cautious_weight_decay change Muon's update: set optimizer: muon (or turn them off)")
    require(cfg.grad_clip >= 0, f"grad_clip must be 0 (no clipping) or more, got {cfg.grad_clip}")
    require(cfg.min_lr <= cfg.learning_rate,
            f"min_lr={cfg.min_lr} must not exceed learning_rate={cfg.learning_rate}")
    require(cfg.lr_schedule in LR_SCHEDULES, f"lr_schedule '{cfg.lr_schedule}' is not one of {', '.join(LR_SCHEDULES)}")
    require(0.0 <= cfg.decay_fraction <= 1.0, f"decay_fraction must be in [0, 1], got {cfg.decay_fraction}")
    require(cfg.decay_shape in DECAY_SHAPES, f"decay_shape '{cfg.decay_shape}' is not one of {', '.join(DECAY_SHAPES)}")
    if isinstance(cfg.mc_eval_path, str):
        cfg.mc_eval_path = named_paths([cfg.mc_eval_path])
    require(cfg.mc_eval_path is None or (cfg.mc_eval_path and all(
        isinstance(k, str) and isinstance(v, str) for k, v in cfg.mc_eval_path.items())),
        f"mc_eval_path must be a path or {{name: path, ...}}, got {cfg.mc_eval_path!r}")
    require(cfg.init_timeout > 0 and cfg.collective_timeout > 0,
            f"init_timeout and collective_timeout must be positive seconds, got {cfg.init_timeout} and "
            f"{cfg.collective_timeout}")
    require(cfg.straggler_ratio >= 1, f"straggler_ratio must be 1 or more, got {cfg.straggler_ratio}")
    require(cfg.spike_zscore >= 0 and cfg.spike_window >= 4,
            f"spike_zscore must be 0 (off) or more and spike_window 4 or more, got {cfg.spike_zscore} and {cfg.spike_window}")
    for name in ("profile_steps", "memory_snapshot_steps"):
        window = getattr(cfg, name)
        require(window is None or (len(window) == 2 and all(type(s) is int for s in window) and 1 <= window[0] <= window[1]),
                f"{name} must be [first, last] steps, 1 <= first <= last, got {window!r}")
    require(cfg.max_skipped_steps >= 1, f"max_skipped_steps must be 1 or more, got {cfg.max_skipped_steps}")
    require(cfg.dry_run is None or (re.fullmatch(r"[1-9]\d*[xX][1-9]\d*", cfg.dry_run) is not None),
            f"dry_run must be NODESxGPUS, each 1 or more (32x8: 32 nodes of 8 GPUs), got {cfg.dry_run!r}")
    require(cfg.dry_run_gpu in PLANNED_GPUS, f"dry_run_gpu '{cfg.dry_run_gpu}' is not one of {', '.join(PLANNED_GPUS)}")
    validate_mixture(cfg)


def check_moe(cfg: TrainConfig) -> None:
    """The mixture's keys (the families that take moe_experts: families/): gated experts (model_keys.MLPS)."""
    require(cfg.ep_size == 1 or cfg.moe_experts, f"ep_size={cfg.ep_size} splits a mixture's experts over ranks, and "
                                                 f"moe_experts: 0 is a dense model: ep_size must be 1")
    if cfg.ep_size > 1 and cfg.reduce_dtype == "fp16":
        # torch 2.13 splits an fp16 reduction's divide factor into a pre- and a post-division and, for
        # a group of one (ep_size = the shard group), divides by the whole factor again in between
        raise UserError("ep_size with reduce_dtype: fp16 is not built (experts no other rank holds would get their "
                        "gradients divided twice): use reduce_dtype fp32 or bf16")
    if not cfg.moe_experts:
        moe = [f.name for f in dataclasses.fields(cfg) if f.name.startswith("moe_") and getattr(cfg, f.name) != f.default]
        if moe:
            raise UserError(f"{', '.join(moe)} configure experts: set moe_experts (0 means a dense MLP)")
        return
    checks = ((cfg.moe_experts > 0, f"moe_experts must be 0 (dense) or more, got {cfg.moe_experts}"),
              (MLPS[cfg.mlp or cfg.family.mlp], f"MoE layers are built of gated experts "
               f"({', '.join(name for name, gated in MLPS.items() if gated)}): mlp: {cfg.mlp} has no MoE form"),
              (1 <= cfg.moe_top_k <= cfg.moe_experts, f"moe_top_k={cfg.moe_top_k} must be 1 to moe_experts={cfg.moe_experts}"),
              ((cfg.moe_hidden is None or cfg.moe_hidden > 0) and cfg.moe_shared >= 0,
               f"moe_hidden must be positive (null: ffn_hidden / moe_top_k), moe_shared 0 or more: got {cfg.moe_hidden}, "
               f"{cfg.moe_shared}"),
              (0 <= cfg.moe_dense_layers < cfg.n_layer, f"moe_dense_layers must be 0 to n_layer - 1, got {cfg.moe_dense_layers}"),
              ((cfg.moe_score or cfg.family.moe_score) in MOE_SCORES,
               f"moe_score '{cfg.moe_score}' is not one of {', '.join(MOE_SCORES)}"),
              (cfg.moe_scale > 0, f"moe_scale must be positive, got {cfg.moe_scale}"),
              (cfg.moe_groups >= 1 and cfg.moe_experts % cfg.moe_groups == 0,
               f"moe_groups={cfg.moe_groups} must divide moe_experts={cfg.moe_experts}: the groups hold equally many"),
              (cfg.moe_groups == 1 or cfg.moe_experts // cfg.moe_groups >= 2,
               f"moe_groups={cfg.moe_groups} leaves one expert a group: a group's score is its best two experts' "
               f"(DeepSeek V3's), so each needs 2 or more"),
              (1 <= cfg.moe_top_groups <= cfg.moe_groups,
               f"moe_top_groups={cfg.moe_top_groups} must be 1 to moe_groups={cfg.moe_groups}"),
              (cfg.moe_top_k <= cfg.moe_top_groups * (cfg.moe_experts // max(cfg.moe_groups, 1)),
               f"moe_top_k={cfg.moe_top_k} is more experts than moe_top_groups={cfg.moe_top_groups} groups of "
               f"{cfg.moe_experts // max(cfg.moe_groups, 1)} hold"),
              (cfg.moe_aux_loss >= 0 and cfg.moe_bias_rate >= 0, "moe_aux_loss and moe_bias_rate must be 0 (off) or more"),
              (cfg.cp_size == 1 or not cfg.moe_aux_loss, "moe_aux_loss with cp_size > 1 is not built (each rank would "
               "balance its slice of the rows): use moe_bias_rate"),
              (cfg.moe_experts % cfg.ep_size == 0, f"ep_size={cfg.ep_size} must divide moe_experts={cfg.moe_experts}: "
               f"each rank of an expert group holds moe_experts / ep_size experts"))
    for ok, message in checks:
        if not ok:
            raise UserError(message)


def check_linear(cfg: TrainConfig) -> None:
    """attn_pattern and the linear layers' keys (linear_attention.py)."""
    pattern = cfg.attn_pattern
    require(pattern is None or (isinstance(pattern, list) and pattern and all(kind in MIXER_KINDS for kind in pattern)),
            f"attn_pattern must be a list of {' and '.join(MIXER_KINDS)} (each layer's token mixer, repeated over the "
            f"layers), got {pattern}")
    linear = [layer for layer in range(cfg.n_layer) if cfg.mixer_of(layer) == "linear"]
    if not linear:
        given = [name for name in LINEAR_KEYS if getattr(cfg, name) != MODEL_FIELDS[name].default]
        one = len(given) == 1
        require(not given, f"{', '.join(given)} {'is a key' if one else 'are keys'} of the linear layers, and attn_pattern "
                           f"makes no layer linear: name some (attn_pattern: [linear, linear, linear, full], say) or "
                           f"leave {'it' if one else 'them'} out")
        return
    for name in LINEAR_KEYS:
        value = getattr(cfg, name)
        require(value is None or (type(value) is int and value > 0), f"{name} must be a positive integer, got {value!r}")
    key_heads, value_heads = cfg.linear_key_heads or cfg.n_head, cfg.linear_value_heads or cfg.linear_key_heads or cfg.n_head
    require(value_heads % key_heads == 0, f"linear_value_heads={value_heads} must be a multiple of linear_key_heads="
                                          f"{key_heads} (each key head serves value_heads / key_heads value heads)")
    require(linear[0] >= cfg.value_embeds,
            f"value_embeds={cfg.value_embeds} mixes token embeddings into attention's values, and layer "
            f"{linear[0]} is linear (attn_pattern {pattern}): value_embeds must stop before the first linear layer")


def check_latent(cfg: TrainConfig) -> None:
    """Multi-head latent attention's widths (the families whose attention is latent: DeepSeek's)."""
    if cfg.family.attention != "latent":
        return
    for key in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        require(getattr(cfg, key) > 0, f"config key '{key}' must be positive, got {getattr(cfg, key)}")
    require(cfg.qk_rope_head_dim > 0 and cfg.qk_rope_head_dim % 2 == 0,
            f"qk_rope_head_dim must be positive and even for RoPE, got {cfg.qk_rope_head_dim}")
    require(cfg.q_lora_rank is None or cfg.q_lora_rank > 0,
            f"q_lora_rank must be positive (null: one q projection), got {cfg.q_lora_rank}")
    require(not cfg.value_embeds, f"value_embeds={cfg.value_embeds} mixes embeddings into multi-head attention's v; "
                                  f"{cfg.family.name}'s attention makes v from its latent: set value_embeds: 0")


def check_window(cfg: TrainConfig) -> None:
    """sliding_window and window_pattern; the attention scale and the local RoPE base."""
    require(cfg.sliding_window is None or cfg.sliding_window > 0,
            f"sliding_window must be 1 or more tokens (null: full attention), got {cfg.sliding_window}")
    pattern = cfg.window_pattern
    if pattern is not None:
        require(isinstance(pattern, list) and pattern and all(kind in WINDOW_KINDS for kind in pattern),
                f"window_pattern must be a list of {' and '.join(WINDOW_KINDS)} (each layer's kind, repeated over the "
                f"layers), got {pattern}")
        require(cfg.sliding_window is not None, "window_pattern names local layers for sliding_window: set it")
    require(cfg.attn_scale_dim is None or cfg.attn_scale_dim > 0,
            f"attn_scale_dim must be positive (null: head_dim), got {cfg.attn_scale_dim}")
    require(cfg.rope_local_theta is None or cfg.rope_local_theta > 0,
            f"rope_local_theta must be positive (null: rope_theta), got {cfg.rope_local_theta}")
    bases = {base[0] for base in map(cfg.rope_base, range(cfg.n_layer)) if base}  # the model's rule, per layer
    if cfg.rope_local_theta is not None and "rope_local_theta" not in bases:
        # unused: a Gemma 3 checkpoint resumed without its window would move its local layers to rope_theta
        # unsaid, and local layers without positions (NoPE) take no base at all
        local = [layer for layer in range(cfg.n_layer) if cfg.window_of(layer)]
        if local:
            pattern = list(cfg.rope_pattern or cfg.family.rope_pattern)  # the family's where the key is null
            what = f"no local layer rotates (rope_pattern {pattern} leaves layers {local} without positions)"
            fix = "rotate a local layer (rope_pattern)"
        else:
            why = ("sliding_window: null" if cfg.sliding_window is None else
                   f"window_pattern {cfg.window_pattern} over {cfg.n_layer} layers")
            what, fix = f"no layer is local ({why})", "make a layer local (sliding_window, window_pattern)"
        raise UserError(f"rope_local_theta={cfg.rope_local_theta:g} is the local layers' RoPE base, and {what}: "
                        f"{fix}, or set rope_local_theta: null (every layer on rope_theta)")


def check_context_parallel(cfg: TrainConfig) -> None:
    """cp_size and cp_mode against the model (the world size is checked at launch, the device and
    dtype when the model is built): Ulysses splits every row's tokens and, for attention, the heads
    over the cp_size ranks; the ring cuts each row into 2 x cp_size chunks."""
    cp = cfg.cp_size
    piece = cfg.block_size // (cp if cfg.cp_mode == "ulysses" else 2 * cp)  # the tokens of a rank's piece of a row
    if cp > 1 and any(cfg.mixer_of(layer) == "linear" for layer in range(cfg.n_layer)) and piece < cfg.linear_conv - 1:
        raise UserError(f"cp_size={cp} ({cfg.cp_mode}) cuts rows into pieces of {piece} tokens, shorter than the "
                        f"linear layers' convolution reaches back (linear_conv - 1 = {cfg.linear_conv - 1}): use a "
                        f"longer block_size or a smaller cp_size")
    if cfg.cp_mode == "ring":
        if cfg.block_size % (2 * cp):
            raise UserError(f"cp_mode: ring needs 2 x cp_size = {2 * cp} to divide block_size={cfg.block_size}: each "
                            f"rank holds two of the row's 2 x cp_size chunks")
        if cfg.dropout:
            raise UserError(f"dropout={cfg.dropout} with cp_mode: ring is not built (the ring's flash kernels take no "
                            f"dropout): set dropout: 0.0 or cp_mode: ulysses")
        return
    for name, value in (("n_head", cfg.n_head), ("n_kv_head", cfg.n_kv_head or cfg.n_head), ("block_size", cfg.block_size)):
        if value % cp:
            raise UserError(f"cp_size={cp} must divide {name}={value}: Ulysses splits each row's tokens and "
                            f"attention's heads over cp_size ranks (cp_mode: ring has no head-count limit)")


def check_rope_scaling(scaling: dict | None, where: str) -> None:
    """Llama 3.1's scaling (rope_type llama3) and YaRN (yarn) are built, with the numbers each needs; any
    other type is refused, naming it."""
    if scaling is None:
        return
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ROPE_SCALINGS:
        raise UserError(f"{where}: RoPE scaling of type {kind!r} is not built here (only llama3, Llama 3.1's, and "
                        f"yarn)")
    needs, may = ROPE_SCALINGS[kind]
    missing = [k for k in needs if not isinstance(scaling.get(k), (int, float))]
    if missing:
        raise UserError(f"{where}: {kind} RoPE scaling needs numbers for {', '.join(missing)}")
    if unknown := sorted(set(scaling) - set(needs) - set(may) - {"rope_type", "type"}):
        raise UserError(f"{where}: {kind} RoPE scaling has no {', '.join(unknown)} (it takes {', '.join(needs + may)})")


def validate_mixture(cfg: TrainConfig) -> None:
    """data_mix names prepared folders; data_weights gives each a weight (null: all equal)."""
    if cfg.data_mix is None:
        if cfg.data_weights is not None:
            raise UserError("data_weights needs data_mix: name the sources, {name: prepared folder, ...}")
        return
    if not cfg.data_mix or not all(isinstance(k, str) and isinstance(v, str) for k, v in cfg.data_mix.items()):
        raise UserError(f"data_mix must map source names to prepared folders, {{web: data/web, ...}}, got {cfg.data_mix!r}")
    weights = {name: 1.0 for name in cfg.data_mix} if cfg.data_weights is None else cfg.data_weights
    for name, weight in weights.items():
        if name not in cfg.data_mix:
            raise UserError(f"data_weights names '{name}', which data_mix lacks (its sources: {', '.join(cfg.data_mix)})")
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight < 0:
            raise UserError(f"data_weights: {name}={weight!r} must be a number, 0 or more")
    missing = [name for name in cfg.data_mix if name not in weights]
    if missing:
        raise UserError(f"data_weights gives no weight for {', '.join(missing)}: weigh every source of data_mix")
    if not any(weights.values()):
        raise UserError("data_weights are all zero: give at least one source a positive weight")
    cfg.data_weights = {name: float(weights[name]) for name in cfg.data_mix}

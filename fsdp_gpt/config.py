"""Training configuration: dataclass defaults < YAML file < --key=value overrides.

Validated once, here; everything downstream reads typed attributes.
"""
import dataclasses
import os
import sys
import typing
from dataclasses import dataclass

import yaml

from fsdp_gpt.families import ARCHS, FAMILIES, LLAMA3_SCALING
from fsdp_gpt.model_keys import MLPS, WINDOW_KINDS, ModelKeys, key

class UserError(Exception):
    """Bad input from the user: reported as one line and exit 2, never a traceback."""


class RunStopped(Exception):
    """A run that can't go on through no fault of its input (too many non-finite steps): one line
    and exit 1, on every rank."""


def exit_code(body: typing.Callable[[], int | None], report: bool = True) -> int:
    """A command's exit code: what body returns (None: 0), or after one `error:` line (unless
    report is off) 2 when it raises UserError, 1 for RunStopped. One write: several processes may
    share the stream."""
    try:
        return body() or 0
    except (UserError, RunStopped) as e:
        if report:
            sys.stderr.write(f"error: {e}\n")
        return 2 if isinstance(e, UserError) else 1


STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
DTYPES = ("auto", "bf16", "fp16", "fp32")
OPTIMIZERS = ("adamw", "muon")
LR_SCHEDULES = ("cosine", "wsd", "constant")
DECAY_SHAPES = ("linear", "1-sqrt")
CP_MODES = ("ulysses", "ring")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
MUON_COEFFICIENTS = ("quintic", "polar_express")
MOE_SCORES = ("softmax", "sigmoid")
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearRecipeName
FP8_LAYERS = ("auto", "all")
# the strategies expert parallelism builds on: the experts sharded over what the expert groups leave
EP_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")


@dataclass
class TrainConfig(ModelKeys):
    """The model's keys (model_keys.py), then the run's. Defaults: GPT-2 small (124M) on 0.5M-token
    steps. Groups start where config_help.GROUPS says."""
    moe_bias_rate: float = key(0.0, "MoE: auxiliary-loss-free balancing, each expert's selection bias moved this much "
                                    "a step towards the mean load (DeepSeek-V3; 0: off)")
    init_from: str | None = key(None, "a Hugging Face folder (GPT-2, Llama, Qwen3 safetensors) to start from "
                                      "instead of the seed's weights")
    data_path: str = key("data/stdlib_bytes", "prepared data (train.bin, val.bin, meta.json: data.py prepare), or "
                                              "a folder of llm.c token shards")
    data_source: str | list | None = key("stdlib", "what to prepare into data_path on first use: files, folders, "
                                                   "globs, a list, or stdlib; null: prepared already")
    tokenizer: str = key("gpt2", "a tiktoken encoding (gpt2, cl100k_base, ...) or bytes; prepared data keeps its "
                                 "own")
    data_mix: dict | None = key(None, "a mixture {name: prepared folder, ...} instead of data_path and data_source "
                                      "(docs/data.md)")
    data_weights: dict | None = key(None, "the mixture's proportions {name: weight, ...}; null: equal")
    align_rows: bool = key(False, "every train row starts at a document's separator token (BOS-aligned); longer "
                                  "documents are cropped to a row")
    train_batch: int = key(480, "sequences per optimizer step, GLOBAL: split over the data-parallel ranks")
    micro_batch: int = key(12, "sequences per rank per forward; accumulation = train_batch / (micro_batch x "
                               "ranks)")
    optimizer: str = key("adamw", "adamw, or muon (Muon for the blocks' matrices, AdamW for the rest)")
    muon_momentum: float = key(0.95, "muon: momentum of the matrices (Nesterov)")
    muon_coefficients: str = key("quintic", "muon: the orthogonalisation's polynomials, quintic (Keller Jordan's) "
                                            "or polar_express (one per iteration)")
    cautious_weight_decay: bool = key(False, "muon: decay a matrix weight only where its update has the same sign")
    normuon: bool = key(False, "muon: NorMuon, each row of a matrix's update divided by its running RMS (decay "
                               "beta2), the whole at AdamW's RMS")
    learning_rate: float = key(6e-4, "peak learning rate (Muon's updates are scaled to AdamW's RMS: one rate)")
    min_lr: float = key(6e-5, "learning rate at the end of the decay")
    warmup_iters: int = key(2000, "steps of linear warmup from 0 to learning_rate")
    lr_schedule: str = key("cosine", "after warmup: cosine (down to min_lr at lr_decay_iters), wsd (the peak held, "
                                     "then a decay over the last decay_fraction of max_iters) or constant")
    lr_decay_iters: int = key(600000, "cosine: the step at which the learning rate reaches min_lr")
    decay_fraction: float = key(0.2, "wsd: the share of max_iters, at its end, that decays to min_lr")
    decay_shape: str = key("linear", "wsd: the decay's shape, linear or 1-sqrt")
    max_iters: int = key(600000, "optimizer steps of the run (a resume with more extends it)")
    weight_decay: float = key(0.1, "decoupled weight decay of matmul and embedding weights (none on norms, biases)")
    beta1: float = key(0.9, "AdamW's first-moment decay")
    beta2: float = key(0.95, "AdamW's (and NorMuon's) second-moment decay")
    grad_clip: float = key(1.0, "clip the global gradient norm to this (0: no clipping)")
    max_skipped_steps: int = key(5, "consecutive steps with a non-finite loss or gradient (skipped: nothing applied) "
                                    "after which the run stops")
    fsdp: bool = key(True, "FSDP2 (true) or DDP (false); one process runs unwrapped either way (see force_fsdp)")
    force_fsdp: bool = key(False, "wrap the model with fully_shard even in one process: FSDP2's mixed precision, "
                                  "hooks and sharded checkpoints on one device (bench/gpu_check.sh)")
    sharding_strategy: str = key("FULL_SHARD", "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or "
                                               "HYBRID_SHARD_ZERO2")
    fsdp_size: int | None = key(None, "HYBRID_SHARD: ranks per shard group, dividing the world size; null: the "
                                      "ranks of one node")
    dtype: str = key("auto", "compute dtype: auto (bf16 on GPUs that have it, else fp16 with loss scaling; fp32 on "
                             "CPU), bf16, fp16 or fp32")
    reduce_dtype: str = key("fp32", "FSDP's gradient reduction dtype (DDP reduces the gradients as they are, fp32)")
    fp8: str | None = key(None, "FP8 matmuls in the blocks' linears through torchao (docs/fp8.md): tensorwise (FSDP2 "
                                "all-gathers their weights in FP8), rowwise or rowwise_with_gw_hp; null: off. Needs "
                                "pip install -e '.[fp8]', torch 2.11+ and a GPU of sm89+ (or fp8_emulate)")
    fp8_layers: str = key("auto", "fp8: which block linears run in FP8: auto (torchao's size cut-offs for the recipe, "
                                  "where FP8 pays on an H100) or all (each whose two sizes divide by 16)")
    fp8_emulate: bool = key(False, "fp8: the FP8 casts with fp32 matmuls (torchao's emulate), on any device: slow, "
                                   "for tests and trying settings")
    cpu_offload: bool = key(False, "FSDP: parameters, gradients and optimizer state in host memory")
    fsdp_prefetch: int = key(0, "FSDP: blocks whose all-gathers each block's forward and backward start ahead (0: "
                                "FSDP2's own order, one block ahead; 1: the same overlap, issued earlier); one "
                                "process runs unwrapped without it")
    activation_checkpointing: bool = key(False, "recompute each DecoderBlock's activations in backward")
    compile: bool = key(False, "torch.compile each DecoderBlock and the LM head's chunked loss")
    compile_mode: str = key("default", "torch.compile's mode: default or max-autotune-no-cudagraphs (searches matmul "
                                       "and kernel configurations at start-up; CUDA graphs don't fit FSDP's hooks)")
    cp_size: int = key(1, "context parallelism: ranks that split each row's block_size tokens, dividing the world "
                          "size (and n_head, n_kv_head and block_size under ulysses; 2 x cp_size divides block_size "
                          "under ring)")
    cp_mode: str = key("ulysses", "how attention sees the whole row under context parallelism: ulysses (an "
                                  "all-to-all swaps tokens for heads) or ring (key/value blocks passed round the "
                                  "ranks; no head-count limit)")
    ep_size: int = key(1, "expert parallelism: ranks that split each MoE layer's experts, tokens sent to them by "
                          "all-to-all; divides moe_experts and the shard group (the world, or HYBRID_SHARD's "
                          "fsdp_size or node); FSDP's FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD(_ZERO2)")
    doc_mask: bool = key(False, "attention stops at the data's separator token between documents inside a row "
                                "(the separator opens the document after it)")
    world_size: int | None = key(None, "the launch size the config was written for: another is reported, not "
                                       "refused; null: any")
    checkpoint_dir: str = key("checkpoints", "where checkpoints go")
    checkpoint_type: str = key("full", "full (one file of plain tensors, written by rank 0) or sharded (a file per "
                                       "rank)")
    save_interval: int = key(1000, "steps between checkpoints; one is also written after the last step")
    keep_last: int = key(0, "after each save, remove all but the newest N checkpoints up to it (0: keep all)")
    async_save: bool = key(False, "write checkpoints in a background thread while training goes on")
    resume_from: str | None = key(None, "a checkpoint file, a rank file or {rank} pattern, or latest (none yet: "
                                        "start fresh)")
    log_interval: int = key(10, "steps between console lines and train/ scalars")
    eval_interval: int = key(500, "steps between val/loss evaluations (also at step 0 and after the last)")
    eval_iters: int = key(20, "val/loss covers the first eval_iters x train_batch windows of val.bin")
    mc_eval_path: str | dict | None = key(None, "multiple-choice files scored at every eval (eval/{name}/acc, "
                                                "acc_norm): a path, or {name: path, ...}; HellaSwag's jsonl, "
                                                "{context, choices, label} jsonl or llm.c's .bin")
    sample_tokens: int = key(64, "tokens of text sampled at each eval into TensorBoard (0: none)")
    tensorboard_dir: str = key("tensorboard", "where TensorBoard events go")
    seed: int = key(1337, "initial weights, the data order and dropout masks follow from it")
    straggler_ratio: float = key(1.2, "a log line names the slowest rank when its own time per step (data + "
                                      "compute) is this many times the median rank's")
    spike_zscore: float = key(6.0, "a step whose loss is this many standard deviations above the mean of the last "
                                   "spike_window steps is a spike: named, counted in train/spikes (0: off)")
    spike_window: int = key(100, "steps of loss history a spike is judged against")
    spike_skip: bool = key(False, "skip a spike's update on every rank, as a non-finite step is (not with fp16)")
    profile_steps: list | None = key(None, "[first, last]: torch.profiler traces of these steps, one per rank, into "
                                           "{tensorboard_dir}/profile/")
    memory_snapshot_steps: list | None = key(None, "[first, last]: CUDA's allocator history over these steps, a "
                                                   "snapshot per rank into {tensorboard_dir}/profile/")
    wandb_project: str | None = key(None, "also log to this Weights & Biases project (pip install wandb; rank 0)")
    wandb_entity: str | None = key(None, "the wandb team or user; null: wandb's default")
    wandb_name: str | None = key(None, "the wandb run's display name; null: wandb's")
    init_timeout: float = key(900.0, "seconds start-up (after data preparation), the first step (compilation), "
                                     "each eval and each save may take before the run stops as hung "
                                     "(docs/reliability.md)")
    collective_timeout: float = key(300.0, "seconds any other training step, its collectives included, may take "
                                           "before the run stops as hung, naming the ranks that did not arrive")

    def due(self, step: int, interval: int) -> bool:
        """Whether an every-`interval`-steps event (a log line, an eval, a save) falls on `step`: the
        last step has each."""
        return step % interval == 0 or step == self.max_iters


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
def named_paths(paths: list[str]) -> dict[str, str]:
    """Files named as their logs are (eval/{name}/acc): each file's name up to its first dot."""
    return {os.path.basename(path).split(".")[0]: path for path in paths}


def require(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


def validate(cfg: TrainConfig) -> None:
    """Checks that need no knowledge of the launch (world size checks live with the mesh). With
    init_from, the model's keys are the folder's: validate_run when the config is read, validate_model
    once the folder has set them (hf_format.define_model)."""
    validate_run(cfg)
    validate_model(cfg)


def validate_model(cfg: TrainConfig) -> None:
    """The model's keys, and the others' checks that read them."""
    for key in ("n_layer", "n_head", "n_embd"):
        require(getattr(cfg, key) > 0, f"config key '{key}' must be positive, got {getattr(cfg, key)}")
    require(cfg.arch in ARCHS, f"arch '{cfg.arch}' is not one of {', '.join(ARCHS)}")
    for key, value in cfg.foreign_keys().items():  # e.g. qk_norm with GPT-2's layout
        archs = dict.fromkeys(family.arch for family in FAMILIES if key in family.takes)
        raise UserError(f"{key}={value} needs arch: {' or '.join(archs)} ({cfg.family.name} takes no {key})")
    require(cfg.head_dim is not None or cfg.n_embd % cfg.n_head == 0,
            f"n_head={cfg.n_head} must divide n_embd={cfg.n_embd}: pick n_embd as a multiple of n_head")
    require(cfg.head_dim is None or cfg.head_dim > 0, f"head_dim must be positive, got {cfg.head_dim}")
    require(cfg.n_kv_head is None or (cfg.n_kv_head > 0 and cfg.n_head % cfg.n_kv_head == 0),
            f"n_kv_head={cfg.n_kv_head} must divide n_head={cfg.n_head} (each key/value head serves "
            f"n_head / n_kv_head query heads)")
    head_dim = cfg.head_dim or cfg.n_embd // cfg.n_head
    require(cfg.family.positions != "rope" or head_dim % 2 == 0,
            f"head dimension {'n_embd / n_head = ' * (cfg.head_dim is None)}{head_dim} must be even for RoPE")
    require(cfg.rope_theta > 0, f"rope_theta must be positive, got {cfg.rope_theta}")
    check_rope_scaling(cfg.rope_scaling, "rope_scaling")
    require(cfg.ffn_hidden is None or cfg.ffn_hidden > 0, f"ffn_hidden must be positive, got {cfg.ffn_hidden}")
    require(0 <= cfg.value_embeds <= cfg.n_layer, f"value_embeds must be 0 to n_layer={cfg.n_layer}, got {cfg.value_embeds}")
    require(cfg.mlp is None or cfg.mlp in MLPS, f"mlp '{cfg.mlp}' is not one of {', '.join(MLPS)}")
    check_window(cfg)
    require(cfg.logit_softcap is None or cfg.logit_softcap > 0,
            f"logit_softcap must be positive (or null: off), got {cfg.logit_softcap}")
    # each block starts the gathers of the ones after it: a depth past the last block would say more
    # than the run does (init_from's folder sets n_layer, so this waits for the model's keys)
    require(cfg.fsdp_prefetch < max(cfg.n_layer, 2),
            f"fsdp_prefetch={cfg.fsdp_prefetch} reaches past the model's {cfg.n_layer} blocks: at most "
            f"{max(cfg.n_layer - 1, 1)} (each block prefetches the blocks after it)")
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
    validate_mixture(cfg)


def check_moe(cfg: TrainConfig) -> None:
    """The mixture's keys (the families that take moe_experts: families.py): SwiGLU experts."""
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
              ((cfg.mlp or cfg.family.mlp) == "swiglu", f"MoE layers are built of SwiGLU experts: mlp: {cfg.mlp} "
               f"has no MoE form"),
              (1 <= cfg.moe_top_k <= cfg.moe_experts, f"moe_top_k={cfg.moe_top_k} must be 1 to moe_experts={cfg.moe_experts}"),
              ((cfg.moe_hidden is None or cfg.moe_hidden > 0) and cfg.moe_shared >= 0,
               f"moe_hidden must be positive (null: ffn_hidden / moe_top_k), moe_shared 0 or more: got {cfg.moe_hidden}, "
               f"{cfg.moe_shared}"),
              (0 <= cfg.moe_dense_layers < cfg.n_layer, f"moe_dense_layers must be 0 to n_layer - 1, got {cfg.moe_dense_layers}"),
              (cfg.moe_score in MOE_SCORES, f"moe_score '{cfg.moe_score}' is not one of {', '.join(MOE_SCORES)}"),
              (cfg.moe_aux_loss >= 0 and cfg.moe_bias_rate >= 0, "moe_aux_loss and moe_bias_rate must be 0 (off) or more"),
              (cfg.cp_size == 1 or not cfg.moe_aux_loss, "moe_aux_loss with cp_size > 1 is not built (each rank would "
               "balance its slice of the rows): use moe_bias_rate"),
              (cfg.moe_experts % cfg.ep_size == 0, f"ep_size={cfg.ep_size} must divide moe_experts={cfg.moe_experts}: "
               f"each rank of an expert group holds moe_experts / ep_size experts"))
    for ok, message in checks:
        if not ok:
            raise UserError(message)


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


def check_context_parallel(cfg: TrainConfig) -> None:
    """cp_size and cp_mode against the model (the world size is checked at launch, the device and
    dtype when the model is built): Ulysses splits every row's tokens and, for attention, the heads
    over the cp_size ranks; the ring cuts each row into 2 x cp_size chunks."""
    cp = cfg.cp_size
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
    """Llama 3.1's scaling (rope_type llama3) is built; any other type is refused, naming it."""
    if scaling is None:
        return
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise UserError(f"{where}: RoPE scaling of type {kind!r} is not built here (only llama3, Llama 3.1's)")
    missing = [k for k in LLAMA3_SCALING if not isinstance(scaling.get(k), (int, float))]
    if missing:
        raise UserError(f"{where}: llama3 RoPE scaling needs numbers for {', '.join(missing)}")


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


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)

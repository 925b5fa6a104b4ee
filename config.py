"""Training configuration: dataclass defaults < YAML file < --key=value overrides.

Validated once, here; everything downstream reads typed attributes.
"""
import dataclasses
import difflib
import os
import sys
import typing
from dataclasses import dataclass

import yaml


class UserError(Exception):
    """Bad input from the user: reported as one line and a non-zero exit, never a traceback."""


def exit_code(body: typing.Callable[[], int | None]) -> int:
    """A command's exit code: what body returns (None: 0), or 2 after one `error:` line when it
    raises UserError. One write: the ranks of a run may share the stream."""
    try:
        return body() or 0
    except UserError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2


STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
DTYPES = ("auto", "bf16", "fp16", "fp32")
OPTIMIZERS = ("adamw", "muon")
# arch first: a checkpoint of the other layout is reported as that, not as its first consequence (bias)
MODEL_SHAPE_KEYS = ("arch", "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "bias", "n_kv_head",
                    "rope_theta", "qk_norm", "tie_embeddings", "ffn_hidden", "norm_eps")
ARCHS = ("gpt2", "llama")


@dataclass
class TrainConfig:
    # model (defaults: GPT-2 small)
    vocab_size: int | None = None  # None: the tokenizer's vocabulary rounded up to a multiple of 64
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # gpt2 only: llama has none
    arch: str = "gpt2"  # or llama: RMSNorm, RoPE, SwiGLU, grouped-query attention (model.py)
    n_kv_head: int | None = None  # llama: key/value heads; None: n_head
    rope_theta: float = 10000.0
    qk_norm: bool = False  # llama: RMSNorm of q and k per head (Qwen3)
    tie_embeddings: bool | None = None  # None: tied for gpt2, untied for llama
    ffn_hidden: int | None = None  # MLP width; None: 4 n_embd (gpt2), 8/3 n_embd rounded up to 256 (llama)
    norm_eps: float = 1e-5
    init_from: str | None = None  # a Hugging Face folder (GPT-2, Llama, Qwen3 safetensors) to start from
    # data
    data_path: str = "data/stdlib_bytes"
    data_source: str | list | None = "stdlib"
    tokenizer: str = "gpt2"
    # batch: train_batch is GLOBAL sequences per optimizer step
    train_batch: int = 480
    micro_batch: int = 12
    # optimizer and schedule (steps count from 1)
    optimizer: str = "adamw"  # muon: Muon for the blocks' matrices, AdamW for the rest (muon.py)
    muon_momentum: float = 0.95
    learning_rate: float = 6e-4
    min_lr: float = 6e-5
    warmup_iters: int = 2000
    lr_decay_iters: int = 600000
    max_iters: int = 600000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # fsdp
    fsdp: bool = True
    sharding_strategy: str = "FULL_SHARD"
    fsdp_size: int | None = None  # HYBRID group size; None: the ranks of one node
    dtype: str = "auto"
    reduce_dtype: str = "fp32"
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    compile: bool = False
    world_size: int | None = None
    # checkpoints
    checkpoint_dir: str = "checkpoints"
    checkpoint_type: str = "full"
    save_interval: int = 1000
    keep_last: int = 0  # 0 keeps every checkpoint
    async_save: bool = False
    resume_from: str | None = None  # a checkpoint file, a {rank} pattern, or "latest"
    # logging
    log_interval: int = 10
    eval_interval: int = 500
    eval_iters: int = 20  # val/loss covers eval_iters * train_batch sequences
    sample_tokens: int = 64  # text sampled at each eval, shown in TensorBoard (0: none)
    tensorboard_dir: str = "tensorboard"
    seed: int = 1337

    @property
    def model_shape(self) -> dict:
        return {k: getattr(self, k) for k in MODEL_SHAPE_KEYS}


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _parse_cli_value(text: str):
    """Read a command-line value as a user means it: 3e-3 is a float, null is None."""
    value = yaml.safe_load(text) if text != "" else ""
    if isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads '3e-3' as a string
        except ValueError:
            pass
    return value


def _coerce(key: str, value, where: str):
    allowed = typing.get_args(FIELDS[key].type) or (FIELDS[key].type,)
    if value is None and type(None) in allowed:
        return None
    if isinstance(value, str) and float in allowed:
        try:
            value = float(value)
        except ValueError:
            pass
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, float) and int in allowed and value.is_integer() and float not in allowed:
        return int(value)
    for t in allowed:
        if t is not type(None) and type(value) is t:
            return value
    names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
    raise UserError(f"config key '{key}' ({where}) must be {names}, got {value!r}")


def _check_key(key: str, where: str):
    if key not in FIELDS:
        near = difflib.get_close_matches(key, FIELDS, n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise UserError(f"unknown config key '{key}' ({where}){hint}")


def parse_args(argv: list[str]) -> TrainConfig:
    """argv: CONFIG.yaml followed by --key=value or --key value overrides (last one wins)."""
    if not argv or argv[0].startswith("--"):
        raise UserError("usage: train_fsdp.py CONFIG.yaml [--key=value ...]")
    path, rest = argv[0], argv[1:]
    if not os.path.isfile(path):
        raise UserError(f"config file not found: {path}")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise UserError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}")
    if not isinstance(raw, dict):
        raise UserError(f"config file {path} must be a mapping of key: value")
    values = {}
    for key, value in raw.items():
        _check_key(str(key), f"in {path}")
        values[key] = _coerce(key, value, f"in {path}")
    i = 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--"):
            raise UserError(f"unexpected argument '{arg}': overrides look like --key=value")
        key, eq, text = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(rest):
                raise UserError(f"override --{key} needs a value: --{key}=VALUE")
            i, text = i + 1, rest[i + 1]
        _check_key(key, f"from --{key}")
        values[key] = _coerce(key, _parse_cli_value(text), f"from --{key}")
        i += 1
    cfg = TrainConfig(**values)
    validate(cfg)
    return cfg


def validate(cfg: TrainConfig) -> None:
    """Checks that need no knowledge of the launch (world size checks live with the mesh)."""
    def require(ok: bool, message: str):
        if not ok:
            raise UserError(message)

    for key in ("block_size", "n_layer", "n_head", "n_embd", "train_batch", "micro_batch",
                "log_interval", "eval_interval", "eval_iters", "save_interval"):
        require(getattr(cfg, key) > 0, f"config key '{key}' must be positive, got {getattr(cfg, key)}")
    require(cfg.max_iters >= 0, f"max_iters must be 0 or more, got {cfg.max_iters}")
    require(cfg.sample_tokens >= 0, f"sample_tokens must be 0 or more, got {cfg.sample_tokens}")
    require(cfg.n_embd % cfg.n_head == 0,
            f"n_head={cfg.n_head} must divide n_embd={cfg.n_embd}: pick n_embd as a multiple of n_head")
    require(cfg.arch in ARCHS, f"arch '{cfg.arch}' is not one of {', '.join(ARCHS)}")
    if cfg.arch == "gpt2":
        require(cfg.n_kv_head in (None, cfg.n_head) and not cfg.qk_norm and cfg.tie_embeddings in (None, True),
                "n_kv_head, qk_norm and tie_embeddings: false need arch: llama (GPT-2 has none of them)")
    else:
        require(cfg.n_kv_head is None or (cfg.n_kv_head > 0 and cfg.n_head % cfg.n_kv_head == 0),
                f"n_kv_head={cfg.n_kv_head} must divide n_head={cfg.n_head} (each key/value head serves "
                f"n_head / n_kv_head query heads)")
        require((cfg.n_embd // cfg.n_head) % 2 == 0,
                f"head dimension n_embd / n_head = {cfg.n_embd // cfg.n_head} must be even for RoPE")
    require(cfg.rope_theta > 0, f"rope_theta must be positive, got {cfg.rope_theta}")
    require(cfg.ffn_hidden is None or cfg.ffn_hidden > 0, f"ffn_hidden must be positive, got {cfg.ffn_hidden}")
    if cfg.tie_embeddings is None:
        cfg.tie_embeddings = cfg.arch == "gpt2"
    require(cfg.train_batch % cfg.micro_batch == 0,
            f"micro_batch={cfg.micro_batch} must divide train_batch={cfg.train_batch}")
    require(cfg.sharding_strategy in STRATEGIES,
            f"sharding_strategy '{cfg.sharding_strategy}' is not one of {', '.join(STRATEGIES)}")
    require(cfg.dtype in DTYPES, f"dtype '{cfg.dtype}' is not one of {', '.join(DTYPES)}")
    require(cfg.reduce_dtype in DTYPES[1:], f"reduce_dtype '{cfg.reduce_dtype}' is not one of bf16, fp16, fp32")
    require(cfg.checkpoint_type in ("full", "sharded"),
            f"checkpoint_type '{cfg.checkpoint_type}' must be 'full' or 'sharded'")
    require(0.0 <= cfg.dropout < 1.0, f"dropout must be in [0, 1), got {cfg.dropout}")
    require(cfg.fsdp_size is None or cfg.fsdp_size > 0, f"fsdp_size must be positive, got {cfg.fsdp_size}")
    require(cfg.fsdp or not cfg.cpu_offload,
            "cpu_offload: true needs fsdp: true (DDP keeps every parameter and optimizer state on the GPU)")
    require(cfg.keep_last >= 0, f"keep_last must be 0 (keep all) or positive, got {cfg.keep_last}")
    require(cfg.optimizer in OPTIMIZERS, f"optimizer '{cfg.optimizer}' is not one of {', '.join(OPTIMIZERS)}")
    require(0.0 <= cfg.muon_momentum < 1.0, f"muon_momentum must be in [0, 1), got {cfg.muon_momentum}")
    require(cfg.min_lr <= cfg.learning_rate,
            f"min_lr={cfg.min_lr} must not exceed learning_rate={cfg.learning_rate}")


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)

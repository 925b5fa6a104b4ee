"""Training configuration: dataclass defaults < YAML file < --key=value overrides.

Validated once (config_checks.py); everything downstream reads typed attributes.
"""
import dataclasses
import os
import sys
import typing
from dataclasses import dataclass

import yaml

from fsdp_gpt.model_keys import ModelKeys, key

class UserError(Exception):
    """Bad input from the user: reported as one line and exit 2, never a traceback."""


def in_one_line(error: BaseException) -> str:
    """A library's own words for an error, on one line: its first line whole (often the only clue: torch's
    zip reader names the record it failed on past 120 characters), or its type where it says nothing."""
    return str(error).splitlines()[0] if str(error).strip() else type(error).__name__


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
PLANNED_GPUS = ("H100", "H200", "A100")  # what a dry run plans for: distributed/gpus.py


@dataclass
class TrainConfig(ModelKeys):
    """The model's keys (model_keys.py), then the run's. Defaults: GPT-2 small (124M) on 0.5M-token
    steps. Groups start where config_help.GROUPS says."""
    moe_bias_rate: float = key(0.0, "MoE: auxiliary-loss-free balancing, each expert's selection bias moved this much "
                                    "a step towards the mean load (DeepSeek-V3; 0: off)")
    init_from: str | None = key(None, "a Hugging Face folder of a family's class (docs/families.md) to start from "
                                      "instead of the seed's weights: it defines the model")
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
    fsdp_prefetch: int = key(0, "FSDP: units whose all-gathers each unit's forward and backward start ahead (0: "
                                "FSDP2's own order, one unit ahead; 1: the same overlap, issued earlier); one "
                                "process runs unwrapped without it; none where the whole model is one unit")
    fsdp_blocks_per_unit: int | str = key("auto", "FSDP: consecutive DecoderBlocks sharded as one unit (one set of "
                                                  "FSDP2's hooks and collectives each): auto (the fewest blocks whose "
                                                  "compute covers FSDP2's fixed cost per unit; the whole model one "
                                                  "unit where blocks are tiny) or a number")
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
    resume_from: str | None = key(None, "a checkpoint file, a sharded set's rank file, {rank} pattern or .complete "
                                        "marker, or latest (none yet: start fresh)")
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
    spike_zscore: float = key(6.0, "a step whose loss lies this many noise levels above the median of the losses "
                                   "just before it is a spike (the noise: the median absolute deviation of the "
                                   "step-to-step changes over spike_window steps, scaled as a standard deviation; "
                                   "observe/spikes.py): named, counted in train/spikes (0: off)")
    spike_window: int = key(100, "steps of loss history whose changes measure the noise a spike is judged against")
    spike_skip: bool = key(False, "skip a spike's update on every rank, as a non-finite step is (not with fp16)")
    profile_steps: list | None = key(None, "[first, last]: torch.profiler traces of these steps, one per rank, into "
                                           "{tensorboard_dir}/profile/")
    memory_snapshot_steps: list | None = key(None, "[first, last]: CUDA's allocator history over these steps, a "
                                                   "snapshot per rank into {tensorboard_dir}/profile/")
    wandb_project: str | None = key(None, "also log to this Weights & Biases project (pip install wandb; rank 0)")
    wandb_entity: str | None = key(None, "the wandb team or user; null: wandb's default")
    wandb_name: str | None = key(None, "the wandb run's display name; null: wandb's")
    init_timeout: float = key(900.0, "seconds start-up (after data preparation), each eval, each save and a "
                                     "compiled run's first step (compilation) may take before the run stops as hung "
                                     "(docs/reliability.md)")
    collective_timeout: float = key(300.0, "seconds any other training step, its collectives included, may take "
                                           "before the run stops as hung, naming the ranks that did not arrive")
    dry_run: str | None = key(None, "NODESxGPUS (e.g. 32x8): no training, a plan of the run at that many ranks (start-up "
                                    "and one step as rank 0 runs them, on a fake process group and fake tensors, in "
                                    "this one CPU process: docs/scale_plan.md); null: train")
    dry_run_out: str | None = key(None, "where the dry run writes its plan as JSON; null: {checkpoint_dir}/plan.json")
    dry_run_gpu: str = key("H100", "the GPU the dry run plans for (the compute dtype auto takes, FP8, the units' auto "
                                   "layout, its memory, peak FLOP/s and links): H100, H200 or A100")

    def dry_run_world(self) -> tuple[int, int]:
        """dry_run as (nodes, GPUs a node)."""
        nodes, gpus = self.dry_run.lower().split("x")
        return int(nodes), int(gpus)

    def due(self, step: int, interval: int) -> bool:
        """Whether an every-`interval`-steps event (a log line, an eval, a save) falls on `step`: the
        last step has each."""
        return step % interval == 0 or step == self.max_iters


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def named_paths(paths: list[str]) -> dict[str, str]:
    """Files named as their logs are (eval/{name}/acc): each file's name up to its first dot."""
    return {os.path.basename(path).split(".")[0]: path for path in paths}


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)

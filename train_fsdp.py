"""Pretrain a GPT with FSDP2.  python train_fsdp.py CONFIG.yaml [--key=value ...]  (or under torchrun)
python train_fsdp.py --help lists every config key with its type, default and meaning.

Order of work: config -> process group and mesh -> data -> model on the meta device -> FP8 linears ->
activation checkpointing -> compile -> fully_shard per unit of blocks, then the root ->
weights initialised on rank 0 and broadcast into the shards -> optimizer -> resume -> loop.
Each concern lives in the package (docs/architecture.md has the map); this file is the order.
"""
import dataclasses
import math
import sys

import torch
import torch.distributed as dist

from fsdp_gpt.checkpoint.fsdp_ckpt import CheckpointManager, saved_files
from fsdp_gpt.checkpoint.run_state import RunState
from fsdp_gpt.config import UserError, to_yaml
from fsdp_gpt.config_parse import parse_args
from fsdp_gpt.config_help import help_text
from fsdp_gpt.data.loader import BatchLoader
from fsdp_gpt.data.prepare import prepare_sources
from fsdp_gpt.data.run_data import open_loader, settle_data
from fsdp_gpt.distributed.context_parallel import swaps_attention
from fsdp_gpt.distributed.float8 import Float8Scales, check_fp8
from fsdp_gpt.distributed.launch import Topology, agree, init_distributed, run_entry_point
from fsdp_gpt.distributed.parallelize import build_model, forward_context, micro_steps
from fsdp_gpt.distributed.shards import full_tensor
from fsdp_gpt.distributed.precision import check_offload, compute_dtype
from fsdp_gpt.distributed.replicated import gradient_reduction
from fsdp_gpt.evaluation.in_training import evaluate, load_mc_sets
from fsdp_gpt.hf_format import define_model
from fsdp_gpt.model import GPTConfig
from fsdp_gpt.observe.metrics import ProgressLog, per_rank_stats
from fsdp_gpt.observe.profiling import Profiling
from fsdp_gpt.observe.spikes import check_skip
from fsdp_gpt.observe.step_times import StepTimes
from fsdp_gpt.optim.build import build_optimizer
from fsdp_gpt.optim.clip import clip_gradients
from fsdp_gpt.optim.expert_balance import ExpertBalance
from fsdp_gpt.optim.schedule import lr_at
from fsdp_gpt.resilience.guard import NonFiniteGuard
from fsdp_gpt.resilience.stop import StopRequest
from fsdp_gpt.resilience.watchdog import Watchdog, process_group_timeout


def accumulation_steps(cfg, topo: Topology) -> int:
    """Micro-steps per optimizer step: train_batch rows are global, shared by the data-parallel ranks."""
    dp = topo.dp_size
    if cfg.train_batch % (cfg.micro_batch * dp):
        shares = (f"{dp} data-parallel shares ({topo.world_size} ranks / cp_size {cfg.cp_size})" if cfg.cp_size > 1
                  else f"{topo.world_size} ranks")
        raise UserError(f"train_batch={cfg.train_batch} must be a multiple of micro_batch={cfg.micro_batch} "
                        f"x {shares} = {cfg.micro_batch * dp}")
    return cfg.train_batch // (cfg.micro_batch * dp)


def describe_run(cfg, topo: Topology, accum_steps: int, dtype: torch.dtype) -> None:
    """The resolved config and the run's layout, printed once by rank 0."""
    print(to_yaml(cfg), end="")
    describe_layout(cfg, topo, accum_steps, dtype)


def describe_layout(cfg, topo: Topology, accum_steps: int, dtype: torch.dtype) -> None:
    """The run's layout: ranks, strategy and mesh, context and expert parallelism, accumulation, dtype."""
    world = topo.world_size
    if cfg.world_size not in (None, world):
        print(f"note: config written for world_size={cfg.world_size}, launched with {world} ranks; "
              f"train_batch={cfg.train_batch} stays global, so accumulation is now {accum_steps} micro-steps")
    context = (f"context parallel {cfg.cp_size} ({cfg.cp_mode}, each row over {cfg.cp_size} ranks), "
               if swaps_attention(cfg.cp_mode, cfg.cp_size) else "")
    print(f"{world} ranks, {cfg.sharding_strategy if cfg.fsdp else 'DDP'}, mesh {topo.describe_mesh()}, {context}"
          f"{f'expert parallel {cfg.ep_size} ({cfg.moe_experts // cfg.ep_size} experts a rank), ' if cfg.ep_size > 1 else ''}"
          f"{'model not wrapped (one process: nothing to shard), ' if topo.wrap == 'none' else ''}"
          f"gradient accumulation {accum_steps}, compute dtype {dtype}", flush=True)


def seed_device(seed: int, device: torch.device) -> None:
    """Seed the generator the device's random ops (dropout) draw from. Not torch.manual_seed: where
    CUDA (or XPU, MTIA) is not initialised, it queues a seeding for later with the caller's formatted
    stack, three per call: 0.5 ms a step on the CPU and a queue that grew without end."""
    (torch.cuda.manual_seed if device.type == "cuda" else torch.default_generator.manual_seed)(seed)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def forward_backward(model, loader: BatchLoader, step: int, accum_steps: int, times: StepTimes, compute,
                     scaler, set_micro_step) -> torch.Tensor:
    """The step's micro-batches forward and backward, gradients reduced on the last one only
    (set_micro_step: parallelize.micro_steps; the vectors FSDP2 leaves whole after it, by the loop's
    reduce_whole_grads); the global batch's mean loss (every rank's share all-reduced: every rank
    judges it alike)."""
    loss_sum = torch.zeros((), device=loader.device)
    for micro_step, (x, y, opens) in enumerate(times.batches(loader.micro_batches(step))):
        set_micro_step(model, micro_step == accum_steps - 1)
        with compute():
            _, loss = model(x, y, positions=loader.positions, opens=opens)  # opens: doc_mask's documents
        scaler.scale(loss / accum_steps).backward()
        loss_sum += loss.detach()
    world = dist.get_world_size()
    if world > 1:
        dist.all_reduce(loss_sum)
    return loss_sum / (accum_steps * world)


def launch_checks(cfg, topo: Topology) -> tuple[int, torch.dtype]:
    """Start-up's checks once the process group exists (a dry run's too): a folder's model, the batch's split,
    the compute dtype and what it allows. Returns the micro-steps a step and the dtype."""
    if cfg.init_from:  # the folder defines the model (and the tokenizer, unless one is named)
        notes = agree(lambda: define_model(cfg))
        for note in notes if topo.is_main else []:
            print(f"note: {note}", flush=True)
    accum_steps = accumulation_steps(cfg, topo)
    dtype = compute_dtype(cfg.dtype, topo.chip)
    check_offload(dtype, cfg.cpu_offload)
    check_skip(cfg, dtype)
    check_fp8(cfg, topo.chip)
    return accum_steps, dtype


def train(cfg) -> int:
    if cfg.dry_run:  # a plan of the run at that size, nothing trained
        return dry_run(cfg)
    stop = StopRequest()  # first: a preemption or Ctrl-C during start-up still ends with a checkpoint
    topo = init_distributed(cfg)
    accum_steps, dtype = launch_checks(cfg, topo)
    # each rank reads the data itself (node-local disks): a failure on one stops every rank
    sources = agree(lambda: prepare_sources(cfg.data_mix, cfg.data_path, cfg.data_source, cfg.tokenizer))
    watchdog = Watchdog(topo, cfg)  # data preparation, which may take hours, is not bounded
    try:  # closed however the run ends: left armed in a process that goes on (tests), it would end it later
        return train_watched(cfg, topo, stop, watchdog, sources, accum_steps, dtype)
    finally:
        watchdog.close()


def train_watched(cfg, topo: Topology, stop: StopRequest, watchdog: Watchdog, sources: dict, accum_steps: int,
                  dtype: torch.dtype) -> int:
    """train() from the data on, each phase bounded by the watchdog: start-up, the resume, the steps,
    evals and saves, the last save."""
    rank, device = topo.rank, topo.device
    watchdog.arm("start-up")
    tokenizer = settle_data(cfg, sources, topo)
    mc_sets = load_mc_sets(cfg, topo)
    if topo.is_main:
        describe_run(cfg, topo, accum_steps, dtype)
        print(watchdog.bounds(), flush=True)
    model = build_model(cfg, GPTConfig.of(cfg), topo)
    gpt = getattr(model, "module", model)  # the GPT under a DDP wrapper; FSDP2 keeps the module itself
    optimizer = build_optimizer(cfg, gpt, device)
    ckpt = CheckpointManager(cfg, topo)
    watchdog.arm("the resume")
    step = ckpt.resume(cfg.resume_from, model, optimizer)
    loader = open_loader(cfg, sources, topo, step)
    fp8_scales = Float8Scales(gpt)  # the FP8-gathered weights' scales, after each optimizer step
    kept = RunState.of(cfg, loader, gpt, device)  # what every checkpoint keeps beside the weights
    ckpt.keep(**vars(kept))
    spikes, balance, wandb_run = kept.spikes, kept.moe, kept.wandb_run_id
    log = agree(lambda: ProgressLog(topo.is_main, cfg, cfg.train_batch * cfg.block_size, gpt.flops_per_token(), device,
                                    dtype, topo.world_size, resumed_at=step, wandb_id=wandb_run.id))
    times = StepTimes(device)
    profiling = Profiling(cfg, rank, device, watchdog.arm)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    guard = NonFiniteGuard(device, cfg.max_skipped_steps)
    compute = forward_context(cfg, topo)
    set_micro_step = micro_steps(cfg, model)
    reduce_whole_grads = gradient_reduction(model, topo)  # the vectors FSDP2 leaves whole
    if step == 0:
        watchdog.arm("the eval at step 0")
        log.val(0, *evaluate(model, gpt, loader, cfg, tokenizer, mc_sets, compute))
    log.start(step)
    first_step = step + 1
    stop.listen(process_group_timeout(cfg))
    with profiling.out_of_memory_snapshot():
        while step < cfg.max_iters:
            step += 1
            watchdog.arm_step(step, first=step == first_step)
            profiling.begin(step)
            times.begin()
            lr = set_lr(optimizer, lr_at(cfg, step))
            seed_device(cfg.seed + 1_000_003 * step + rank, device)  # dropout masks: a function of (step, rank)
            loss = forward_backward(model, loader, step, accum_steps, times, compute, scaler, set_micro_step)
            reduce_whole_grads()
            spike = spikes.check(step, loss)
            scaler.unscale_(optimizer)
            grad_norm = clip_gradients(model, cfg.grad_clip or math.inf)
            # a non-finite step (and with spike_skip, a spike): every rank skips the update
            guard.check(step, grad_norm, optimizer, scaler, spike if cfg.spike_skip else None)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            fp8_scales.step()
            balance.step()
            times.end()
            profiling.end(step)
            if cfg.due(step, cfg.log_interval):
                log.train(step, loss.item(), lr, full_tensor(grad_norm).item(), per_rank_stats(model, optimizer, device, times.row()),
                          guard.skipped_steps(), loader.scalars(step) | balance.scalars(), spikes.since_last_log(),
                          spikes.total())
                guard.stop_if_too_many(loader.position(step), ckpt.finished)
            if request := stop.agreed():
                # the checkpoint first, no eval or text sample: the grace period before SIGKILL is short
                watchdog.arm(f"the save of step {step}")
                ckpt.save(step, model, optimizer)
                if topo.is_main:
                    print(f"{request}: stopped after step {step} with its checkpoint saved", flush=True)
                break
            if cfg.due(step, cfg.eval_interval):
                watchdog.arm(f"the eval at step {step}")
                log.val(step, *evaluate(model, gpt, loader, cfg, tokenizer, mc_sets, compute))
                log.start(step)  # tokens/s and ETA count training time only
            if cfg.due(step, cfg.save_interval):
                watchdog.arm(f"the save of step {step}")
                ckpt.save(step, model, optimizer)
                log.start(step)
    profiling.close()
    watchdog.arm("the last save")
    ckpt.close()
    log.close(per_rank_stats(model, optimizer, device))
    code = stop.close()
    if topo.is_main:
        print(f"done: last checkpoint {ckpt.last_saved}, TensorBoard logs in {cfg.tensorboard_dir}/", flush=True)
    return code


def dry_run(cfg) -> int:
    """--dry_run=NODESxGPUS: this file's start-up and a step as rank 0 of that world runs them, in this one
    process, on a fake process group and fake tensors (observe/plan.py); the plan printed and written."""
    from fsdp_gpt.observe.plan import DryRun  # here: torch's memory tracker takes 2 s to import, a run's start-up
    topo = init_distributed(cfg)
    accum_steps, dtype = launch_checks(cfg, topo)
    plan = DryRun(cfg, topo, accum_steps)
    describe_layout(cfg, topo, accum_steps, dtype)
    with plan.start_up():  # its lines kept for the plan
        model = build_model(dataclasses.replace(cfg, compile=False), GPTConfig.of(cfg), topo, fake=plan.fake)
    gpt = getattr(model, "module", model)
    with plan.fake:
        optimizer = build_optimizer(cfg, gpt, topo.device)
        balance = ExpertBalance(gpt, cfg.moe_bias_rate, topo.device)
    compute, reduce_whole_grads = forward_context(cfg, topo), gradient_reduction(model, topo)
    no_scaling, times = torch.amp.GradScaler(topo.device.type, enabled=False), StepTimes(topo.device)

    def step(micro_steps: int, set_micro_step, after_backward) -> None:
        """The loop's step, less what reads values fake tensors lack: spikes, the guard, fp16's scaler's check, and
        Float8Scales (torchao 0.18's FP8-gathered weight tests its precomputed scale's truth; without one, each
        gather computes its scale, as a first step's do: the same bytes)."""
        times.begin()
        forward_backward(model, plan.batches, 1, micro_steps, times, compute, no_scaling, set_micro_step)
        reduce_whole_grads()
        clip_gradients(model, cfg.grad_clip or math.inf)
        after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        balance.step()
    plan.measure(model, optimizer, step, micro_steps(cfg, model))
    plan.report(model, optimizer, saved_files(cfg, model, optimizer, topo.rank))
    return 0


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        sys.exit(print(help_text()))
    run_entry_point(lambda: train(parse_args(sys.argv[1:])))

"""Pretrain a GPT with FSDP2.  python train_fsdp.py CONFIG.yaml [--key=value ...]  (or under torchrun)
python train_fsdp.py --help lists every config key with its type, default and meaning.

Order of work: config -> process group and mesh -> data -> model on the meta device ->
activation checkpointing -> compile -> fully_shard per DecoderBlock, then the root ->
weights initialised on rank 0 and broadcast into the shards -> optimizer -> resume -> loop.
"""
import math
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from config import UserError, parse_args, to_yaml, validate
from context_parallel import apply_context_parallel, whole_rows
from config_help import help_text
from data import prepare_sources
from tokenizer import check_data_tokenizer, get_tokenizer, is_hf_tokenizer
from evaluate import val_losses, val_loss_sums
from fsdp_ckpt import CheckpointManager
from guard import NonFiniteGuard
from mc_eval import accuracies, load_sets, mc_sums, truncated
from hf_format import define_model, read_hf_folder
from loader import BatchLoader
from launch import STRATEGY_TABLE, Topology, agree, init_distributed, run_entry_point
from metrics import ProgressLog, per_rank_stats
from mixture import resumed_segment
from model import GPT, GPTConfig
from muon import MuonWithAdamW, is_muon_matrix
from precision import DTYPES, autocast, check_offload, compute_dtype
from profiling import Profiling
from schedule import lr_at
from spikes import SpikeDetector, check_skip
from step_times import StepTimes
from stop import StopRequest
from watchdog import Watchdog, process_group_timeout
from sample import complete
from wandb_log import run_id

def initial_state(cfg, gpt_cfg: GPTConfig) -> dict:
    """The full starting weights: a Hugging Face folder's (init_from), or the seed's."""
    if cfg.init_from:  # define_model made cfg the folder's model: its tensors fit
        return read_hf_folder(cfg.init_from)[1]
    torch.manual_seed(cfg.seed)
    return GPT(gpt_cfg).state_dict()


def seed_device(seed: int, device: torch.device) -> None:
    """Seed the generator the device's random ops (dropout) draw from. Not torch.manual_seed: where
    CUDA (or XPU, MTIA) is not initialised, it queues a seeding for later with the caller's formatted
    stack, three per call: 0.5 ms a step on the CPU and a queue that grew without end."""
    (torch.cuda.manual_seed if device.type == "cuda" else torch.default_generator.manual_seed)(seed)


def build_model(cfg, gpt_cfg: GPTConfig, topo: Topology) -> torch.nn.Module:
    with torch.device("meta"):
        model = GPT(gpt_cfg)
    if topo.is_main:  # before the (for large models, long) initialisation
        n_params = model.num_params()
        print(f"parameters: {n_params:,} ({n_params / 1e6:.1f}M)", flush=True)
    if topo.cp_size > 1:
        apply_context_parallel(model, topo.cp_group, topo.cp_size)
    model.activation_checkpointing = cfg.activation_checkpointing
    if cfg.compile:
        for block in model.blocks:
            block.compile()
    param_device = topo.device
    if topo.wrap == "fsdp":
        _, reshard = STRATEGY_TABLE[cfg.sharding_strategy]
        dtype = compute_dtype(cfg.dtype, topo.device)
        # cast_forward_inputs off: a block's input x is in the compute dtype already (computed with
        # cast parameters), and the fp32 RoPE tables the root hands each block must stay fp32
        shard_args = dict(mesh=topo.mesh, mp_policy=MixedPrecisionPolicy(
            param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=DTYPES[cfg.reduce_dtype],
            cast_forward_inputs=False))
        if cfg.cpu_offload:
            shard_args["offload_policy"] = CPUOffloadPolicy(pin_memory=topo.device.type == "cuda")
            param_device = torch.device("cpu")
        for i, block in enumerate(model.blocks):
            # the last block's parameters are needed first in backward: keep them gathered
            fully_shard(block, reshard_after_forward=reshard and i < len(model.blocks) - 1, **shard_args)
        fully_shard(model, **shard_args)  # the root: embeddings, final norm, tied LM head
        if topo.device.type != "cuda":
            # FSDP2 averages gradients with ReduceOp.AVG, which gloo sums without dividing in torch
            # 2.8: on gloo, sum and divide by the data-parallel size instead (NCCL keeps AVG)
            for unit in (*model.blocks, model):
                unit.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=param_device)
    model.tie_weights()
    # Same seed (or folder), same weights for any world size: rank 0 alone builds the full model
    # (host memory) and the weights are broadcast one tensor at a time into every rank's shards.
    full_state = agree(lambda: initial_state(cfg, gpt_cfg) if topo.is_main else {})
    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    if topo.wrap == "ddp":
        # find_unused_parameters keeps DDP's first bucket layout. Otherwise DDP rebuilds its buckets
        # after the first synced step, in the order the gradients arrived: a resumed run's first
        # step would reduce in the old layout where the uninterrupted run used the new one, and at
        # 3+ ranks the ring all-reduce's summation order follows the layout (last bits differ).
        # The price: a walk of the autograd graph per step, and a one-time warning on each rank.
        model = DistributedDataParallel(model, device_ids=[topo.device.index] if topo.device.type == "cuda" else None,
                                        find_unused_parameters=True)
    return model


def parameter_groups(gpt: GPT) -> tuple[dict, dict]:
    """{name: parameter} with weight decay (matmul and embedding weights), and without (biases,
    norms' weights, value_mix: every 1-D parameter)."""
    decay, no_decay = {}, {}
    for name, p in gpt.named_parameters():
        (no_decay if p.dim() < 2 else decay)[name] = p
    return decay, no_decay


def adamw_optimizer(cfg, gpt: GPT, device: torch.device) -> torch.optim.AdamW:
    decay, no_decay = parameter_groups(gpt)
    # fused: one kernel over all parameters, on GPU and CPU alike; the per-tensor (foreach)
    # path costs several times more on FSDP's DTensors
    return torch.optim.AdamW([{"params": list(decay.values()), "weight_decay": cfg.weight_decay},
                              {"params": list(no_decay.values()), "weight_decay": 0.0}],
                             lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=True)


def muon_optimizer(cfg, gpt: GPT, device: torch.device) -> MuonWithAdamW:
    """Muon for the blocks' 2-D weights; AdamW for embeddings, LM head, LayerNorms and biases."""
    decay, no_decay = parameter_groups(gpt)
    matrices = {name: p for name, p in decay.items() if is_muon_matrix(name, p.shape)}
    adamw = dict(muon=False, betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=True)
    return MuonWithAdamW([
        dict(params=list(matrices.values()), muon=True, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum),
        dict(params=[p for name, p in decay.items() if name not in matrices], weight_decay=cfg.weight_decay, **adamw),
        dict(params=list(no_decay.values()), weight_decay=0.0, **adamw)], lr=cfg.learning_rate, device=device,
        coefficients=cfg.muon_coefficients, cautious=cfg.cautious_weight_decay,
        normuon=cfg.beta2 if cfg.normuon else None)


OPTIMIZERS = {"adamw": adamw_optimizer, "muon": muon_optimizer}


def build_optimizer(cfg, gpt: GPT, device: torch.device) -> torch.optim.Optimizer:
    return OPTIMIZERS[cfg.optimizer](cfg, gpt, device)


def set_gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    """Reduce gradients only on the last micro-step: one reduction per optimizer step."""
    if isinstance(model, DistributedDataParallel):
        model.require_backward_grad_sync = enabled
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    # an unwrapped model (one process) has no gradients to reduce


def forward_context(cfg, topo: Topology):
    """The context of every forward: training, val loss and text samples compute in one dtype."""
    dtype = compute_dtype(cfg.dtype, topo.device)
    return lambda: autocast(dtype, topo.device, fsdp=topo.wrap == "fsdp")


@torch.no_grad()
def evaluate(model, gpt: GPT, loader: BatchLoader, cfg, tokenizer, mc_sets: dict, compute) -> tuple[float, str, dict, dict]:
    """Mean loss over the first eval_iters * train_batch val windows (whatever the world size), a
    text sample, a mixture's loss per source, and each multiple-choice set's acc and acc_norm;
    `compute`: the context training's forwards run in."""
    model.eval()
    with compute():
        total = val_loss_sums(model, loader, cfg.eval_iters * cfg.train_batch, cfg.doc_mask)
        dist.all_reduce(total)
        mc = {}
        with whole_rows(gpt):  # items and samples of any length: every rank computes its own alone
            for name, items in mc_sets.items():  # a micro batch of items per forward, each rank a share
                right = mc_sums(model, items, cfg.block_size, cfg.micro_batch, dist.get_rank(), dist.get_world_size(),
                                loader.device)
                dist.all_reduce(right)
                mc[name] = accuracies(right)
            text = ""
            if cfg.sample_tokens:
                # every rank generates the same tokens: each forward's gathers are collectives; eager,
                # as compiled blocks would recompile for every new sequence length
                with torch.compiler.set_stance("force_eager"):
                    text = complete(gpt, tokenizer, "", cfg.sample_tokens, seed=cfg.seed, device=loader.device)
    # with no backward to follow, FSDP leaves units that skip resharding after forward (the
    # root, the last block, all under SHARD_GRAD_OP) gathered: free them, and let the
    # parameters seen by checkpoints be the sharded ones again
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    model.train()
    loss, per_source = val_losses(total, loader)
    return loss, text, per_source if loader.mixture else {}, mc


def resolve_vocabulary(cfg, meta: dict, topo: Topology):
    """Set cfg.vocab_size from the config, the data or the tokenizer; return the tokenizer for
    text samples, or None. Pre-tokenized data trains without the tokenizer's file (gpt2's needs a
    download): only text samples need it, and without it they are skipped with a note."""
    data_vocab = meta.get("vocab_size")
    tokenizer = None
    if cfg.sample_tokens or (data_vocab is None and cfg.vocab_size is None):
        try:
            tokenizer = agree(lambda: get_tokenizer(cfg.tokenizer))  # every rank decides alike
        except UserError as e:
            if data_vocab is None and cfg.vocab_size is None:
                raise
            if topo.is_main:
                print(f"note: no text samples at eval: {e}", flush=True)
            cfg.sample_tokens = 0
    data_vocab = data_vocab or (tokenizer.n_vocab if tokenizer else cfg.vocab_size)
    if cfg.vocab_size is None:
        cfg.vocab_size = -(-data_vocab // 64) * 64  # a multiple of 64: faster matmuls
    if cfg.vocab_size < data_vocab:
        raise UserError(f"vocab_size={cfg.vocab_size} is smaller than the data's {data_vocab} tokens")
    return tokenizer


def open_loader(cfg, sources: dict, topo: Topology, train_state: dict, step: int) -> BatchLoader:
    """The batch loader of a run resumed after `step` (0: a fresh one). A mixture continues the
    checkpoint's segment, or starts a new one where it left off when data_weights changed."""
    segment = None
    if cfg.data_mix is not None:
        segment, note = resumed_segment(list(cfg.data_mix), cfg.data_weights, (train_state.get("data") or {}).get("mixture"),
                                        step, cfg.train_batch)
        if note and topo.is_main:
            print(f"note: {note}", flush=True)
    loader = BatchLoader(sources, cfg.block_size, cfg.train_batch, cfg.micro_batch, topo.dp_rank, topo.dp_size,
                         cfg.seed, topo.device, segment, cfg.align_rows, topo.cp_rank, topo.cp_size)
    if topo.is_main and cfg.align_rows:
        cropped = ", ".join(f"{name} {share:.1%}" for name, share in loader.cropped().items())
        print(f"note: align_rows: rows start at documents; train tokens never read (cropped): {cropped}", flush=True)
    return loader


def data_state(loader: BatchLoader, step: int) -> dict:
    """What a checkpoint keeps of the data: a mixture's segment and the rows each source supplied
    (one dataset's position is a function of (seed, step) alone)."""
    if loader.mixture is None:
        return {}
    return {"mixture": loader.mixture.state(step)}


def run_state(loader: BatchLoader, step: int, spikes: SpikeDetector, wandb_id: str | None) -> dict:
    """The loop's state a checkpoint keeps beside the weights (fsdp_ckpt.py: train_state)."""
    return {"data": data_state(loader, step), "spikes": spikes.state(), "wandb_run_id": wandb_id}


def train(cfg) -> None:
    stop = StopRequest()  # first: a preemption or Ctrl-C during start-up still ends with a checkpoint
    topo = init_distributed(cfg)
    if cfg.init_from:  # the folder defines the model (and the tokenizer, unless one is named)
        agree(lambda: (define_model(cfg), validate(cfg)))
    rank, world, device, dp = topo.rank, topo.world_size, topo.device, topo.dp_size
    if cfg.train_batch % (cfg.micro_batch * dp):
        shares = f"{dp} data-parallel shares ({world} ranks / cp_size {cfg.cp_size})" if cfg.cp_size > 1 else f"{world} ranks"
        raise UserError(f"train_batch={cfg.train_batch} must be a multiple of micro_batch={cfg.micro_batch} "
                        f"x {shares} = {cfg.micro_batch * dp}")
    accum_steps = cfg.train_batch // (cfg.micro_batch * dp)
    dtype = compute_dtype(cfg.dtype, device)
    check_offload(dtype, cfg.cpu_offload)
    check_skip(cfg, dtype)
    # each rank reads the data itself (node-local disks): a failure on one stops every rank
    sources = agree(lambda: prepare_sources(cfg.data_mix, cfg.data_path, cfg.data_source, cfg.tokenizer))
    watchdog = Watchdog(topo, cfg.checkpoint_dir)  # data preparation, which may take hours, is not bounded
    watchdog.arm("start-up", cfg.init_timeout, "init_timeout")
    data_path, meta = next(iter(sources.values()))
    agree(lambda: check_data_tokenizer(cfg.tokenizer, meta, data_path))  # a Hugging Face one: the data's own
    if topo.is_main and meta["tokenizer"] != cfg.tokenizer and not is_hf_tokenizer(cfg.tokenizer):
        print(f"note: the data was prepared with tokenizer '{meta['tokenizer']}', which is used instead of "
              f"the configured '{cfg.tokenizer}'", flush=True)
    cfg.tokenizer = meta["tokenizer"]  # what the data holds: sampling and export decode with it
    if cfg.doc_mask and meta.get("eot_token") is None:  # before the model is built and resumed
        raise UserError(f"doc_mask needs the token that separates documents, which {data_path}/meta.json does not name "
                        f"(nanoGPT's raw .bin files): prepare the data with data.py, or set doc_mask: false")
    tokenizer = resolve_vocabulary(cfg, meta, topo)
    mc_sets = agree(lambda: load_sets(cfg.mc_eval_path or {}, cfg.tokenizer, cfg.vocab_size))
    for name, items in mc_sets.items():
        cut = truncated(items, cfg.block_size)
        if topo.is_main and cut:
            print(f"note: {cut} of {len(items)} items of {name} are longer than block_size {cfg.block_size}: their "
                  f"contexts lose their start", flush=True)
    gpt_cfg = GPTConfig(**cfg.model_shape, dropout=cfg.dropout, zero_init_proj=cfg.zero_init_proj)
    if topo.is_main:
        print(to_yaml(cfg), end="")
        if cfg.world_size not in (None, world):
            print(f"note: config written for world_size={cfg.world_size}, launched with {world} ranks; "
                  f"train_batch={cfg.train_batch} stays global, so accumulation is now {accum_steps} micro-steps")
        print(f"{world} ranks, {cfg.sharding_strategy if cfg.fsdp else 'DDP'}, mesh {topo.describe_mesh()}, "
              f"{f'context parallel {cfg.cp_size} (each row over {cfg.cp_size} ranks), ' if cfg.cp_size > 1 else ''}"
              f"{'model not wrapped (one process: nothing to shard), ' if topo.wrap == 'none' else ''}"
              f"gradient accumulation {accum_steps}, compute dtype {dtype}", flush=True)
    model = build_model(cfg, gpt_cfg, topo)
    gpt = getattr(model, "module", model)  # the GPT under a DDP wrapper; FSDP2 keeps the module itself
    optimizer = build_optimizer(cfg, gpt, device)
    ckpt = CheckpointManager(cfg, topo)
    watchdog.arm("the resume", cfg.init_timeout, "init_timeout")
    step = ckpt.resume(cfg.resume_from, model, optimizer)
    loader = open_loader(cfg, sources, topo, ckpt.train_state, step)
    tokens_per_step = cfg.train_batch * cfg.block_size
    wandb_id = run_id(cfg, ckpt.train_state)
    log = agree(lambda: ProgressLog(topo.is_main, cfg, tokens_per_step, gpt.flops_per_token(), device, dtype, world,
                                    resumed_at=step, wandb_id=wandb_id))
    spikes = SpikeDetector(device, cfg.spike_zscore, cfg.spike_window)
    spikes.load(ckpt.train_state.get("spikes"))
    times = StepTimes(device)
    separator = loader.separator if cfg.doc_mask else None  # doc_mask: attention stops at it
    profiling = Profiling(cfg, rank, device, lambda what: watchdog.arm(what, cfg.init_timeout, "init_timeout"))
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    guard = NonFiniteGuard(device, cfg.max_skipped_steps)
    compute = forward_context(cfg, topo)
    if step == 0:
        watchdog.arm("the eval at step 0", cfg.init_timeout, "init_timeout")
        log.val(0, *evaluate(model, gpt, loader, cfg, tokenizer, mc_sets, compute))
    log.start(step)
    first_step = step + 1
    stop.listen(process_group_timeout(cfg))
    with profiling.out_of_memory_snapshot():
        while step < cfg.max_iters:
            step += 1
            # the first step compiles and warms up: start-up's bound; every later one: collective_timeout
            watchdog.arm(f"step {step}", *((cfg.init_timeout, "init_timeout") if step == first_step
                                            else (cfg.collective_timeout, "collective_timeout")))
            profiling.begin(step)
            times.begin()
            lr = lr_at(cfg, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            seed_device(cfg.seed + 1_000_003 * step + rank, device)  # dropout masks: a function of (step, rank)
            loss_sum = torch.zeros((), device=device)
            for micro_step, (x, y) in enumerate(times.batches(loader.micro_batches(step))):
                set_gradient_sync(model, micro_step == accum_steps - 1)
                with compute():
                    _, loss = model(x, y, start=loader.start, separator=separator)
                scaler.scale(loss / accum_steps).backward()
                loss_sum += loss.detach()
            if world > 1:  # every rank's share: every rank judges the global batch's loss alike
                dist.all_reduce(loss_sum)
            loss = loss_sum / (accum_steps * world)
            spike = spikes.check(step, loss)
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
            # a non-finite step (and with spike_skip, a spike): every rank skips the update
            guard.check(step, grad_norm, optimizer, scaler, spike if cfg.spike_skip else None)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            times.end()
            profiling.end(step)
            last = step == cfg.max_iters
            if step % cfg.log_interval == 0 or last:
                grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
                log.train(step, loss.item(), lr, grad_norm.item(), per_rank_stats(model, optimizer, device, times.row()),
                          guard.skipped_steps(), loader.read(step), spikes.since_last_log(), spikes.total())
                guard.stop_if_too_many(loader.position(step), ckpt.last_saved)
            if request := stop.agreed():
                # the checkpoint first, no eval or text sample: the grace period before SIGKILL is short
                watchdog.arm(f"the save of step {step}", cfg.init_timeout, "init_timeout")
                ckpt.save(step, model, optimizer, run_state(loader, step, spikes, wandb_id))
                if topo.is_main:
                    print(f"{request}: stopped after step {step} with its checkpoint saved", flush=True)
                break
            if step % cfg.eval_interval == 0 or last:
                watchdog.arm(f"the eval at step {step}", cfg.init_timeout, "init_timeout")
                log.val(step, *evaluate(model, gpt, loader, cfg, tokenizer, mc_sets, compute))
                log.start(step)  # tokens/s and ETA count training time only
            if step % cfg.save_interval == 0 or last:
                watchdog.arm(f"the save of step {step}", cfg.init_timeout, "init_timeout")
                ckpt.save(step, model, optimizer, run_state(loader, step, spikes, wandb_id))
                log.start(step)
    profiling.close()
    watchdog.arm("the last save", cfg.init_timeout, "init_timeout")
    ckpt.close()
    log.close(per_rank_stats(model, optimizer, device))
    code = stop.close()
    watchdog.close()
    if topo.is_main:
        print(f"done: last checkpoint {ckpt.last_saved}, TensorBoard logs in {cfg.tensorboard_dir}/", flush=True)
    return code


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        sys.exit(print(help_text()))
    run_entry_point(lambda: train(parse_args(sys.argv[1:])))

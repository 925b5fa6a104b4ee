"""What a config costs on a cluster, computed from the model's shapes (no GPU, no process group).

    python bench/scale_plan.py CONFIG [--key=value ...] --gpus N --gpus_per_node G [--bandwidth GB/s]

Per rank, under FULL_SHARD (one shard group of all ranks) and HYBRID_SHARD (shard groups of
fsdp_size, default one node, replicated across them): parameters, gradients and optimizer state
(AdamW: two moments; optimizer: muon, one momentum for the blocks' matrices, and NorMuon a
second moment per row); the bytes each
rank sends per optimizer step (all-gathers, reduce-scatters, HYBRID's all-reduce across
replicas, Muon's exchanges of the matrices); the sharded checkpoint's size, the time to write and to read it at
the filesystem's aggregate bandwidth (replica groups past the first receive their slices over
the network instead), the rank files each rank opens on resume and the index's size; with
cp_size, the tokens of a row each rank computes and both cp_modes' traffic, whichever the config runs:
Ulysses' all-to-alls of q, k, v and the attention's output, the ring's passes of each rank's key/value
block and (backward) of its gradient, in fp32 (forward and backward, and the forward again under
activation checkpointing), per layer and per step; with
ep_size, the experts' gathers and reductions inside their FSDP group (the ranks holding the same
experts) and the all-to-alls that carry each token's top-k copies to its experts and back (routing
taken as balanced: (ep-1)/ep of the copies leave the rank). Ring collectives: a rank sends (n-1)/n of the gathered or reduced bytes, an all-reduce twice that. The rank with the most rows is shown (rank 0: FSDP2 splits dim 0 like torch.chunk).
"""
import argparse
import io
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from fsdp_gpt.distributed.precision import DTYPES  # noqa: E402
from fsdp_gpt.distributed.replicated import replicated_params  # noqa: E402
from fsdp_gpt.distributed.shards import dim0_shard  # noqa: E402
from fsdp_gpt.checkpoint.ckpt_index import build_index, files_to_open, model_key, state_key, wanted_rows  # noqa: E402
from fsdp_gpt.config import UserError, exit_code  # noqa: E402
from fsdp_gpt.config_parse import parse_args  # noqa: E402
from fsdp_gpt.model import GPT, GPTConfig  # noqa: E402
from fsdp_gpt.optim.muon import is_muon_matrix, newton_schulz_share  # noqa: E402

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "auto": 2}  # auto: bf16 on the GPUs this plans for
ADAMW_MOMENTS = ("exp_avg", "exp_avg_sq")
GB = 1e9
GPT2_VOCAB = 50304  # 50,257 rounded up to a multiple of 64, as the trainer rounds it


def meta_model(cfg) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(**cfg.model_config))


def units(cfg) -> list[list[tuple[str, torch.Size]]]:
    """The FSDP units' (name, shape) lists: each DecoderBlock, then the root (embeddings, final norm)."""
    model = meta_model(cfg)
    blocks = [[(f"blocks.{i}.{n}", p.shape) for n, p in block.named_parameters()] for i, block in enumerate(model.blocks)]
    in_blocks = {name for unit in blocks for name, _ in unit}
    return blocks + [[(n, p.shape) for n, p in model.named_parameters() if n not in in_blocks]]


def is_expert(name: str) -> bool:
    return ".experts." in name


def row_numel(shape: torch.Size) -> int:
    return shape[1:].numel()


def optimizer_state(cfg, name: str, shape: torch.Size) -> dict[str, int]:
    """The fp32 tensors the optimizer keeps per parameter, split by rows as the parameter: {name:
    elements per row}. Muon: a momentum; NorMuon also one second moment per row."""
    if not (cfg.optimizer == "muon" and is_muon_matrix(name, shape)):
        return dict.fromkeys(ADAMW_MOMENTS, row_numel(shape))
    return {"momentum_buffer": row_numel(shape)} | ({"row_second_moment": 1} if cfg.normuon else {})


class Plan:
    def __init__(self, cfg, gpus: int, shard: int):
        self.cfg, self.gpus, self.shard, self.replicas = cfg, gpus, shard, gpus // shard
        self.units, self.model = units(cfg), meta_model(cfg)
        self.tokens = cfg.train_batch * cfg.block_size  # per optimizer step
        self.params = [p for unit in self.units for p in unit]
        self.numel = sum(shape.numel() for _, shape in self.params)
        # the cp_size ranks of a context group share rows: gpus / cp_size data-parallel shares
        self.micro_steps = cfg.train_batch // (cfg.micro_batch * gpus // cfg.cp_size)
        self.ep = cfg.ep_size
        self.expert_numel = sum(shape.numel() for name, shape in self.params if is_expert(name))
        # the vectors FSDP2 leaves whole on every rank (distributed/replicated.py)
        names = {p: name for name, p in self.model.named_parameters()}
        self.whole = {names[p] for p in replicated_params(cfg, DTYPES.get(cfg.dtype, torch.bfloat16), self.model)}
        self.whole_numel = sum(shape.numel() for name, shape in self.params if name in self.whole)

    def slices(self, rank: int) -> dict:
        """{name: (offset, rows)} of every parameter's dim-0 slice on `rank` (shard index i = rank %
        shard). Experts under ep_size: expert group member i % ep holds experts j*E/ep.., FSDP's slice
        i // ep of them."""
        i = rank % self.shard
        return {name: (0, shape[0]) if name in self.whole else self.expert_slice(shape, i) if is_expert(name)
                else dim0_shard(shape[0], self.shard, i) for name, shape in self.params}

    def read_slices(self, rank: int) -> dict:
        """The slices `rank` writes and reads back: a whole tensor rank 0's alone, a shard the first replica's."""
        first = rank < self.shard
        return {name: (offset, rows if (rank == 0 if name in self.whole else first) else 0)
                for name, (offset, rows) in self.slices(rank).items()}

    def expert_slice(self, shape: torch.Size, i: int) -> tuple[int, int]:
        """(offset, rows) of shard index i of a stacked expert weight (at ep_size 1: dim0_shard's)."""
        group = shape[0] // self.ep
        offset, rows = dim0_shard(group, self.shard // self.ep, i // self.ep)
        return (i % self.ep) * group + offset, rows

    def state_bytes(self, rank: int) -> dict:
        """fp32 parameters, gradients and optimizer state held by `rank`."""
        slices = self.slices(rank)
        local = {name: slices[name][1] * row_numel(shape) for name, shape in self.params}
        states = sum(slices[name][1] * sum(optimizer_state(self.cfg, name, shape).values()) for name, shape in self.params)
        return {"parameters": 4 * sum(local.values()), "gradients": 4 * sum(local.values()), "optimizer": 4 * states}

    def checkpoint_bytes(self, names=None) -> int:
        """The fp32 weights and optimizer state of the named parameters (every one: None), each row once."""
        return 4 * sum(shape.numel() + shape[0] * sum(optimizer_state(self.cfg, name, shape).values())
                       for name, shape in self.params if names is None or name in names)

    def broadcast_bytes(self) -> float:
        """What rank 0 sends on resume: its shards to its replicas (HYBRID_SHARD), and the whole vectors
        (and their optimizer state) to every rank."""
        whole = self.checkpoint_bytes(self.whole)
        return ((self.checkpoint_bytes() - whole) / self.shard if self.replicas > 1 else 0) + (whole if self.gpus > 1 else 0)

    def sent_bytes(self) -> dict:
        """Bytes one rank sends per optimizer step: all-gathers in the compute dtype each micro-step
        (again in backward for units resharded after forward: all blocks but the last, never the
        root), one reduce-scatter in the reduce dtype, HYBRID's all-reduce of the shards, and with
        Muon the fp32 slices of the matrices (NorMuon: a column more) to their owners and back (two
        all-to-alls)."""
        cfg, n, r = self.cfg, self.shard, self.replicas
        # the 2-D matrices only: stacked experts are orthogonalised where they are, nothing exchanged
        matrices = 4 * sum(shape[0] * (shape[1] + cfg.normuon) for name, shape in self.params
                           if cfg.optimizer == "muon" and is_muon_matrix(name, shape) and len(shape) == 2)
        # a replica's share (1/r of the matrices): slices to their owners and back in the shard
        # group; then every rank's slices all-gathered across the replicas
        muon_exchange = 2 * matrices / r / n * (n - 1) / n + matrices / n * (r - 1) / r
        regathered = [(name, shape) for unit in self.units[:-2] for name, shape in unit]  # root last, last block before it
        # under ep_size the experts gather (and reduce) 1/ep of themselves in groups of n/ep
        e, group = self.ep, n // self.ep
        experts = self.expert_numel + sum(shape.numel() for name, shape in regathered if is_expert(name))
        sharded = self.numel - self.whole_numel
        others = sharded + sum(shape.numel() for name, shape in regathered if name not in self.whole) - experts
        gathers = self.micro_steps * BYTES[cfg.dtype] * (others * (n - 1) / n + experts / e * (group - 1) / group)
        reduced = BYTES[cfg.reduce_dtype] * ((sharded - self.expert_numel) * (n - 1) / n +
                                             self.expert_numel / e * (group - 1) / group)
        # HYBRID's all-reduce of the shards over the replicas, and the whole vectors' over every rank, in fp32
        all_reduced = (2 * (r - 1) / r * sharded * BYTES[cfg.reduce_dtype] / n +
                       2 * (self.gpus - 1) / self.gpus * self.whole_numel * 4)
        return {"all-gather": gathers, "reduce-scatter": reduced, "all-reduce": all_reduced, "muon exchange": muon_exchange,
                "ulysses": self.ulysses_bytes(), "expert all-to-all": self.expert_all_to_all_bytes()}

    def expert_all_to_all_bytes(self) -> float:
        """Per step: each MoE layer sends the rank's tokens' top-k copies to their experts and the
        results back, (ep-1)/ep of them off the rank; as much again in backward, and in a recomputed
        forward."""
        cfg, moe_layers = self.cfg, len(self.model.moe_layers())
        copies = cfg.micro_batch * cfg.block_size // cfg.cp_size * self.model.config.moe_top_k
        passes = 3 if cfg.activation_checkpointing else 2
        return (self.micro_steps * passes * moe_layers * 2 * copies * self.model.config.n_embd * BYTES[cfg.dtype]
                * (self.ep - 1) / self.ep)

    def ulysses_bytes(self) -> float:
        """Per step: each layer's all-to-alls (q, k and v in, as one; the output back) of this rank's
        slice, each sending (cp-1)/cp of it; as many again in backward, and in a recomputed forward."""
        return self.per_step(self.ulysses_layer_bytes())

    def per_step(self, layer_bytes: float) -> float:
        """A layer's bytes in one micro-step, over every layer and micro-step of an optimizer step."""
        return layer_bytes * self.model.config.n_layer * self.micro_steps

    def ulysses_layer_bytes(self) -> float:
        """One layer's, one micro-step: see ulysses_bytes."""
        cfg, model_cfg, cp = self.cfg, self.model.config, self.cfg.cp_size
        heads = 2 * model_cfg.n_head + 2 * model_cfg.n_kv_head  # q and the output; k and v
        per_forward = heads * cfg.micro_batch * cfg.block_size // cp * model_cfg.head_dim
        passes = 3 if cfg.activation_checkpointing else 2
        return passes * per_forward * BYTES[cfg.dtype] * (cp - 1) / cp

    def ring_layer_bytes(self) -> float:
        """One layer's, one micro-step, under cp_mode ring: a rank's key/value block (its tokens' k and
        v, key/value heads only, in the compute dtype) passed on cp-1 times in forward, as many in
        backward with the block's gradient (fp32) passed on cp times, and cp-1 more in a recomputed forward."""
        cfg, model_cfg, cp = self.cfg, self.model.config, self.cfg.cp_size
        block = 2 * cfg.micro_batch * cfg.block_size // cp * model_cfg.n_kv_head * model_cfg.head_dim
        forwards = 2 if cfg.activation_checkpointing else 1
        return block * ((forwards + 1) * (cp - 1) * BYTES[cfg.dtype] + cp * 4)

    def ulysses_refusal(self) -> str | None:
        """Why Ulysses can't split this model's heads over cp_size, or None."""
        cp, model_cfg = self.cfg.cp_size, self.model.config
        short = [f"{name} {n}" for name, n in (("n_head", model_cfg.n_head), ("n_kv_head", model_cfg.n_kv_head)) if n % cp]
        return f"not possible: cp_size {cp} must divide {short[0]}" if short else None

    def index(self) -> dict:
        """The sharded checkpoint's index as ckpt_index builds it: replica group 0 writes the rows."""
        layouts = []
        for rank in range(self.gpus):
            slices, layout = self.read_slices(rank), {}
            for name, shape in self.params:
                offset, rows = slices[name]
                layout[model_key(name)] = (shape[0], offset, rows)
                for moment in optimizer_state(self.cfg, name, shape):
                    layout[state_key(name, moment)] = (shape[0], offset, rows)
            layouts.append(layout)
        return build_index(layouts)

    def files_opened(self, index: dict, rank: int) -> int:
        """Rank files `rank` opens on resume: replicas past the first receive their slices instead."""
        if rank >= self.shard:
            return 0
        return len(files_to_open(index, wanted_rows(index, self.read_slices(rank)), rank))


def column(plan: Plan, bandwidth: float) -> dict:
    """One strategy's figures, by row label."""
    state, sent = plan.state_bytes(0), plan.sent_bytes()
    size = plan.checkpoint_bytes()
    index = plan.index()
    readers = {0, plan.shard - 1}  # the first replica group's ends: the others open no file
    return {
        "shard group x replicas": f"{plan.shard} x {plan.replicas}",
        "parameters GB per rank (fp32)": f"{state['parameters'] / GB:.3f}",
        "gradients GB per rank (fp32)": f"{state['gradients'] / GB:.3f}",
        f"{plan.cfg.optimizer} state GB per rank (fp32)": f"{state['optimizer'] / GB:.3f}",
        "all-gather GB sent per rank per step": f"{sent['all-gather'] / GB:.3f}",
        "reduce-scatter GB sent per rank per step": f"{sent['reduce-scatter'] / GB:.3f}",
        "all-reduce GB sent per rank per step": f"{sent['all-reduce'] / GB:.3f}",
        **({"tokens of a row a rank computes (cp_size ranks a row)": f"{plan.cfg.block_size // plan.cfg.cp_size:,} "
            f"of {plan.cfg.block_size:,} ({plan.cfg.cp_size})",
            **context_rows(plan, sent)} if plan.cfg.cp_size > 1 else {}),
        **({"experts of each MoE layer a rank computes (ep_size)": f"{plan.model.config.moe_experts // plan.ep} "
            f"of {plan.model.config.moe_experts} ({plan.ep})",
            "expert all-to-all GB sent per rank per step": f"{sent['expert all-to-all'] / GB:.3f}"} if plan.ep > 1 else {}),
        **({"muon exchange GB sent per rank per step": f"{sent['muon exchange'] / GB:.3f}",
            "Newton-Schulz FLOPs / training FLOPs, busiest rank": f"{newton_schulz_share(plan.model, plan.tokens, plan.gpus, plan.gpus):.2e}"}
           if plan.cfg.optimizer == "muon" else {}),
        "sharded checkpoint GB (each row once)": f"{size / GB:.2f}",
        f"write s at {bandwidth:g} GB/s": f"{size / GB / bandwidth:.1f}",
        f"resume: read s at {bandwidth:g} GB/s (each row once)": f"{size / GB / bandwidth:.1f}",
        "resume: GB rank 0 broadcasts": f"{plan.broadcast_bytes() / GB:.3f}",
        "rank files a rank opens on resume": str(max(plan.files_opened(index, r) for r in readers)),
        "index in the .complete marker, MB": f"{marker_bytes(index) / 1e6:.2f}",
    }


def context_rows(plan: Plan, sent: dict) -> dict:
    """Both cp_modes' bytes, whichever the config runs: per layer (one micro-step) and per step."""
    ulysses_refusal = plan.ulysses_refusal()
    return {"Ulysses all-to-all MB sent per rank per layer (a micro-step)":
            ulysses_refusal or f"{plan.ulysses_layer_bytes() / 1e6:.2f}",
            "Ulysses all-to-all GB sent per rank per step": ulysses_refusal or f"{sent['ulysses'] / GB:.3f}",
            "ring MB sent per rank per layer (a micro-step)": f"{plan.ring_layer_bytes() / 1e6:.2f}",
            "ring GB sent per rank per step":
            f"{plan.per_step(plan.ring_layer_bytes()) / GB:.3f}"}


def report(plans: dict, bandwidth: float) -> list[tuple[str, ...]]:
    columns = {name: column(plan, bandwidth) for name, plan in plans.items()}
    labels = columns["FULL_SHARD"]
    return [("", *plans), ("---",) * (1 + len(plans))] + [(label, *(c[label] for c in columns.values())) for label in labels]


def marker_bytes(index: dict) -> int:
    buffer = io.BytesIO()
    torch.save({"index": index}, buffer)
    return buffer.tell()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpus_per_node", type=int, default=8)
    parser.add_argument("--bandwidth", type=float, default=10.0, help="filesystem aggregate GB/s")
    args, rest = parser.parse_known_args(argv)
    cfg = parse_args(rest)
    if cfg.vocab_size is None:  # the run takes it from its data
        cfg.vocab_size = GPT2_VOCAB
        print(f"vocab_size: {GPT2_VOCAB} (GPT-2's tokens; set --vocab_size=N for other data)")
    if args.gpus % cfg.cp_size:
        raise UserError(f"cp_size={cfg.cp_size} must divide --gpus={args.gpus}")
    hybrid_shard = cfg.fsdp_size or args.gpus_per_node
    if hybrid_shard % cfg.ep_size:
        raise UserError(f"ep_size={cfg.ep_size} must divide HYBRID_SHARD's shard group of {hybrid_shard} GPUs")
    shares = args.gpus // cfg.cp_size
    if cfg.train_batch % (cfg.micro_batch * shares):
        split = f"{shares} data-parallel shares ({args.gpus} GPUs / cp_size {cfg.cp_size})" if cfg.cp_size > 1 else \
            f"{args.gpus} GPUs"
        raise UserError(f"train_batch={cfg.train_batch} must be a multiple of micro_batch={cfg.micro_batch} x {split}: "
                        f"set --train_batch")
    plans = {"FULL_SHARD": Plan(cfg, args.gpus, args.gpus),
             "HYBRID_SHARD": Plan(cfg, args.gpus, hybrid_shard)}
    plan = plans["FULL_SHARD"]
    print(f"{plan.numel:,} parameters stored (position embeddings included), {args.gpus} GPUs ({args.gpus_per_node} per node), "
          f"{plan.micro_steps} micro-steps of {cfg.micro_batch} x {cfg.block_size // cfg.cp_size} tokens per rank per step, "
          f"compute {cfg.dtype if cfg.dtype != 'auto' else 'bf16'}, reduce {cfg.reduce_dtype}")
    for row in report(plans, args.bandwidth):
        print("| " + " | ".join(row) + " |")
    full = plan.checkpoint_bytes()
    print(f"full checkpoint: {full / GB:.2f} GB gathered into rank 0's host memory and written by rank 0 alone")
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(lambda: main(sys.argv[1:])))

"""A dry run's plan (plan.py measures it): the figures a team decides by, as JSON (plan.json) and on one screen.

Per rank, rank 0's (FSDP2 splits dim 0 like torch.chunk: the first ranks hold the most rows): its parameters,
gradients and optimizer state as mem/state_gb counts them, the step's peak with and without activation
checkpointing against each planned GPU's memory. Per step: the bytes each rank sends by kind of collective and
by group, and the link each group's collectives take (NVLink where its ranks share a node, the network
otherwise); the step-time floor from those bytes at the links' rates and from the FLOPs at the GPU's peak; the
tokens a step and the tokens a second that floor allows. A save's files.
"""
import json
import os

import torch.distributed as dist

from fsdp_gpt.distributed.gpus import PLANNED
from fsdp_gpt.distributed.launch import Topology
from fsdp_gpt.distributed.peak_flops import gpu_peak_flops
from fsdp_gpt.distributed.precision import compute_dtype

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")  # always in the plan, 0 where none ran


def group_labels(topo: Topology) -> dict[str, str]:
    """{process group name: what it is}: the meshes' dimensions, the context-parallel group, the world."""
    labels = {}
    for mesh in (topo.expert_mesh, topo.mesh):  # the FSDP mesh's names win where both name a group
        for name in (mesh.mesh_dim_names if mesh is not None else ()):
            labels[mesh.get_group(name).group_name] = name
    if topo.cp_group is not None:
        labels[topo.cp_group.group_name] = "context"
    labels.setdefault(dist.group.WORLD.group_name, "world")
    return labels


def collectives(measured, topo: Topology, gpu) -> list[dict]:
    """Each (kind, group) of the step's collectives: calls, GB each rank sends, over which link at what rate."""
    labels, rows = group_labels(topo), []
    for (kind, name), sent in sorted(measured.collectives.sent.items()):
        group = measured.collectives.groups[name]
        nodes = {rank // topo.local_world_size for rank in dist.get_process_group_ranks(group)}
        link, rate = ("nvlink", gpu.nvlink_gb_s) if len(nodes) == 1 else ("network", gpu.network_gb_s)
        rows.append({"kind": kind, "group": labels.get(name, name), "ranks": group.size(), "nodes": len(nodes),
                     "calls": measured.collectives.calls[(kind, name)], "gb": sent / 1e9, "link": link,
                     "link_gb_s": rate, "seconds": sent / 1e9 / rate})
    return rows


def assumptions(cfg) -> list[str]:
    """What the dry run takes for what it can't know, where the config makes it matter."""
    notes = ["the memory of the CPU's kernels (a fused kernel of the GPU's may hold a temporary less)"]
    notes += ["compile: true planned eager (the step holds what eager PyTorch holds; compiled, a little less)"] * cfg.compile
    notes += ["ep_size: each rank's tokens routed to the ranks of its expert group evenly (a skewed routing sends "
              "and holds more on the busiest rank)"] * (cfg.ep_size > 1)
    notes += ["doc_mask: each row one document (the data's documents change the attention's work, not its "
              "memory)"] * cfg.doc_mask
    return notes


def figures(cfg, topo: Topology, gpt, params: int, accum_steps: int, state: dict, steps: dict, saved: dict,
            start_up: list[str], cost: dict) -> dict:
    """The plan as JSON: steps {activation checkpointing: plan.Measured}, state: metrics.state_parts_gb after
    the step (its gradients freed), saved: fsdp_ckpt.saved_files, cost: the dry run's own time and memory."""
    gpu = PLANNED[cfg.dry_run_gpu]
    configured = steps[cfg.activation_checkpointing]
    rows = collectives(configured, topo, gpu)
    nodes, gpus_per_node = cfg.dry_run_world()
    tokens = cfg.train_batch * cfg.block_size  # a step's, every rank's
    rank_tokens = cfg.micro_batch * cfg.block_size // cfg.cp_size * accum_steps
    recompute = 4 / 3 if cfg.activation_checkpointing else 1  # the forward again: 8 of 6 FLOPs a weight
    flops = gpt.flops_per_token() * rank_tokens * recompute
    peak = gpu_peak_flops(gpu.chip.name, compute_dtype(cfg.dtype, gpu.chip))
    compute_s = flops / peak
    collective_s = sum(row["seconds"] for row in rows)
    floor = max(compute_s, collective_s)
    by_kind = dict.fromkeys(KINDS, 0.0) | configured.collectives.by_kind()
    layout = next((line for line in start_up if line.startswith("FSDP units:")), None)
    return {
        "world_size": topo.world_size, "nodes": nodes, "gpus_per_node": gpus_per_node, "gpu": cfg.dry_run_gpu,
        "rank": topo.rank, "params": params,
        "mesh": dict(zip(topo.mesh.mesh_dim_names, topo.mesh.shape)) if topo.mesh is not None else {},
        "expert_mesh": dict(zip(topo.expert_mesh.mesh_dim_names, topo.expert_mesh.shape)) if topo.expert_mesh else {},
        "layout": layout, "start_up": start_up,
        "per_rank": {"params_gb": state["params"], "grads_gb": configured.grads_gb, "optimizer_gb": state["optimizer"],
                     "state_gb": state["params"] + state["grads"] + state["optimizer"],
                     "peak_gb": configured.peak["Total"],
                     "peak_gb_by_activation_checkpointing": {str(on).lower(): m.peak["Total"] for on, m in steps.items()},
                     "peak_parts_gb": configured.peak},
        "fits": {name: {"memory_gb": other.memory_gb,
                        **{f"activation_checkpointing_{str(on).lower()}": m.peak["Total"] <= other.memory_gb
                           for on, m in steps.items()}} for name, other in PLANNED.items()},
        "per_step": {"tokens": tokens, "rank_tokens": rank_tokens, "micro_steps": accum_steps,
                     "collective_gb": by_kind, "collectives": rows, "flops_per_rank": flops},
        "step_floor": {"compute_s": compute_s, "peak_flops": peak, "collectives_s": collective_s,
                       "overlapped_s": floor, "serial_s": compute_s + collective_s, "tokens_per_s": tokens / floor,
                       "tokens_per_s_serial": tokens / (compute_s + collective_s)},
        "checkpoint": {"type": cfg.checkpoint_type, "files_per_rank": saved["files"], "bytes_per_rank": saved["bytes"],
                       "whole_bytes": saved["whole_bytes"]},
        "assumptions": assumptions(cfg), "dry_run": cost,
    }


def _gb(x: float) -> str:
    return f"{x:.3g}" if x < 100 else f"{x:,.0f}"


def screen(plan: dict) -> str:
    """The plan on one screen."""
    rank, step, floor, ckpt = plan["per_rank"], plan["per_step"], plan["step_floor"], plan["checkpoint"]
    peaks = rank["peak_gb_by_activation_checkpointing"]
    lines = [f"plan: {plan['world_size']} ranks ({plan['nodes']} x {plan['gpus_per_node']} {plan['gpu']}), "
             f"rank {plan['rank']}'s figures, {plan['params']:,} parameters",
             f"per rank: parameters {_gb(rank['params_gb'])} GB, gradients {_gb(rank['grads_gb'])} GB (from backward to "
             f"the update), optimizer state {_gb(rank['optimizer_gb'])} GB: state {_gb(rank['state_gb'])} GB "
             f"(mem/state_gb)",
             f"peak in a step: {_gb(peaks['false'])} GB without activation checkpointing, {_gb(peaks['true'])} GB with it"]
    for name, fit in plan["fits"].items():
        verdicts = [f"fits {how}" if peaks[on] <= fit["memory_gb"] else f"{_gb(peaks[on] - fit['memory_gb'])} GB short {how}"
                    for on, how in (("false", "without"), ("true", "with"))]
        lines.append(f"  {name} ({fit['memory_gb']:g} GB): {', '.join(verdicts)}")
    lines.append("collectives a step, GB each rank sends: " + ", ".join(
        f"{kind} {_gb(gb)}" for kind, gb in step["collective_gb"].items()))
    for row in step["collectives"]:
        lines.append(f"  {row['kind']} over {row['group']} ({row['ranks']} ranks, {row['nodes']} node"
                     f"{'s' * (row['nodes'] > 1)}): {row['calls']} calls, {_gb(row['gb'])} GB at {row['link']} "
                     f"{row['link_gb_s']:g} GB/s: {row['seconds'] * 1e3:.3g} ms")
    lines.append(f"step-time floor: compute {floor['compute_s']:.3g} s ({step['flops_per_rank'] / 1e12:,.0f} TFLOP a "
                 f"rank at {floor['peak_flops'] / 1e12:g} TFLOP/s), collectives {floor['collectives_s']:.3g} s: "
                 f"{floor['overlapped_s']:.3g} s overlapped, {floor['serial_s']:.3g} s not")
    lines.append(f"tokens a step {step['tokens']:,} ({step['micro_steps']} micro-steps of {step['rank_tokens'] // step['micro_steps']:,} a rank): "
                 f"at most {floor['tokens_per_s']:,.0f} tokens/s ({floor['tokens_per_s'] / plan['world_size']:,.0f} a GPU), "
                 f"{floor['tokens_per_s_serial']:,.0f} not overlapped")
    lines.append(f"checkpoint ({ckpt['type']}): {ckpt['files_per_rank']} file{'s' * (ckpt['files_per_rank'] != 1)} "
                 f"on rank {plan['rank']}, {ckpt['bytes_per_rank'] / 1e9:.3g} GB; {ckpt['whole_bytes'] / 1e9:.3g} GB in all")
    lines += [f"assumed: {note}" for note in plan["assumptions"]]
    lines.append(f"(planned in {plan['dry_run']['seconds']:.0f} s, {plan['dry_run']['host_peak_gb']:.2f} GB of host memory)")
    return "\n".join(lines)


def write(plan: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(plan, f, indent=1)

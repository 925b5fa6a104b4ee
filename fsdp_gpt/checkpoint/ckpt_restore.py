"""A checkpoint read into the run's wrapped model and optimizer, full or sharded, at any world size
and layout: the resume side of the checkpoint manager (fsdp_ckpt.py decides which checkpoint).
Collectives included: every rank calls load() with the same path.

A full file: rank 0 reads it and torch's set_*_state_dict scatters it. A sharded set: each rank
opens only the rank files holding the rows it owns now (the marker's index says which), and a
slice held by several ranks (HYBRID_SHARD's replicas, whole tensors) is read once and sent.
"""
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

from fsdp_gpt.checkpoint.ckpt_format import (
    LOAD_OPTIONS, check_model_shape, check_named_rank_file, fill_local, is_first_replica, load_full, marker_path,
    open_rank_files, read_marker, read_sharded, rope_base_moves, shard_path, sharded_step)
from fsdp_gpt.checkpoint.ckpt_index import check_file, check_whole, files_to_open, model_key, wanted_rows
from fsdp_gpt.checkpoint.run_state import resumed_train_state
from fsdp_gpt.config import UserError
from fsdp_gpt.distributed.launch import agree, decided_on_rank0
from fsdp_gpt.distributed.shards import local_slice, zero_rows


def parameter_names(model) -> dict:
    """{parameter: name}, the same names under FSDP and DDP (whose wrapper adds 'module.')."""
    return {p: name for name, p in getattr(model, "module", model).named_parameters()}


def _placed(value: torch.Tensor, key: str, p: torch.Tensor, group: dict) -> torch.Tensor:
    """A saved 0-dim optimizer value where the optimizer keeps it (the rule of torch's
    Optimizer.load_state_dict): `step` on the host unless the optimizer is fused or capturable,
    which keep it on the parameter's device, as every other value."""
    on_device = key != "step" or group.get("fused") or group.get("capturable")
    return value.to(device=p.device, copy=True) if on_device else value.clone()


class CheckpointReader:
    def __init__(self, cfg, topo):
        self.cfg, self.topo = cfg, topo

    def load(self, path: str, model, optimizer) -> tuple[int, dict]:
        """The checkpoint at path (a full file, or any file of a sharded set) into model and optimizer:
        (its step, its train_state), on every rank. A damaged file raises CorruptCheckpoint before
        the model is touched, on every rank alike."""
        if (step := sharded_step(path)) is not None:
            return self._load_sharded(path, step, model, optimizer)
        return self._load_full(path, model, optimizer)

    def _load_full(self, path: str, model, optimizer) -> tuple[int, dict]:
        def read():
            ckpt = load_full(path)
            self._check_shape(f"checkpoint {path}", ckpt["model_config"])
            return ckpt
        ckpt = agree(read if self.topo.is_main else dict)
        header = [ckpt.get("step"), resumed_train_state(ckpt) if self.topo.is_main else None]
        dist.broadcast_object_list(header, src=0)
        set_model_state_dict(model, ckpt.get("model", {}), options=LOAD_OPTIONS)
        set_optimizer_state_dict(model, optimizer, ckpt.get("optimizer", {}), options=LOAD_OPTIONS)
        return header[0], header[1]

    def _load_sharded(self, path: str, step: int, model, optimizer) -> tuple[int, dict]:
        directory, names = os.path.dirname(path), parameter_names(model)
        # rank 0 reads the marker once for every rank, and checks from its index that the set is whole
        marker = decided_on_rank0(lambda: self._read_marker(path, step))
        # who wrote a slice reads it (the first replica of a shard; rank 0 a whole tensor); the others receive it (below)
        reads = {p: is_first_replica(p, self.topo.rank) for p in names}
        files = agree(lambda: self._open_needed(directory, marker, names, reads) if any(reads.values()) else [])
        # which parameters have optimizer state, its keys, tensors' shapes and scalars (`step`), and the train state:
        # rank 0 reads, tells all
        skeleton = [{name: {key: value["shape"] if isinstance(value, dict) else value for key, value in saved.items()}
                     for name, saved in files[0]["optimizer"].items()} if self.topo.is_main else None,
                    resumed_train_state(files[0]) if self.topo.is_main else None]
        dist.broadcast_object_list(skeleton, src=0)
        group_of = {p: group for group in optimizer.param_groups for p in group["params"]}
        for p, name in names.items():
            if reads[p]:
                fill_local(p, [f["model"][name] for f in files])
            state = {}
            for key, value in skeleton[0].get(name, {}).items():
                if isinstance(value, list):  # a tensor's shape: its rows are p's rows
                    state[key] = zero_rows(p, value[1:])
                    if reads[p]:
                        fill_local(state[key], [f["optimizer"][name][key] for f in files])
                else:
                    state[key] = _placed(value, key, p, group_of[p])
            if state:
                optimizer.state[p] = state
        self._send_to_replicas(names, optimizer)
        return step, skeleton[1]

    @torch.no_grad()  # into the parameters themselves: under autograd, the next backward warned of it
    def _send_to_replicas(self, names: dict, optimizer) -> None:
        """The rank that read a slice sends it to the ranks that hold it too, in one order on every rank:
        parameters in model order, each followed by its optimizer tensors. A whole tensor (DDP's, and
        the vectors FSDP2 leaves whole) goes from rank 0 to every rank; a shard from its first replica
        to HYBRID_SHARD's other replicas."""
        if self.topo.world_size == 1:
            return
        fsdp_replicas = (self.topo.mesh.get_group("replicate") if self.topo.wrap == "fsdp"
                         and "replicate" in (self.topo.mesh.mesh_dim_names or ()) else None)
        for p in names:
            group = fsdp_replicas if isinstance(p, DTensor) else dist.group.WORLD
            if group is None:
                continue  # every rank read its own slices
            for t in [p] + [v for v in optimizer.state.get(p, {}).values() if v.dim()]:
                dist.broadcast(local_slice(t)[0], group=group, group_src=0)

    @staticmethod
    def _read_marker(path: str, step: int) -> dict:
        """The marker of the set `path` names (a rank's file, which must exist, the {rank} pattern or the marker)."""
        check_named_rank_file(path)
        directory = os.path.dirname(path)
        marker = read_marker(directory, step)
        if "index" in marker:
            check_whole(marker["index"], marker_path(directory, step))
        return marker

    def _open_needed(self, directory: str, marker: dict, names: dict, reads: dict) -> list[dict]:
        """The rank files holding the slices this rank reads (all of them for a set without an index)."""
        step, index = marker["step"], marker.get("index")
        if index is None:
            files = read_sharded(directory, step)
        else:
            slices = {}
            for p, name in names.items():
                local, offset = local_slice(p)
                slices[name] = (offset, local.shape[0] if reads[p] else 0)
            # a rank holding no rows at all (more ranks than rows) still reads one file's header, as does
            # one whose model the checkpoint does not hold: the header's config says how they differ (below)
            other = any(index.get(model_key(name), (None,))[0] != p.shape[0] for p, name in names.items())
            ranks = [0] if other else files_to_open(index, wanted_rows(index, slices), self.topo.rank) or [0]
            files = open_rank_files(directory, step, ranks)
            for r, f in zip(ranks, files):
                check_file(index, f, r, shard_path(directory, step, r))
        self._check_shape(f"checkpoint {shard_path(directory, step, files[0]['rank'])}", files[0]["model_config"])
        return files

    def _check_shape(self, source: str, saved: dict) -> None:
        changes = check_model_shape(source, saved, self.cfg)
        if self.cfg.data_mix is not None and "block_size" in changes:
            raise UserError(f"{source}: a mixture's run can't change block_size on resume (its checkpoint counts each "
                            f"source's rows of {saved['block_size']} tokens): keep block_size={saved['block_size']}")
        if changes and self.topo.is_main:
            said = ", ".join([f"{key} {was} -> {now}" for key, (was, now) in changes.items()] +
                             [f"RoPE base of {move}" for move in rope_base_moves(saved, self.cfg)])
            print(f"note: the context changes on resume: {said}; the weights are the checkpoint's, "
                  f"the data continues after its step (each batch a function of (seed, step))", flush=True)

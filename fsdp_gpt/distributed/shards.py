"""FSDP2's dim-0 shards seen from one rank: which rows it holds, which of them it counts in a sum
over ranks, and state laid out like them. Shared by the checkpoint files, Muon's gather of whole
matrices, clipping's norm and the per-rank statistics."""
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def dim0_shard(rows: int, n: int, i: int) -> tuple[int, int]:
    """(offset, rows) of shard i of n: FSDP2 shards dim 0 like torch.chunk, rank i holding rows
    [i*c, min((i+1)*c, rows)), c = ceil(rows / n), possibly none."""
    chunk = -(-rows // n)
    start = min(i * chunk, rows)
    return start, min(start + chunk, rows) - start


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of a (possibly sharded) tensor: a DTensor gathered (a collective: every rank calls
    it), a plain one itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor: a DTensor's local tensor, a plain one itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def counted_here(t: torch.Tensor) -> bool:
    """Whether this rank counts its slice of t in a sum over every rank, so that each element is
    counted once: the first of the ranks that hold the same slice (its replicas: HYBRID_SHARD's
    replicate dimension; every rank, for a plain tensor, of which rank 0 counts it)."""
    if not isinstance(t, DTensor):
        return dist.get_rank() == 0
    return all(t.device_mesh.get_local_rank(d) == 0 for d, p in enumerate(t.placements) if isinstance(p, Replicate))


def local_slice(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's dim-0 slice of a (possibly FSDP-sharded) tensor and its global offset."""
    if not isinstance(t, DTensor):
        return t, 0
    # DTensor's own arithmetic: an expert-parallel weight is sharded twice along dim 0 (its expert
    # group's share, then FSDP's slice of that), which a sum of per-dimension offsets gets wrong
    _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return local_part(t), offsets[0]


def zero_rows(like: torch.Tensor, row_shape) -> torch.Tensor:
    """Zeros of shape (rows of `like`, *row_shape), sharded and placed as `like` is: optimizer state
    whose slices follow their parameter's rows through saving, loading and resharding (AdamW's
    moments and Muon's momentum: row_shape = like.shape[1:]; NorMuon's moments: (1,)).

    Built as FSDP2 builds its shards (DTensor's constructor, not from_local): from_local moves the
    local tensor to the mesh's device type, so under cpu_offload (a CUDA mesh, host shards) the
    state would land on the GPU beside host parameters, and fused AdamW refuses the mix."""
    shape = torch.Size((like.shape[0], *row_shape))
    if not isinstance(like, DTensor):
        return like.new_zeros(shape)
    local = like.to_local()
    meta = TensorMeta(shape, torch.empty(shape, device="meta").stride(), local.dtype)
    return DTensor(local.new_zeros(local.shape[0], *row_shape), DTensorSpec(like.device_mesh, like.placements, meta),
                   requires_grad=False)

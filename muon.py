"""Muon for the matrices inside the DecoderBlocks, AdamW for every other parameter: one optimizer,
so one state dict for checkpoints. Muon's momentum is sharded like its parameter, as AdamW's
moments are, and reshards the same way.

Muon: a momentum buffer, a Nesterov step, then the update is orthogonalised (its singular values
pushed towards 1 by a Newton-Schulz iteration) and scaled to the RMS an AdamW update has, so
one `learning_rate` and `weight_decay` serve both halves.

Under FSDP2 each rank holds a dim-0 slice of each matrix, and Newton-Schulz needs the whole one.
The matrices are dealt out in rounds over the n ranks of the shard group, matrix j of a round to
rank j: one all-to-all sends every rank's slices to the owners, each owner orthogonalises its
matrix once, a second all-to-all sends the slices back. Replicated matrices (NO_SHARD, DDP) skip
the first exchange (the owner holds the whole matrix) and get the result whole from the second.
Under HYBRID_SHARD each replica's shard group does this for its replica.
"""
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from ckpt_format import dim0_shard

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # a quintic with the steepest slope at 0 (Keller Jordan)
NS_STEPS = 5


def orthogonalise(g: torch.Tensor) -> torch.Tensor:
    """About U V^T for g = U S V^T (the singular values end up near 1, not at it).
    bf16 on GPU (tensor cores); fp32 on CPU, where bf16 matmuls are slow."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(torch.bfloat16 if g.is_cuda else torch.float32)
    tall = x.shape[0] > x.shape[1]
    if tall:  # iterate on the smaller Gram matrix
        x = x.T
    x = x / (x.norm() + 1e-7)  # spectral norm <= Frobenius norm <= 1: inside the iteration's basin
    for _ in range(NS_STEPS):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).to(g.dtype)


def rms_matching_scale(shape: torch.Size) -> float:
    """An orthogonal (rows, cols) matrix has RMS 1/sqrt(max(rows, cols)), an AdamW update about
    0.2 (Moonlight, arXiv:2502.16982): with this scale Muon takes AdamW's learning rate and decay."""
    return 0.2 * math.sqrt(max(shape[0], shape[1]))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class MatrixExchange:
    """Which ranks share the Muon matrices, who holds which rows, and a round's two all-to-alls."""

    def __init__(self, sample: torch.Tensor):
        group, self.sharded = dist.group.WORLD, False  # plain tensors: replicated by DDP, or one process
        if isinstance(sample, DTensor):
            mesh, placements = sample.device_mesh, sample.placements
            wide = [d for d in range(mesh.ndim) if mesh.size(d) > 1]
            sharded = [d for d in wide if placements[d].is_shard(0)]
            self.sharded = bool(sharded)
            group = mesh.get_group((sharded or wide)[0]) if wide else None
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.size = dist.get_world_size(self.group) if self.group else 1
        self.rank = dist.get_rank(self.group) if self.group else 0

    def rows(self, shape: torch.Size, k: int) -> tuple[int, int]:
        """(offset, rows) of a matrix that rank k of the group holds."""
        return dim0_shard(shape[0], self.size, k) if self.sharded else (0, shape[0])

    def _exchange(self, parts: list[torch.Tensor], receive_counts: list[int], like: torch.Tensor) -> torch.Tensor:
        """parts[k] to rank k, receive_counts[k] elements from rank k (both padded with nothing)."""
        parts = parts + [like.new_empty(0)] * (self.size - len(parts))
        receive_counts = receive_counts + [0] * (self.size - len(receive_counts))
        received = like.new_empty(sum(receive_counts))
        dist.all_to_all_single(received, torch.cat([p.reshape(-1) for p in parts]), receive_counts,
                               [p.numel() for p in parts], group=self.group)
        return received

    def to_owners(self, slices: list[torch.Tensor], shapes: list[torch.Size]) -> torch.Tensor | None:
        """This rank's slices of a round's matrices -> the whole matrix this rank owns (or None)."""
        own = shapes[self.rank] if self.rank < len(shapes) else None
        if not self.sharded:
            return None if own is None else slices[self.rank]
        counts = [] if own is None else [self.rows(own, k)[1] * own[1] for k in range(self.size)]
        received = self._exchange(slices, counts, like=slices[0])
        return None if own is None else received.view(own)

    def from_owners(self, whole: torch.Tensor | None, shapes: list[torch.Size], like: torch.Tensor) -> list[torch.Tensor]:
        """The matrix this rank owns, updated -> this rank's slice of each matrix of the round."""
        if self.size == 1:
            return [whole]
        parts = [] if whole is None else [whole[o:o + n] for o, n in (self.rows(whole.shape, k) for k in range(self.size))]
        rows = [self.rows(shape, self.rank)[1] for shape in shapes]
        counts = [n * shape[1] for n, shape in zip(rows, shapes)]
        received = self._exchange(parts, counts, like)
        return [piece.view(n, shape[1]) for piece, n, shape in zip(received.split(counts), rows, shapes)]


class MuonWithAdamW(torch.optim.Optimizer):
    """Parameter groups with `muon: True` (2-D matrices) take Muon, the others fused AdamW.

    Muon groups: lr, weight_decay, momentum (Nesterov). AdamW groups: lr, weight_decay, betas, eps.
    `device`: where Newton-Schulz runs (the GPU, also when cpu_offload keeps the matrices on the host).
    """

    def __init__(self, groups: list[dict], lr: float, device: torch.device):
        super().__init__(groups, dict(lr=lr, weight_decay=0.0))
        self.device = device
        matrices = [p for g in self.param_groups if g["muon"] for p in g["params"]]
        self.exchange = MatrixExchange(matrices[0]) if matrices else None

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "no closures: the training loop computes the loss"
        for group in self.param_groups:
            if not group["muon"]:
                self._adamw_step(group)
        # every rank lists the same matrices in the same order: the rounds' collectives line up
        self._muon_step([(p, g) for g in self.param_groups if g["muon"] for p in g["params"] if p.grad is not None])

    def _adamw_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            if not self.state[p]:  # as torch.optim.AdamW(fused=True) keeps it: `step` on the device
                self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                 "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
              [], [s["step"] for s in states], fused=True, amsgrad=False, beta1=beta1, beta2=beta2,
              lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    def _muon_step(self, matrices: list[tuple[torch.Tensor, dict]]) -> None:
        updates = []  # this rank's rows of each matrix's Nesterov momentum
        for p, group in matrices:
            if not self.state[p]:
                self.state[p] = {"momentum_buffer": torch.zeros_like(p)}
            buf, grad, mu = _local(self.state[p]["momentum_buffer"]), _local(p.grad), group["momentum"]
            buf.lerp_(grad, 1 - mu)
            updates.append(grad.lerp(buf, mu))
        n = self.exchange.size if self.exchange else 1
        for start in range(0, len(matrices), n):
            batch, slices = matrices[start:start + n], updates[start:start + n]
            shapes = [p.shape for p, _ in batch]
            whole = self.exchange.to_owners(slices, shapes)
            if whole is not None:  # this rank owns one matrix of the round: orthogonalise it, once
                whole = orthogonalise(whole.to(self.device)).to(whole.device)
            for (p, group), update in zip(batch, self.exchange.from_owners(whole, shapes, like=slices[0])):
                weight = _local(p)
                weight.mul_(1 - group["lr"] * group["weight_decay"])
                weight.add_(update, alpha=-group["lr"] * rms_matching_scale(p.shape))

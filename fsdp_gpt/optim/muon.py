"""Muon for the matrices inside the DecoderBlocks, AdamW for every other parameter: one optimizer,
so one state dict for checkpoints. Muon's momentum is sharded like its parameter, as AdamW's
moments are, and reshards the same way.

Muon: a momentum buffer, a Nesterov step, then the update is orthogonalised (its singular values
pushed towards 1 by a Newton-Schulz iteration) and scaled to the RMS an AdamW update has, so
one `learning_rate` and `weight_decay` serve both halves.

NorMuon (`normuon`, Li et al., arXiv:2510.05491): each row (an output neuron) of the orthogonalised
update is divided by its running RMS, a second moment kept per row, and the whole update is then
scaled to RMS 0.2. The row moments are a (rows, 1) state sharded like their matrix's rows; they
travel with the update as one more column, so the rank that orthogonalises a matrix updates them.

Under FSDP2 each rank holds a dim-0 slice of each matrix, and Newton-Schulz needs the whole one.
Each matrix is orthogonalised once per step, by one rank: the matrices are dealt out in rounds
over all the ranks that share them (MatrixExchange), the slices sent to the owner and back by
all-to-alls in the shard group, and replicas (HYBRID_SHARD, NO_SHARD, DDP) each take a share
of the round and all-gather the results. One process (nothing to exchange) orthogonalises the
matrices of each shape together, batched: 4 calls a step instead of 48 at GPT-2 124M. A mixture's
stacked experts (experts, rows, cols) are sharded along the experts: every rank holds whole expert
matrices and orthogonalises each of its own, batched, with no communication (replicas compute
the same).
"""
import math
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from fsdp_gpt.distributed.shards import dim0_shard, local_part, zero_rows
from fsdp_gpt.compat import all_gather_flat
from fsdp_gpt.distributed.precision import native_bf16
from fsdp_gpt.moe import per_expert_dims

# muon_coefficients: each iteration's (a, b, c) of x <- a x + (b G + c G^2) x, G = x x^T, and the
# margin the start's norm leaves below 1
NS_COEFFICIENTS = {
    # Keller Jordan's quintic, the same each time: the steepest slope at 0
    "quintic": ([(3.4445, -4.7750, 2.0315)] * 5, 1.0),
    # Polar Express (Amsel, Persson, Musco, Gower; arXiv:2505.16932): a polynomial per iteration,
    # optimal for 5 iterations with a 2% margin, as modded-nanogpt uses them
    "polar_express": ([(8.156554524902461, -22.48329292557795, 15.878769915207462),
                       (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                       (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                       (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                       (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)], 1.02),
}
NS_STEPS = 5  # iterations of every set
ADAMW_UPDATE_RMS = 0.2  # what Muon's updates are scaled to (rms_matching_scale)


def orthogonalise(g: torch.Tensor, coefficients: str = "quintic") -> torch.Tensor:
    """About U V^T for g = U S V^T (the singular values end up near 1, not at it); each matrix of
    a batch (..., rows, cols) on its own. bf16 on GPUs with bf16 tensor cores; fp32 on CPU and
    older GPUs, where bf16 is slow (emulated)."""
    steps, margin = NS_COEFFICIENTS[coefficients]
    x = g.to(torch.bfloat16 if native_bf16(g.device) else torch.float32)
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    # spectral norm <= Frobenius norm <= 1: inside the iteration's basin
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * margin + 1e-7)
    for a, b, c in steps:
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).to(g.dtype)


def neuron_normalised(x: torch.Tensor, coefficients: str, beta2: float) -> torch.Tensor:
    """NorMuon on a whole matrix. x: (rows, cols + 1), Muon's update and, as its last column, each
    row's second moment. -> the orthogonalised update, each row divided by its RMS's running mean,
    at RMS 0.2 as a whole (AdamW's, as rms_matching_scale), and the new moments as the last column.
    No bias correction: a factor common to all rows, which the final scaling cancels."""
    update = orthogonalise(x[..., :-1], coefficients).float()
    moment = x[..., -1:].float().lerp(update.square().mean(dim=-1, keepdim=True), 1 - beta2)
    update = update / (moment.sqrt() + 1e-8)
    update = update * (ADAMW_UPDATE_RMS / update.square().mean(dim=(-2, -1), keepdim=True).sqrt().clamp_min(1e-10))
    return torch.cat([update, moment], dim=-1).to(x.dtype)


# the blocks' matrices that are a direction per output, not a map to orthogonalise: an MoE router's (a score
# per expert) and a linear layer's decay and write-strength projections (a gate per value head)
NOT_MUON = (".value_embed.", ".router.", ".in_proj_a.", ".in_proj_b.")


def is_muon_matrix(name: str, shape: torch.Size) -> bool:
    """Muon's parameters: the 2-D weights inside the DecoderBlocks (named as model.GPT names them)
    and a mixture's stacked experts' matrices (3-D: a matrix per expert); the value embeddings' tables, an
    MoE router and a linear layer's gates (NOT_MUON) and its convolution (3-D) take AdamW,
    as every vector does (biases, the experts' a vector per expert, norms, attention sinks)."""
    if not name.startswith("blocks.") or any(part in name for part in NOT_MUON):
        return False
    return per_expert_dims(name, shape) == 2


def newton_schulz_flops(shape: torch.Size) -> int:
    """FLOPs of orthogonalise() on one matrix (or on each of a stack of them): per iteration X X^T,
    gram @ gram and (...) @ X."""
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * NS_STEPS * (4 * m * m * n + 2 * m ** 3)


def newton_schulz_share(model: torch.nn.Module, tokens_per_step: int, group: int = 1, ranks: int = 1) -> float:
    """Muon's extra compute, which does not grow with the batch: the busiest rank's Newton-Schulz
    FLOPs per step (matrix k goes to rank k % group of each group that shares the matrices) over
    its share of the step's training FLOPs (split over all ranks). Stacked experts: each rank its
    own share of them."""
    muon = [p.shape for name, p in model.named_parameters() if is_muon_matrix(name, p.shape)]
    ns = [newton_schulz_flops(shape) for shape in muon if len(shape) == 2]
    experts = sum(newton_schulz_flops(shape) for shape in muon if len(shape) == 3) / ranks
    busiest = max(sum(ns[j::group]) for j in range(group)) + experts
    return busiest / (model.flops_per_token() * tokens_per_step / ranks)


def rms_matching_scale(shape: torch.Size) -> float:
    """An orthogonal (rows, cols) matrix has RMS 1/sqrt(max(rows, cols)), an AdamW update about
    0.2 (Moonlight, arXiv:2502.16982): with this scale Muon takes AdamW's learning rate and decay."""
    return ADAMW_UPDATE_RMS * math.sqrt(max(shape[-2], shape[-1]))


class MatrixExchange:
    """Who shares the Muon matrices: the shard group (each rank a dim-0 slice of every matrix) and
    the replica group (ranks holding the same slices: HYBRID_SHARD's replicas, NO_SHARD, DDP).

    A round takes up to shards x replicas matrices: replica r's shard group orthogonalises the
    round's r-th share, matrix j of it on shard rank j (all-to-all of the slices to that owner
    and back), then the replicas exchange their shares' slices (an all-gather).
    """

    def __init__(self, sample: torch.Tensor, transform):
        self.transform = transform  # a whole matrix -> its update (whole), run by the matrix's owner
        self.shard_group = self.replica_group = None  # None: a group of one
        if isinstance(sample, DTensor):
            mesh = sample.device_mesh
            for d, placement in enumerate(sample.placements):
                if mesh.size(d) > 1:
                    if placement.is_shard(0):
                        self.shard_group = mesh.get_group(d)
                    else:
                        self.replica_group = mesh.get_group(d)
        elif dist.get_world_size() > 1:  # a plain tensor on several ranks: DDP's replicas
            self.replica_group = dist.group.WORLD
        self.shards, self.shard_rank = _size_and_rank(self.shard_group)
        self.replicas, self.replica_rank = _size_and_rank(self.replica_group)
        self.round = self.shards * self.replicas

    def transformed(self, slices: list[torch.Tensor], shapes: list[torch.Size], device: torch.device) -> list[torch.Tensor]:
        """This rank's slices of up to `round` matrices -> its slices of them transformed."""
        first = self.replica_rank * self.shards
        share = self._in_shard_group(slices[first:first + self.shards], shapes[first:first + self.shards], device)
        return self._across_replicas(share, shapes, like=slices[0])

    def _rows(self, shape: torch.Size, k: int) -> int:
        return dim0_shard(shape[0], self.shards, k)[1]

    def _in_shard_group(self, slices: list[torch.Tensor], shapes: list[torch.Size], device: torch.device) -> list[torch.Tensor]:
        if not shapes:  # a short last round leaves this replica nothing to do
            return []
        own = shapes[self.shard_rank] if self.shard_rank < len(shapes) else None
        # the slices of matrix j to its owner, shard rank j: each owner receives its matrix whole
        counts = [self._rows(own, k) * own[1] for k in range(self.shards)] if own is not None else []
        received = self._all_to_all(slices, counts, like=slices[0])
        whole = self.transform(received.view(own).to(device)).to(received.device) if own is not None else None
        # and back: rank k receives its rows of every matrix of the share
        parts = [] if whole is None else list(whole.split([self._rows(own, k) for k in range(self.shards)]))
        rows = [self._rows(shape, self.shard_rank) for shape in shapes]
        counts = [n * shape[1] for n, shape in zip(rows, shapes)]
        back = self._all_to_all(parts, counts, like=slices[0])
        return [piece.view(n, shape[1]) for piece, n, shape in zip(back.split(counts), rows, shapes)]

    def _all_to_all(self, parts: list[torch.Tensor], receive_counts: list[int], like: torch.Tensor) -> torch.Tensor:
        """parts[k] to shard rank k, receive_counts[k] elements from it (missing ones: nothing)."""
        if self.shards == 1:
            return parts[0].reshape(-1) if parts else like.new_empty(0)
        parts = parts + [like.new_empty(0)] * (self.shards - len(parts))
        receive_counts = receive_counts + [0] * (self.shards - len(receive_counts))
        received = like.new_empty(sum(receive_counts))
        dist.all_to_all_single(received, torch.cat([p.reshape(-1) for p in parts]), receive_counts,
                               [p.numel() for p in parts], group=self.shard_group)
        return received

    def _across_replicas(self, share: list[torch.Tensor], shapes: list[torch.Size], like: torch.Tensor) -> list[torch.Tensor]:
        if self.replicas == 1:
            return share
        # replica r's share: this rank's rows of matrices r*shards .. (r+1)*shards - 1, padded alike
        counts = [self._rows(shape, self.shard_rank) * shape[1] for shape in shapes]
        totals = [sum(counts[r * self.shards:(r + 1) * self.shards]) for r in range(self.replicas)]
        send = like.new_zeros(max(totals))
        if share:
            send[:totals[self.replica_rank]] = torch.cat([t.reshape(-1) for t in share])
        gathered = like.new_empty(self.replicas * len(send))
        all_gather_flat(gathered, send, group=self.replica_group)
        flat = torch.cat([gathered[r * len(send):r * len(send) + totals[r]] for r in range(self.replicas)])
        return [piece.view(-1, shape[1]) for piece, shape in zip(flat.split(counts), shapes)]


def _size_and_rank(group) -> tuple[int, int]:
    return (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)


class MuonWithAdamW(torch.optim.Optimizer):
    """Parameter groups with `muon: True` (2-D matrices) take Muon, the others fused AdamW.

    Muon groups: lr, weight_decay, momentum (Nesterov). AdamW groups: lr, weight_decay, betas, eps.
    `device`: where Newton-Schulz runs (the GPU, also when cpu_offload keeps the matrices on the host).
    `coefficients`: NS_COEFFICIENTS' set. `cautious`: decay a matrix's weight only where its update
    has the same sign, so where both pull it towards zero (cautious weight decay, arXiv:2510.12402,
    as modded-nanogpt does). `normuon`: None, or NorMuon's second-moment decay (beta2). All three
    are the launched config's, not the checkpoint's param groups'.
    """

    def __init__(self, groups: list[dict], lr: float, device: torch.device, coefficients: str = "quintic",
                 cautious: bool = False, normuon: float | None = None):
        super().__init__(groups, dict(lr=lr, weight_decay=0.0))
        self.device, self.cautious, self.normuon = device, cautious, normuon is not None
        transform = (partial(orthogonalise, coefficients=coefficients) if normuon is None else
                     partial(neuron_normalised, coefficients=coefficients, beta2=normuon))
        matrices = [p for g in self.param_groups if g["muon"] for p in g["params"] if p.dim() == 2]
        self.exchange = MatrixExchange(matrices[0], transform)  # every GPT has block matrices
        self.transform = transform

    @torch.no_grad()
    def step(self, closure=None):
        """One update; where `self.found_inf` (set by guard.NonFiniteGuard) is 1, none: every
        parameter and state keeps its value, decided on the device."""
        assert closure is None, "no closures: the training loop computes the loss"
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            if not group["muon"]:
                self._adamw_step(group, found_inf)
        # every rank lists the same matrices in the same order: the rounds' collectives line up
        self._muon_step([(p, g) for g in self.param_groups if g["muon"] for p in g["params"] if p.grad is not None],
                        None if found_inf is None else found_inf == 0)

    def _adamw_step(self, group: dict, found_inf: torch.Tensor | None) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            if not self.state[p]:  # as torch.optim.AdamW(fused=True) keeps it: `step` on the device
                self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                 "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        # each DTensor's local shard, as AdamWOnShards (build.py) hands them: no DTensor dispatch
        adamw([local_part(p) for p in params], [local_part(p.grad) for p in params],
              [local_part(s["exp_avg"]) for s in states], [local_part(s["exp_avg_sq"]) for s in states],
              [], [s["step"] for s in states], fused=True, amsgrad=False, beta1=beta1, beta2=beta2,
              lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
              found_inf=found_inf)

    def _muon_step(self, matrices: list[tuple[torch.Tensor, dict]], keep: torch.Tensor | None) -> None:
        """keep: None, or a 0-dim bool on the device, False where the step is to change nothing."""
        updates = []  # this rank's rows of each matrix's Nesterov momentum (and NorMuon's row moments)
        for p, group in matrices:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            if self.normuon and "row_second_moment" not in state:  # also a Muon checkpoint resumed with NorMuon
                state["row_second_moment"] = zero_rows(p, (*p.shape[1:-1], 1))
            buf, grad, mu = local_part(state["momentum_buffer"]), local_part(p.grad), group["momentum"]
            _assign(buf, buf.lerp(grad, 1 - mu), keep)
            update = grad.lerp(buf, mu)
            updates.append(torch.cat([update, local_part(state["row_second_moment"])], dim=-1) if self.normuon else update)
        shared = [i for i, (p, _) in enumerate(matrices) if p.dim() == 2]  # exchanged; stacked experts are local
        shapes = [(matrices[i][0].shape[0], matrices[i][0].shape[1] + self.normuon) for i in shared]
        if self.exchange.round == 1:  # one process holds them whole: one shape's together, batched
            for same in _by_shape(shared, shapes):
                stacked = torch.stack([updates[i] for i in same])
                for i, update in zip(same, self.transform(stacked.to(self.device)).to(stacked.device)):
                    self._apply(*matrices[i], update, keep)
            shared = []
        for start in range(0, len(shared), self.exchange.round):
            batch = shared[start:start + self.exchange.round]
            results = self.exchange.transformed([updates[i] for i in batch], shapes[start:start + len(batch)], self.device)
            for i, update in zip(batch, results):
                self._apply(*matrices[i], update, keep)
        for i, (p, group) in enumerate(matrices):
            if p.dim() == 3:
                self._apply(p, group, self.transform(updates[i].to(self.device)).to(updates[i].device), keep)

    def _apply(self, p: torch.Tensor, group: dict, update: torch.Tensor, keep: torch.Tensor | None) -> None:
        """This rank's rows of p moved by their rows of the orthogonalised update."""
        scale = 1.0  # NorMuon's update is at RMS 0.2 already
        if self.normuon:
            moment, update = update[..., -1:], update[..., :-1]
            _assign(local_part(self.state[p]["row_second_moment"]), moment, keep)
        else:
            scale = rms_matching_scale(p.shape)
        weight = local_part(p)
        decay = group["lr"] * group["weight_decay"]
        if self.cautious:  # elementwise on this rank's rows: no communication
            decay = decay * (update * weight > 0)
        new = torch.add(weight * (1 - decay), update, alpha=-group["lr"] * scale)
        _assign(weight, new, keep)


def _by_shape(indices: list[int], shapes: list[tuple[int, int]]) -> list[list[int]]:
    """The indices grouped by their matrices' shapes, in the order shapes first appear."""
    groups = {}
    for i, shape in zip(indices, shapes):
        groups.setdefault(shape, []).append(i)
    return list(groups.values())


def _assign(target: torch.Tensor, new: torch.Tensor, keep: torch.Tensor | None) -> None:
    """target = new, or where keep is False (a skipped step), target as it was."""
    target.copy_(new if keep is None else torch.where(keep, new, target))

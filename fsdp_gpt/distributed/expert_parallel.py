"""Expert parallelism (ep_size): each MoE layer's experts split over the ep_size ranks of an expert
group, the tokens sent to the ranks holding their experts and back.

The ranks of a group are consecutive (rank j of group g holds experts j*E/ep .. (j+1)*E/ep - 1 of
every MoE layer). The stacked expert weights are DTensors sharded along the experts over the
group's mesh dimension ("ep"); FSDP shards them further over what is left ("efsdp": the ranks with
the same j), so a rank keeps (E/ep) / (world/ep) experts between steps and gathers only its group
member's E/ep for the forward. Every other parameter is FSDP's over all ranks, as without experts.

Gradients: a rank's loss is the mean over its own tokens and FSDP averages over the world, so a
dense weight's gradient is (1/world) x the sum over ranks. An expert's local gradient already sums
the contributions of every token its group sent it (the all-to-all's backward brings them), and
FSDP reduces it over the world/ep ranks of its efsdp group: divided by world, not world/ep, it is the
same average (set_gradient_divide_factor; pytorch#160285's factor ep too large otherwise).

Per layer and direction: one all-to-all of the counts (E integers) and one of the rows, whatever the
routing: a rank that sends or receives no row still takes part (splits of zero).
"""
import logging

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from fsdp_gpt.compat import average_over_gloo
from fsdp_gpt.distributed.launch import Topology
from fsdp_gpt.model import GPT
from fsdp_gpt.moe import MoE, GroupedExperts


# FSDP's mesh for the experts by the dimensions of everyone else's: the flat mesh's ranks that hold
# the same experts, and HYBRID_SHARD's replicas of them beside
EXPERT_FSDP_DIMS = {1: ("efsdp",), 2: ("replicate", "efsdp")}


class UnmergeableGathers(logging.Filter):
    """Drops one note of torch's DTensor: that gathering an expert weight whole (a full checkpoint)
    takes two all-gathers, efsdp's then ep's, where flattened dimensions would take one. Here they
    can't: the weight's rows lie in ep-major order, the ranks in efsdp-major order, and torch says so
    itself ("not possible to merge non-ascending order all_gather"), so the note asks nothing a user
    could do. Every other message of DTensor's, this one for any other reason included, stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "not possible to merge non-ascending order all_gather" not in record.getMessage()


UNMERGEABLE_GATHERS = UnmergeableGathers()


class LocalExperts(GroupedExperts):
    """The experts of this rank's share of the group: the local part of the weights' DTensors (FSDP
    gathers them over efsdp before forward; the ep dimension stays split)."""

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: p.to_local() for name, p in self.named_parameters()}


class ExpertParallel:
    """MoE.run_experts across an expert group: rows grouped by (global) expert in, their results out."""

    def __init__(self, ep_mesh: DeviceMesh):
        self.group, self.ep, self.rank = ep_mesh.get_group(), ep_mesh.size(), ep_mesh.get_local_rank()

    def splits(self, per_rank: torch.Tensor, received: torch.Tensor, rows: int) -> tuple[list[int], list[int]]:
        """The rows this rank sends each rank of its group, and receives from each: host integers, one sync for
        the layer's two exchanges. A dry run's counts are fake, without values to read: there each rank sends
        every rank its even share of its rows and receives as much (the routing taken as balanced)."""
        if is_fake(per_rank):
            even = [rows // self.ep + (i < rows % self.ep) for i in range(self.ep)]
            return even, [even[self.rank]] * self.ep
        send, receive = torch.stack([per_rank.sum(1), received.sum(1)]).tolist()
        return send, receive

    @torch.compiler.disable  # eager: traced, the host split sizes would recompile the block at every new routing
    def __call__(self, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (rows, width) grouped by expert, counts (experts,) -> (rows, width) in x's order."""
        per_rank = counts.view(self.ep, -1)  # (ep, local experts): what I send to each rank, per its expert
        received = torch.empty_like(per_rank)  # (ep, local experts): what each rank sends me, per my expert
        dist.all_to_all_single(received, per_rank, group=self.group)
        send, receive = self.splits(per_rank, received, x.shape[0])
        rows = all_to_all_single_autograd(x, receive, send, self.group)  # (sender, my expert)-ordered
        # regroup by my expert (a stable sort keeps each sender's rows in order), compute, undo
        local_experts = received.shape[1]
        expert_of_row = torch.arange(local_experts, device=x.device).repeat(self.ep).repeat_interleave(
            received.flatten(), output_size=sum(receive))  # output_size: no second sync
        order = expert_of_row.argsort(stable=True)
        out = experts(rows[order], received.sum(0))  # through __call__: FSDP gathers the group's experts
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return all_to_all_single_autograd(out[inverse], send, receive, self.group)


def _sharded_over(p: torch.Tensor, ep_mesh: DeviceMesh) -> torch.nn.Parameter:
    """p (experts, ...) as a DTensor of rank j's experts over the ep mesh. The model is on the meta
    device here: each rank takes its slice, nothing is sent (weights come after sharding)."""
    local = p.chunk(ep_mesh.size())[ep_mesh.get_local_rank()]
    return torch.nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=p.shape,
                                                 stride=p.stride()), requires_grad=p.requires_grad)


def apply_expert_parallel(gpt: GPT, ep_mesh: DeviceMesh) -> None:
    """Every MoE layer's experts split over the ep mesh, and its tokens dispatched to them."""
    dispatch = ExpertParallel(ep_mesh)
    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(UNMERGEABLE_GATHERS)  # added once
    for moe in gpt.moe_layers():
        for name, p in list(moe.experts.named_parameters()):  # every stacked tensor: weights and biases
            setattr(moe.experts, name, _sharded_over(p, ep_mesh))
        moe.experts.__class__ = LocalExperts
        moe.run_experts = dispatch


def shard_experts(moe: MoE, topo: Topology, reshard: bool, shard_args: dict) -> None:
    """One MoE layer's experts as an FSDP unit of their own, sharded over the ranks that hold the same
    experts (efsdp, beside HYBRID_SHARD's replicas), their gradients averaged over the world."""
    unit = fully_shard(moe.experts, reshard_after_forward=reshard,
                       **(shard_args | dict(mesh=topo.expert_mesh[EXPERT_FSDP_DIMS[topo.mesh.ndim]])))
    unit.set_gradient_divide_factor(topo.world_size)
    # not where no rank shares these experts (ep_size = the shard group): a group of one
    average_over_gloo(unit, topo.device, reduces=topo.expert_mesh["efsdp"].size() > 1)

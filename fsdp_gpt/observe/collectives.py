"""The collectives a step issues, counted where they are dispatched (a TorchDispatchMode sees each c10d and
functional collective): by kind and process group, the calls and the bytes each rank sends. A dry run counts
them over fake tensors (plan.py); tests/plan_probe.py over a real run's, with CountedCollectives.
"""
import collections

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup
from torch.utils._python_dispatch import TorchDispatchMode

c10d, funcol, funcol_autograd = torch.ops.c10d, torch.ops._c10d_functional, torch.ops._c10d_functional_autograd

# op -> (kind, the tensor whose bytes the collective is about: "out" the result, or an argument's index), and
# where its process group is (an argument's index; a functional collective's is the group's name)
COLLECTIVES = {
    c10d._allgather_base_.default: ("all_gather", 0, 2),  # (output, input, group): the gathered buffer
    c10d.allgather_into_tensor_coalesced_.default: ("all_gather", 0, 2),
    c10d._reduce_scatter_base_.default: ("reduce_scatter", 1, 2),  # (output, input, group): the buffer reduced
    c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", 1, 2),
    c10d.allreduce_.default: ("all_reduce", 0, 1),  # ([tensors], group)
    c10d.alltoall_base_.default: ("all_to_all", 1, 2),  # (output, input, group): what this rank sends
    c10d.alltoall_.default: ("all_to_all", 1, 2),
    c10d.send.default: ("send", 0, 1),  # ([tensors], group, peer)
    c10d.broadcast_.default: ("broadcast", 0, 1),
    funcol.all_gather_into_tensor.default: ("all_gather", "out", 2),  # (input, group size, group name)
    funcol_autograd.all_gather_into_tensor.default: ("all_gather", "out", 2),
    funcol.reduce_scatter_tensor.default: ("reduce_scatter", 0, 3),  # (input, op, group size, group name)
    funcol_autograd.reduce_scatter_tensor.default: ("reduce_scatter", 0, 3),
    funcol.all_reduce.default: ("all_reduce", 0, 2),  # (input, op, group name)
    funcol.all_to_all_single.default: ("all_to_all", 0, 3),  # (input, output sizes, input sizes, group name)
    funcol_autograd.all_to_all_single.default: ("all_to_all", 0, 3),
}
# what each rank sends of a collective's bytes over n ranks, as rings and pairwise exchanges move them
SENT = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
        "all_reduce": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "send": lambda n: 1.0,
        "broadcast": lambda n: 1.0}


def tensor_bytes(tensors) -> int:
    tensors = tensors if isinstance(tensors, (list, tuple)) else [tensors]
    return sum(t.numel() * t.element_size() for t in tensors)


def group_of(where) -> ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(where) if isinstance(where, str) else ProcessGroup.unbox(where)


class Collectives:
    """Each collective a step issues, summed by kind and process group: calls, and the bytes each rank sends (of
    an all-gather's gathered buffer, a reduce-scatter's reduced one, an all-reduce's, the rows an all-to-all
    sends, each in its own dtype)."""

    def __init__(self):
        self.calls, self.sent = collections.Counter(), collections.Counter()
        self.groups = {}  # group name -> the group

    def record(self, func, args, out) -> None:
        if func not in COLLECTIVES:
            return
        kind, which, where = COLLECTIVES[func]
        group = group_of(args[where])
        payload = tensor_bytes(out if which == "out" else args[which])
        key = (kind, group.group_name)
        self.groups[group.group_name] = group
        self.calls[key] += 1
        self.sent[key] += payload * SENT[kind](group.size())

    def by_kind(self) -> dict[str, float]:
        """GB each rank sends a step, by kind of collective."""
        kinds = collections.Counter()
        for (kind, _), sent in self.sent.items():
            kinds[kind] += sent / 1e9
        return dict(kinds)


class CountedCollectives(TorchDispatchMode):
    """Collectives counted over real tensors (tests/plan_probe.py measures a real run's step with it)."""

    def __init__(self):
        super().__init__()
        self.collectives = Collectives()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.collectives.record(func, args, out)
        return out

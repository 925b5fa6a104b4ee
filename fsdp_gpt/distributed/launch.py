"""Process group lifetime: who this process is, the device mesh, and how every entry point ends.

Every script that starts a process group (the trainer, the probes the tests launch) runs its
body through `run_entry_point`, which turns the outcome into an exit code and leaves the
process with `os._exit` after all I/O is done. Why not a normal interpreter exit:

  FSDP's meshes and DTensors keep gloo process groups alive past `destroy_process_group`, so
  their worker threads outlive it. A worker releases a finished collective's work object (and
  the tensors it holds) a moment after the caller's wait() returned. If that moment falls in
  interpreter finalisation, the decref needs the GIL, CPython ends the thread with
  pthread_exit, the unwind crosses the work's noexcept destructor, and std::terminate aborts
  the process: "terminate called without an active exception", SIGABRT, a failed job after a
  finished run (seen in gdb on this machine; pytorch#179291 tried to fix it inside torch and
  was abandoned). Leaving without finalisation gives those threads nothing to trip on.
"""
import atexit
import os
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Callable, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_gpt.compat import unflatten
from fsdp_gpt.config import UserError, exit_code
from fsdp_gpt.distributed.context_parallel import context_groups
from fsdp_gpt.distributed.gpus import PLANNED
from fsdp_gpt.distributed.precision import Chip, pick_device
from fsdp_gpt.resilience.watchdog import FIRED, nccl_failure_settings, process_group_timeout

# strategy -> (mesh layout, reshard parameters after forward)
STRATEGY_TABLE = {
    "FULL_SHARD": ("flat", True),
    "SHARD_GRAD_OP": ("flat", False),
    "NO_SHARD": ("replicate", False),  # 2-D mesh (world, 1): shards of one rank = replication
    "HYBRID_SHARD": ("hybrid", True),
    "HYBRID_SHARD_ZERO2": ("hybrid", False),
}


@dataclass
class Topology:
    """Who this process is, computed once and passed down. Every rank is data-parallel, but for the
    cp_size ranks of a context-parallel group, which share rows (context_parallel.py)."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    wrap: str  # "fsdp", "ddp" or "none": see wrapping()
    mesh: DeviceMesh | None  # None unless wrap == "fsdp"
    store: dist.Store | None = None  # the group's store (the watchdog's channel)
    cp_size: int = 1
    cp_group: dist.ProcessGroup | None = None  # this rank's context-parallel group (cp_size > 1)
    # ep_size > 1: the mesh the others are cut from, with dimensions "efsdp" and "ep" (and "replicate"
    # under HYBRID_SHARD): the experts' own group and FSDP's sharding of them (expert_parallel.py)
    expert_mesh: DeviceMesh | None = None
    planned: Chip | None = None  # a dry run's: the GPU it plans for; None: the device's own (chip)

    @property
    def chip(self) -> Chip:
        """What start-up decides by about the device (precision.Chip)."""
        return self.planned or Chip.of(self.device)

    @property
    def ep_size(self) -> int:
        return self.expert_mesh["ep"].size() if self.expert_mesh is not None else 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """Which share of each step's rows this rank computes (with its context-parallel group)."""
        return self.rank // self.cp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.cp_size

    @property
    def cp_rank(self) -> int:
        """Which slice of its rows' tokens this rank computes."""
        return self.rank % self.cp_size

    def describe_mesh(self) -> str:
        """"(replicate=2, shard=4)", or "none" (DDP, one process)."""
        if self.mesh is None:
            return "none"
        return "(" + ", ".join(f"{name}={size}" for name, size in zip(self.mesh.mesh_dim_names, self.mesh.shape)) + ")"


def wrapping(cfg, world_size: int) -> str:
    """"fsdp", "ddp", or "none": one process holding the whole model has nothing to shard or
    reduce, and FSDP2's per-unit work (copies in and out of the sharded storage, DTensor
    dispatch) cost it up to 13% of a small model's step. cpu_offload still needs FSDP, and
    force_fsdp asks for it (to exercise FSDP2 itself on one device)."""
    if world_size == 1 and not (cfg.cpu_offload or cfg.force_fsdp):
        return "none"
    return "fsdp" if cfg.fsdp else "ddp"


def backend_for(device_type: str, cpu_offload: bool) -> str:
    """NCCL on GPUs, with gloo beside it when host tensors take part in collectives (offloaded
    gradients' norm in clipping, fp16's overflow agreement); gloo alone on CPU."""
    if device_type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"


def bound_device(device: torch.device, backend: str) -> torch.device | None:
    """The GPU that NCCL's communicator is bound to at init (device_id), or None. Bound, each
    barrier knows its GPU and DeviceMesh makes its sub-groups with ncclCommSplit (split_group).
    The two-backend group of cpu_offload stays unbound: split_group of a cuda:nccl,cpu:gloo
    parent asserted on torch 2.8 (pytorch#159200), and an unbound parent makes DeviceMesh build
    the HYBRID and NO_SHARD meshes' sub-groups with new_group, which takes both backends."""
    return device if backend == "nccl" else None


def init_distributed(cfg) -> Topology:
    rank, world, local_rank, local_world, device, backend, store = (simulated if cfg.dry_run else launched)(cfg)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=process_group_timeout(cfg),
                            device_id=bound_device(device, backend))
    wrap = wrapping(cfg, world)
    if world % cfg.cp_size:
        raise UserError(f"cp_size={cfg.cp_size} must divide the world size {world}: launch a multiple of {cfg.cp_size} "
                        f"ranks")
    cp_group = context_groups(world, cfg.cp_size) if cfg.cp_size > 1 else None
    mesh, expert_mesh = build_mesh(cfg, world, local_world, device, wrap)
    planned = PLANNED[cfg.dry_run_gpu].chip if cfg.dry_run else None
    return Topology(rank, world, local_rank, local_world, device, wrap, mesh, store, cfg.cp_size, cp_group, expert_mesh,
                    planned)


def launched(cfg) -> tuple:
    """(rank, world size, local rank, local world size, device, backend, store) of a process torchrun
    (or a plain `python`) started."""
    if "RANK" not in os.environ and int(os.environ.get("SLURM_NTASKS", 1)) > 1:
        # srun started copies of this script without torchrun: each would train alone, writing the same files
        raise UserError(f"started as {os.environ['SLURM_NTASKS']} SLURM tasks without torchrun: start one task per "
                        f"node that runs torchrun (the README's SLURM script)")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = pick_device(local_rank)
    backend = backend_for(device.type, cfg.cpu_offload)
    if device.type == "cuda":  # read by NCCL's process group when it is made
        for name, value in nccl_failure_settings(cfg.checkpoint_dir).items():
            os.environ.setdefault(name, value)
    timeout = process_group_timeout(cfg)  # a backstop: the watchdog bounds each phase
    if "MASTER_ADDR" in os.environ:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
                              timeout=timeout)
        # a restarted group gets fresh keys: stale peer addresses of the last attempt break gloo
        store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}", store)
    else:  # plain `python train_fsdp.py`: a group of one
        store = dist.HashStore()
    return rank, world, local_rank, local_world, device, backend, store


def simulated(cfg) -> tuple:
    """launched()'s figures for a dry run (--dry_run=NODESxGPUS, observe/plan.py): this one process is rank 0 of
    that world, in torch's fake process group, whose collectives send nothing (and whose every rank's outcome is
    this one's: agree); its tensors are the CPU's, fake ones from the weights on."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # importing it registers the fake backend
    nodes, gpus = cfg.dry_run_world()
    return 0, nodes * gpus, 0, gpus, torch.device("cpu"), "fake", FakeStore()


def simulated_group() -> bool:
    """Whether the process group is a dry run's, where this process stands for every rank."""
    return dist.get_backend() == "fake"


def build_mesh(cfg, world: int, local_world: int, device: torch.device,
               wrap: str) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """FSDP's mesh, and with ep_size > 1 the same mesh with its shard dimension unflattened into
    (efsdp, ep) (FSDP needs both views of one mesh to shard a weight the expert group shards already)."""
    if not cfg.fsdp:
        return None, None
    layout, _ = STRATEGY_TABLE[cfg.sharding_strategy]
    shard = world if layout == "flat" else 1 if layout == "replicate" else (cfg.fsdp_size or local_world)
    if shard > world:
        raise UserError(f"{cfg.sharding_strategy} with fsdp_size={shard} needs at least {shard} ranks, launched "
                        f"{world}: launch a multiple of {shard} ranks or set --fsdp_size to a divisor of {world}")
    if world % shard:
        raise UserError(f"fsdp_size={shard} must divide the world size {world} for {cfg.sharding_strategy}: "
                        f"launch a multiple of {shard} ranks or set --fsdp_size to a divisor of {world}")
    ep = cfg.ep_size
    if shard % ep:
        within = "the world size" if layout == "flat" else f"the shard group's {shard} ranks (fsdp_size)"
        raise UserError(f"ep_size={ep} must divide {within} {shard}: each expert group shares one shard group")
    if wrap != "fsdp":  # one process runs unwrapped: the layout is checked all the same
        return None, None
    dims, names = ((world,), ("shard",)) if layout == "flat" else ((world // shard, shard), ("replicate", "shard"))
    mesh = init_device_mesh(device.type, dims, mesh_dim_names=names)
    if ep == 1:
        return mesh, None
    # the shard dimension seen as (efsdp, ep): expert groups of consecutive ranks, like context groups
    experts = unflatten(mesh, len(dims) - 1, (shard // ep, ep), ("efsdp", "ep"))
    if experts is None:
        raise UserError(f"ep_size={ep} needs a newer torch than {torch.__version__} (DeviceMesh._unflatten, tested on "
                        f"2.13): ep_size must be 1 here")
    return mesh, experts


def agree(fn):
    """Run fn on every rank; if any rank failed, every rank raises the first failure as a UserError.

    Where ranks read files on their own (data, checkpoints), one rank's failure must not leave the
    others waiting in their next collective until its timeout. An unexpected error keeps its
    traceback on the rank that hit it and reaches the others as one line naming that rank.
    A dry run's one process is every rank: its outcome is theirs.
    """
    if simulated_group():
        return fn()
    try:
        result, error = fn(), None
    except UserError as e:
        result, error = None, e
    except Exception as e:  # noqa: BLE001 - passed on to every rank below
        traceback.print_exc()
        result, error = None, UserError(f"rank {dist.get_rank()}: {type(e).__name__}: {e}")
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise first
    return result


def decided_on_rank0(fn):
    """fn's result, computed by rank 0 alone and sent to every rank (what one rank reads or decides for
    all); a failure there reaches every rank (agree), none is left waiting in the broadcast."""
    if simulated_group():  # rank 0, every rank
        return fn()
    result = [agree(lambda: fn() if dist.get_rank() == 0 else None)]
    dist.broadcast_object_list(result, src=0)
    return result[0]


def run_entry_point(body: Callable[[], int | None]) -> NoReturn:
    """Run `body`, then leave with its exit code: what it returns (None: 0), 2 bad input, 1 anything else.

    Returned: every rank meets at a barrier (no rank closes its connections while a peer still
    reads from them), then the group is destroyed. Failed: no collective (peers may be anywhere);
    this process leaves at once, and its closed connections make gloo peers' collectives fail
    (under torchrun the agent stops the others). Either way atexit handlers run while other
    threads may still take the GIL, output is flushed, and the process ends without finalisation.
    """
    returned = []  # the body returned (any exit code): every rank is at the same point
    try:
        # every rank raises the same UserError (config checks run everywhere; launch.agree makes a
        # rank's own failure everyone's): rank 0 alone prints it, so the user reads one line
        code = exit_code(lambda: returned.append(body()) or returned[0], report=os.environ.get("RANK", "0") == "0")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the traceback is printed; the exit code says it failed
        if FIRED.is_set():  # a hang is being reported (peers leaving broke this collective): it ends the process
            threading.Event().wait()
        traceback.print_exc()
        code = 1
    if returned and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

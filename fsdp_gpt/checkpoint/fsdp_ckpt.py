"""Checkpoint manager: saves a run's full or sharded checkpoints and decides which one a resume
takes (ckpt_format.py has the files, ckpt_restore.py reads one into the model), collectives
included: every rank calls every method at the same point.

What a checkpoint holds beside the tensors, and which owners of state it keeps (keep()), is
listed in run_state.py.
"""
import atexit
import glob
import os
import threading

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.utils._pytree import tree_leaves, tree_map_only

from fsdp_gpt.checkpoint.ckpt_format import (
    FULL_OPTIONS, SHARD_RE, CorruptCheckpoint, complete_checkpoints, full_path, host_copy, incomplete,
    incomplete_sets, marker_path, piece_of, save_atomically, shard_path, WriteFailed)
from fsdp_gpt.checkpoint.ckpt_index import build_index, layout
from fsdp_gpt.checkpoint.ckpt_restore import CheckpointReader, parameter_names
from fsdp_gpt.checkpoint.run_lock import RunLock
from fsdp_gpt.checkpoint.run_state import header
from fsdp_gpt.config import RunStopped, UserError
from fsdp_gpt.distributed.float8 import plain
from fsdp_gpt.distributed.launch import agree, decided_on_rank0
from fsdp_gpt.distributed.shards import local_slice


def _aliases(model) -> dict:
    """{second name: first name} for parameters registered twice (the tied LM head)."""
    module = getattr(model, "module", model)
    first = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        first.setdefault(p, name)
    return {name: first[p] for name, p in module.named_parameters(remove_duplicate=False) if first[p] != name}


def sharded_state(model, optimizer, rank: int) -> dict:
    """This rank's slices of the model and optimizer state, as host copies (no collectives)."""
    names = parameter_names(model)
    return {"model": {name: piece_of(p, rank) for p, name in names.items()},
            "optimizer": {names[p]: {k: piece_of(v, rank) if v.dim() else host_copy(v) for k, v in s.items()}
                          for p, s in optimizer.state.items()},
            # what consolidation needs to write the full format: tied names, hyperparameters
            "aliases": _aliases(model),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} | {
                "params": [names[p] for p in g["params"]]} for g in optimizer.param_groups]}


def saved_files(cfg, model, optimizer, rank: int) -> dict:
    """What a save of this run writes (a dry run's plan): the files `rank` writes and their tensors' bytes (sharded:
    its slices, sharded_state's; full: rank 0's one file), and the bytes of every tensor whole, the set's in all."""
    tensors = [*parameter_names(model)] + [v for s in optimizer.state.values() for v in s.values() if v.dim()]
    whole = sum(t.numel() * t.element_size() for t in tensors)  # a DTensor's numel is the whole tensor's
    if cfg.checkpoint_type == "sharded":
        mine = [t for t in tree_leaves(sharded_state(model, optimizer, rank)) if isinstance(t, torch.Tensor)]
        return {"files": 1, "bytes": sum(t.numel() * t.element_size() for t in mine), "whole_bytes": whole}
    return {"files": int(rank == 0), "bytes": whole if rank == 0 else 0, "whole_bytes": whole}


def _write(writes: list, pending: dict) -> None:
    try:
        for obj, path in writes:
            save_atomically(obj, path)
    except WriteFailed as e:  # reported on the training thread by CheckpointManager.wait()
        pending["error"] = str(e)
    except Exception as e:  # noqa: BLE001 - likewise, with its type
        pending["error"] = f"writing checkpoint {pending['path']} failed: {type(e).__name__}: {e}"


class CheckpointManager:
    def __init__(self, cfg, topo):
        # without the slash a shell completes a folder with: the messages below add their own
        self.cfg, self.topo, self.dir = cfg, topo, cfg.checkpoint_dir.rstrip("/") or "/"
        self.reader = CheckpointReader(cfg, topo)
        self._pending = None  # the save being written: step, paths, thread, error
        # the newest finished save as its line names it (a sharded set's marker), or the checkpoint resumed from
        self.last_saved = None
        self.train_state = {}  # the resumed checkpoint's train_state, on every rank
        self.owners = {}  # {name: what keeps its state in train_state under that name} (keep())
        self.failed = None  # why the newest save failed (None: it succeeded), on every rank
        # every rank that writes makes the folder: on node-local disks each node needs its own
        writes = topo.is_main or cfg.checkpoint_type == "sharded"
        agree(lambda: os.makedirs(self.dir, exist_ok=True) if writes else None)
        # one run per folder: rank 0 holds it before anything in it is read or written
        self._lock = RunLock(self.dir) if topo.is_main else None
        note = agree(lambda: self._lock.acquire() if self._lock else None)
        if note:
            print(f"note: {note}", flush=True)
        if cfg.async_save:  # a run that fails before the next wait() still lands the write in flight
            atexit.register(self._land_write)
        if topo.device.type == "cuda":  # where NCCL's flight recorder dumps on a timeout (watchdog.py)
            agree(lambda: os.makedirs(os.path.join(self.dir, "hang"), exist_ok=True))

    def keep(self, **owners) -> None:
        """What a checkpoint keeps beside the weights (run_state.RunState's owners, each under its name
        in train_state): loaded now, in this order on every rank (a load may be a collective; a note it
        returns is printed), saved with every checkpoint."""
        self.owners = owners
        for name, owner in owners.items():
            note = owner.load(self.train_state.get(name))
            if note and self.topo.is_main:
                print(f"note: {note}", flush=True)

    # ---- saving ----
    def save(self, step: int, model, optimizer) -> None:
        """Copy the state off the training tensors, then write it (in the background with async_save),
        with what the owners keep (keep()). A state holding a non-finite value is never written:
        every rank stops instead."""
        self.wait()  # one save in flight at a time
        fields = header(self.cfg, step, self.topo.world_size, self.owners)  # every rank: a state() may read its device
        self._refuse_non_finite(step, model, optimizer)
        if self.cfg.checkpoint_type == "full":
            # collectives on every rank; rank 0 alone receives the full dicts (host copies) and writes
            state = {"model": get_model_state_dict(model, options=FULL_OPTIONS),
                     "optimizer": get_optimizer_state_dict(model, optimizer, options=FULL_OPTIONS)}
            state = tree_map_only(torch.Tensor, plain, state)  # torchao's FP8-gathered weights (one rank: not gathered)
            path, marker = full_path(self.dir, step), None
            if self.cfg.async_save:  # a 1-rank gather may alias the live tensors: own the bytes
                state = tree_map_only(torch.Tensor, torch.clone, state)
            writes = [(fields | state, path)] if self.topo.is_main else []
        else:
            state = sharded_state(model, optimizer, self.topo.rank) | {"rank": self.topo.rank}
            path, marker = shard_path(self.dir, step, self.topo.rank), marker_path(self.dir, step)
            writes = [(fields | state, path)]
            # an older set of this step (a fresh start in a used folder) stops being visible before any
            # rank replaces its files: a mix of old and new files is never claimed complete
            agree(lambda: os.remove(marker) if self.topo.is_main and os.path.exists(marker) else None)
        self._pending = {"step": step, "path": path, "marker": marker, "error": None,
                         "layout": layout(state) if marker else None}
        if self.cfg.async_save:
            self._pending["thread"] = threading.Thread(target=_write, args=(writes, self._pending), daemon=True)
            self._pending["thread"].start()
        else:
            _write(writes, self._pending)
            self.wait()

    def _refuse_non_finite(self, step: int, model, optimizer) -> None:
        """A collective: each rank checks its own slices, and all learn whether any rank found one."""
        tensors = [*model.parameters()] + [v for s in optimizer.state.values() for v in s.values()
                                           if isinstance(v, torch.Tensor)]
        # each slice's min and max, read in one pass (NaN where it holds a NaN), not a mask per tensor: the
        # check costs a save a tenth of what it did on a CPU, and no tensor-sized temporary on a GPU. An
        # empty slice (a rank past an uneven shard's end) has neither. Judged in each tensor's own dtype,
        # on its own device (a CPU step count beside CUDA weights), then gathered on this rank's.
        slices = [s for s in (local_slice(t)[0] for t in tensors) if s.numel()]
        finite = [torch.isfinite(m).to(self.topo.device) for s in slices for m in torch.aminmax(s)]
        bad = torch.zeros((), device=self.topo.device)
        if finite:
            bad = (~torch.stack(finite).all()).float()
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item():
            raise RunStopped(f"the state after step {step} holds a non-finite value: not saved. Last good checkpoint: "
                             f"{self.last_saved or 'none'}")

    def wait(self) -> None:
        """Finish the save in flight: every rank calls this at the same point (it may hold a barrier)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if "thread" in pending:
            pending["thread"].join()
        errors = [None] * self.topo.world_size  # every rank learns whether any rank's write failed
        dist.all_gather_object(errors, pending["error"])
        failed = [e for e in errors if e]
        if failed:
            self._discard(pending, failed)
            return
        self.failed = None
        if pending["marker"]:
            # after the gather above: every rank's file is renamed into place before the marker says so
            layouts = [None] * self.topo.world_size if self.topo.is_main else None
            dist.gather_object(pending["layout"], layouts, dst=0)
            agree(lambda: save_atomically({"step": pending["step"], "world_size": self.topo.world_size,
                                           "index": build_index(layouts)}, pending["marker"]) if self.topo.is_main
                  else None)  # a disk too full for the marker's few bytes stops every rank
        self.last_saved = pending["marker"] or pending["path"]
        if self.topo.is_main:
            print(f"saved checkpoint {self.last_saved}", flush=True)
        self._prune(pending["step"])

    def _land_write(self) -> None:
        """At exit: this rank's write in flight finished, with no collective (after a failure the peers may be
        anywhere): a full checkpoint lands; a sharded set's files do, without the marker only wait() writes.
        Bounded as a save is (init_timeout): a write stuck on a hung disk does not keep the process."""
        if self._pending and "thread" in self._pending:
            self._pending["thread"].join(timeout=self.cfg.init_timeout)

    def finished(self) -> str | None:
        """The newest checkpoint, the save in flight finished first (wait(): every rank, at one point)."""
        self.wait()
        return self.last_saved

    def _discard(self, pending: dict, failed: list[str]) -> None:
        """A failed save: the files of it that did get written go too (an incomplete sharded set holds
        space and is never visible), earlier checkpoints stay, and training goes on: the next save
        tries again (close() stops the run if the last one failed)."""
        if pending["marker"] and os.path.exists(pending["path"]):
            os.remove(pending["path"])
        others = f" (and {len(failed) - 1} more ranks' files)" if len(failed) > 1 else ""
        self.failed = f"{failed[0]}{others}"
        if self.topo.is_main:
            print(f"warning: {self.failed}; training goes on and the next save tries again. Last good checkpoint: "
                  f"{self.last_saved or 'none yet'}", flush=True)

    def _prune(self, saved_step: int) -> None:
        """Keep the keep_last newest checkpoints up to the one just saved; never a newer one. Rank 0
        decides and removes the full files and the markers (a set stops being visible first); then each
        rank removes its own rank files, which on node-local disks no other rank sees."""
        if not self.cfg.keep_last:
            return
        pruned = decided_on_rank0(lambda: self._prune_visible(saved_step))
        world, rank = self.topo.world_size, self.topo.rank

        def remove_rank_files():  # and rank 0 the files of ranks this run lacks (a set written by more ranks)
            for step in pruned:
                for path in glob.glob(os.path.join(self.dir, f"fsdp_sharded_cpt{step}_rank*.pth")):
                    if (owner := int(SHARD_RE.search(path).group(2))) == rank or (owner >= world and rank == 0):
                        os.remove(path)
        agree(remove_rank_files)

    def _prune_visible(self, saved_step: int) -> list[int]:
        """Rank 0: the full files and markers beyond keep_last removed; the sharded sets' steps."""
        ours = [(step, kind) for step, kind in complete_checkpoints(self.dir) if step <= saved_step]
        sets = []
        for step, kind in sorted(ours, reverse=True)[self.cfg.keep_last:]:
            os.remove(full_path(self.dir, step) if kind == "full" else marker_path(self.dir, step))
            sets += [step] if kind != "full" else []
        return sets

    def close(self) -> None:
        """Finish the last save; a run whose last save failed stops with exit 1 (its newest steps
        exist nowhere else)."""
        self.wait()
        dist.barrier()
        if self._lock:  # the run is done with its folder: another may use it, in this process too
            self._lock.release()
        if self.failed:
            raise RunStopped(f"{self.failed}: the run's last save failed. Last good checkpoint: "
                             f"{self.last_saved or 'none'} (--resume_from=latest continues from it)")

    # ---- resuming ----
    def resume(self, resume_from: str | None, model, optimizer) -> int:
        """Load model and optimizer state; return the step to continue after (0: fresh start)."""
        if resume_from is None:
            agree(lambda: self._note_earlier_run() if self.topo.is_main else None)
            return 0
        if resume_from == "latest":
            return self._resume_latest(model, optimizer)
        step = self._load(resume_from, model, optimizer)
        agree(lambda: self._refuse_newer(step) if self.topo.is_main else None)
        self._announce(resume_from, step)
        return step

    def _announce(self, path: str, step: int) -> None:
        self.last_saved = path
        if self.topo.is_main:
            print(f"resumed from {path} at step {step}", flush=True)

    def _note_earlier_run(self) -> None:
        """A fresh start in a folder that holds checkpoints: until this run saves past them, a restart
        with --resume_from=latest would take the newest of them, another run's."""
        if found := complete_checkpoints(self.dir):
            print(f"note: {self.dir}/ holds checkpoints of an earlier run (up to step {max(s for s, _ in found)}): this "
                  f"run starts from scratch and replaces those of the steps it saves; until it saves past them, "
                  f"--resume_from=latest would take the newest of them", flush=True)

    def _refuse_newer(self, step: int) -> None:
        """Checkpoints newer than the resumed step belong to an abandoned run: `latest` would
        jump back to them after a restart, so resuming into their folder is refused."""
        newer = sorted(s for s, _ in complete_checkpoints(self.dir) if s > step)
        if newer:
            raise UserError(f"{self.dir}/ holds checkpoints of steps {', '.join(map(str, newer))}, newer than the "
                            f"resumed step {step}: move them out of {self.dir}/ or set --checkpoint_dir to a new folder")

    def _check_visible(self, step: int) -> None:
        """Every rank reads a sharded set: one that some ranks can't see is a setup error, not damage."""
        sees = [None] * self.topo.world_size
        dist.all_gather_object(sees, os.path.isfile(marker_path(self.dir, step)))
        blind = [r for r, seen in enumerate(sees) if not seen]
        if blind:
            raise UserError(f"ranks {blind} can't see {marker_path(self.dir, step)}, which rank 0 sees: a sharded "
                            f"resume needs checkpoint_dir on a filesystem every node shares (or checkpoint_type: full)")

    def _resume_latest(self, model, optimizer) -> int:
        # rank 0's listing decides, so every rank tries the same checkpoints in the same order
        for step, kind in decided_on_rank0(lambda: sorted(complete_checkpoints(self.dir), reverse=True)):
            path = full_path(self.dir, step) if kind == "full" else shard_path(self.dir, step, 0)
            if kind == "sharded":
                self._check_visible(step)
            try:  # loaders raise before touching the model, on every rank alike
                loaded = self._load(path, model, optimizer)
                # the only newer sets are the damaged ones skipped above: `latest` skips them again
                self._say_incomplete(loaded)
                self._announce(path, loaded)
                return loaded
            except CorruptCheckpoint as e:
                if self.topo.is_main:
                    print(f"skipping a damaged checkpoint: {e}", flush=True)
        self._say_incomplete(0)
        if self.topo.is_main:
            print(f"no usable checkpoint in {self.dir}/ yet: starting from scratch", flush=True)
        return 0

    def _say_incomplete(self, taken: int) -> None:
        """Rank 0 names the sharded sets newer than the step taken that lack their marker (a save cut short)."""
        if self.topo.is_main:
            for step in incomplete_sets(self.dir):
                if step > taken:
                    print(f"skipping an incomplete checkpoint: {incomplete(self.dir, step)}", flush=True)

    def _load(self, path: str, model, optimizer) -> int:
        """The checkpoint at path into model and optimizer; its train_state kept for keep(): its step."""
        step, self.train_state = self.reader.load(path, model, optimizer)
        return step

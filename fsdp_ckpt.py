"""Checkpoints outside train_fsdp.py, where the design card puts them. Run, it says what one holds:

    python fsdp_ckpt.py checkpoints/                # each checkpoint there, then the newest complete one's
    python fsdp_ckpt.py checkpoints/fsdp_sharded_cpt5000_rank0.pth --verify   # its step, tokens seen,
    #   world size and format, model, config keys that differ from the defaults, data position, and
    #   whether it is complete (--verify: every byte against its checksum)

In any one process, no process group (a notebook, an eval script):

    from fsdp_ckpt import consolidate, load_gpt, read_model
    model, ckpt = load_gpt("checkpoints/fsdp_cpt5000.pth", "cpu")   # a full file, any rank's file
    #   of a sharded set, or a folder (its newest complete checkpoint); model.GPT in eval mode
    ckpt["step"], ckpt["config"]                                    # the run's resolved config
    ckpt, state = read_model("checkpoints/")                        # the full state dict alone

In a loop of your own, every rank (one process or under torchrun), with the trainer's config:

    from fsdp_ckpt import CheckpointManager, init_distributed, parse_args
    cfg = parse_args(["config/demo_cpu.yaml", "--checkpoint_type=sharded"])
    topo = init_distributed(cfg)                    # the process group and the mesh
    ckpt = CheckpointManager(cfg, topo)             # one run per folder: cfg.checkpoint_dir
    step = ckpt.resume("latest", model, optimizer)  # 0 where there is none yet
    ckpt.save(step, model, optimizer)               # a collective: every rank calls it
    ckpt.close()                                    # waits for an async save

And offline, a sharded set into one full file (as consolidate.py does):

    consolidate("checkpoints/fsdp_sharded_cpt5000_rank0.pth", "full.pth")

A face, not a copy: the manager and its collectives live in fsdp_gpt/checkpoint/fsdp_ckpt.py, the
files in ckpt_format.py (docs/checkpoints.md has both formats), what a checkpoint holds in
run_state.py, the command in ckpt_inspect.py.
"""
import sys

from fsdp_gpt.checkpoint.ckpt_format import consolidate, load_gpt, read_model
from fsdp_gpt.checkpoint.ckpt_inspect import main
from fsdp_gpt.checkpoint.fsdp_ckpt import CheckpointManager
from fsdp_gpt.config import exit_code
from fsdp_gpt.config_parse import parse_args
from fsdp_gpt.distributed.launch import init_distributed

__all__ = ["CheckpointManager", "init_distributed", "parse_args", "load_gpt", "read_model", "consolidate"]

if __name__ == "__main__":
    sys.exit(exit_code(lambda: main(sys.argv[1:])))

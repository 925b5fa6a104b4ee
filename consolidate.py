"""Join a sharded checkpoint's per-rank files into one full file, in one process (no torchrun).

python consolidate.py CHECKPOINTS/fsdp_sharded_cpt{step}_rank0.pth OUT.pth

OUT.pth is what a full checkpoint holds (fsdp_cpt{step}.pth): any world size resumes from it, and
sample.py, evaluate.py and export_hf.py read it like the sharded set it came from.
"""
import argparse
import sys

from fsdp_gpt.checkpoint.ckpt_format import consolidate
from fsdp_gpt.config import exit_code


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shard_file", help="any rank's file of a complete sharded set, or its .complete marker")
    parser.add_argument("out", help="the full checkpoint to write")
    args = parser.parse_args(argv)
    consolidate(args.shard_file, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(lambda: main(sys.argv[1:])))

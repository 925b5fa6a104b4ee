"""Plans at a cluster's size, side by side: each the trainer's own dry run (train_fsdp.py --dry_run, one source),
in a process of its own, with what it cost this machine.

    python bench/scale_plan.py [SHAPE ...] [--key=value ...]

SHAPEs are SHAPES' names (all by default); --key=value overrides go to every one. Per shape: the ranks and the
mesh; the state a rank holds (mem/state_gb's figure) against the arithmetic (4 bytes a weight and 8 of AdamW's
moments, over the shard group: bytes a parameter x parameters / shard group, the vectors FSDP2 leaves whole
aside); the step's peak without and with activation checkpointing; the bytes a rank sends a step; the
step-time floor and the tokens a second it allows; and the dry run's wall seconds (interpreter and imports
included) and host memory (its peak resident set). docs/scale_plan.md shows a run of it.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "config")

LLAMA3_8B = dict(arch="llama", n_layer=32, n_embd=4096, n_head=32, n_kv_head=8, ffn_hidden=14336, tie_embeddings=False,
                 rope_theta=500000.0, vocab_size=128256)
SHAPES = {  # name: (config, NODESxGPUS, overrides)
    "llama_1B-256": ("llama_1B.yaml", "32x8", dict(sharding_strategy="HYBRID_SHARD", micro_batch=2)),
    "llama3_8B-512": ("llama_1B.yaml", "64x8", LLAMA3_8B | dict(block_size=8192, micro_batch=1, train_batch=512)),
    "qwen3_30B_A3B-64": ("llama_1B.yaml", "8x8", dict(
        arch="llama", n_layer=48, n_embd=2048, n_head=32, n_kv_head=4, head_dim=128, qk_norm=True, tie_embeddings=False,
        vocab_size=151936, rope_theta=1000000.0, moe_experts=128, moe_top_k=8, moe_hidden=768, block_size=4096,
        micro_batch=8, train_batch=512, ep_size=8)),
    "llama3_70B-1024": ("llama_1B.yaml", "128x8", LLAMA3_8B | dict(
        n_layer=80, n_embd=8192, n_head=64, ffn_hidden=28672, block_size=8192, micro_batch=1, train_batch=1024,
        activation_checkpointing=True)),
}


def plan(name: str, extra: list[str]) -> tuple[dict, float]:
    """The shape's plan and the dry run's wall seconds."""
    config, world, settings = SHAPES[name]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "plan.json")
        args = [sys.executable, os.path.join(ROOT, "train_fsdp.py"), os.path.join(CONFIG, config), f"--dry_run={world}",
                f"--dry_run_out={out}", *(f"--{k}={v}" for k, v in settings.items()), *extra]
        start = time.perf_counter()
        result = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        seconds = time.perf_counter() - start
        if result.returncode:
            sys.exit(f"{name}: the dry run failed:\n{result.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f), seconds


def row(name: str, plan: dict, seconds: float) -> list[str]:
    rank, step, floor = plan["per_rank"], plan["per_step"], plan["step_floor"]
    shard = plan["mesh"]["shard"]
    arithmetic = 12 * plan["params"] / shard / 1e9
    peaks = rank["peak_gb_by_activation_checkpointing"]
    sent = ", ".join(f"{kind} {gb:.3g}" for kind, gb in step["collective_gb"].items() if gb)
    mesh = " x ".join(f"{dim} {size}" for dim, size in plan["mesh"].items())
    return [name, f"{plan['world_size']:,} ({mesh})", f"{plan['params'] / 1e9:.2f}B",
            f"{rank['state_gb']:.3f} / {arithmetic:.3f} ({rank['state_gb'] / arithmetic - 1:+.1%})",
            f"{peaks['false']:.1f} / {peaks['true']:.1f}", sent,
            f"{floor['compute_s']:.3g} / {floor['collectives_s']:.3g}", f"{floor['tokens_per_s']:,.0f}",
            f"{seconds:.0f} s, {plan['dry_run']['host_peak_gb']:.2f} GB"]


HEADER = ["shape", "ranks (mesh)", "parameters", "state GB a rank / arithmetic", "peak GB without / with AC",
          "GB a rank sends a step", "floor s: compute / collectives", "tokens/s at the floor", "dry run: wall, host"]


def main(argv: list[str]) -> int:
    names = [a for a in argv if not a.startswith("--")] or list(SHAPES)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        sys.exit(f"unknown shape {', '.join(unknown)}: one of {', '.join(SHAPES)}")
    extra = [a for a in argv if a.startswith("--")]
    print("| " + " | ".join(HEADER) + " |")
    print("|" + " --- |" * len(HEADER))
    for name in names:
        print("| " + " | ".join(row(name, *plan(name, extra))) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

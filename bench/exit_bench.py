"""Clean exits: launch finished 2- and 4-rank runs and count exits other than 0.

    python bench/exit_bench.py --runs 60                     # this checkout
    python bench/exit_bench.py --runs 60 --checkout OLD      # another checkout, for a before/after
    python bench/exit_bench.py --runs 120 --endings          # exit_probe.py's three endings, side by side

The runs cycle through the trainer (a tiny model, 4 steps, an eval and a full or sharded
checkpoint) at 2 and 4 ranks, and the tests' init probe (model built and sharded, weights
gathered) at 2 and 4 ranks. With --endings they cycle through bench/exit_probe.py ended as the
old probes did (none), as the old trainer did (destroy) and as every entry point does now
(entry_point), at 2 and 4 ranks. A run counts as failed when torchrun exits non-zero; 'aborts'
counts its 'terminate called' lines.
"""
import argparse
import collections
import os
import subprocess
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [(2, "full"), (2, "sharded"), (2, "probe"), (4, "full"), (4, "sharded"), (4, "probe")]
ENDINGS = [(nproc, ending) for nproc in (2, 4) for ending in ("none", "destroy", "entry_point")]
TINY = ["--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=32", "--train_batch=8", "--micro_batch=2",
        "--max_iters=4", "--save_interval=4", "--eval_interval=4", "--eval_iters=1", "--log_interval=1",
        "--tokenizer=bytes", "--sample_tokens=0", "--dtype=fp32"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--checkout", default=ROOT, help="the trainer's folder (default: this one)")
    parser.add_argument("--endings", action="store_true", help="run exit_probe.py's endings instead")
    args = parser.parse_args()
    cases = ENDINGS if args.endings else CASES
    config = os.path.join(args.checkout, "config", "demo_cpu.yaml")
    failed, aborts, runs = collections.Counter(), collections.Counter(), collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")
        data = [f"--data_path={os.path.join(tmp, 'data')}", f"--data_source={source}"]
        for i in range(args.runs):
            nproc, kind = cases[i % len(cases)]
            run_dir = os.path.join(tmp, f"run{i}")
            os.makedirs(run_dir)
            launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
            if args.endings:
                cmd = launch + [os.path.join(ROOT, "bench", "exit_probe.py"), kind]
            elif kind == "probe":
                cmd = launch + [os.path.join(args.checkout, "tests", "init_probe.py"), run_dir, config, *TINY,
                                "--vocab_size=256"]
            else:
                cmd = launch + [os.path.join(args.checkout, "train_fsdp.py"), config, *TINY, *data,
                                f"--checkpoint_type={kind}", f"--checkpoint_dir={run_dir}/ckpt",
                                f"--tensorboard_dir={run_dir}/tb"]
            result = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
            case = f"{nproc} ranks {'init probe' if kind == 'probe' else kind}"
            runs[case] += 1
            if result.returncode != 0:
                failed[case] += 1
                aborts[case] += result.stderr.count("terminate called")
                print(f"run {i} ({case}): exit {result.returncode}", flush=True)
    print(f"{'case':<22} {'runs':>5} {'failed':>7} {'aborts':>7}")
    for case in runs:
        print(f"{case:<22} {runs[case]:>5} {failed[case]:>7} {aborts[case]:>7}")
    print(f"{'all':<22} {sum(runs.values()):>5} {sum(failed.values()):>7} {sum(aborts.values()):>7}")


if __name__ == "__main__":
    main()

"""Data preparation at scale: throughput for 1 and N workers, and the peak memory of the whole
process tree (preparer + workers) at two corpus sizes.

    python bench/data_bench.py                         # 0.3 and 1.2 GB of jsonl, 1 and 2 workers
    python bench/data_bench.py --sizes 0.1 --workers 1 4 --tokenizer bytes
    python bench/data_bench.py --before OLD            # also OLD checkout's in-memory preparation

The corpus is the standard library's source as jsonl documents, repeated (each copy numbered)
up to each size. Each run is `python data.py prepare` in a fresh folder; its process tree's
resident memory is summed every 50 ms.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_corpus(path: str, size_bytes: int) -> None:
    stdlib = sysconfig.get_paths()["stdlib"]
    docs = []
    for name in sorted(os.listdir(stdlib)):
        if name.endswith(".py"):
            with open(os.path.join(stdlib, name), encoding="utf-8", errors="replace") as f:
                docs.append(f.read())
    written, copy = 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while written < size_bytes:
            for doc in docs:
                line = json.dumps({"text": f"# copy {copy}\n{doc}"}) + "\n"
                out.write(line)
                written += len(line)
                if written >= size_bytes:
                    break
            copy += 1


def tree_rss_bytes(root_pid: int) -> int:
    """Resident memory of a process and all its descendants."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        children = [pid for pid, ppid in parents.items() if ppid in frontier and pid not in tree]
        tree.update(children)
        frontier = children
    total = 0
    for pid in tree:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            continue
    return total


def prepare_cmd(corpus: str, out: str, workers: int | str, tokenizer: str) -> list[str]:
    """`data.py prepare`, or with workers = a checkout's folder, that checkout's prepare_data (one process)."""
    if isinstance(workers, str):
        call = "import sys; sys.path.insert(0, sys.argv[1]); from fsdp_gpt.data.prepare import prepare_data; prepare_data(sys.argv[2], [sys.argv[3]], sys.argv[4])"
        return [sys.executable, "-c", call, workers, out, corpus, tokenizer]
    return [sys.executable, os.path.join(ROOT, "data.py"), "prepare", out, corpus, f"--tokenizer={tokenizer}",
            f"--workers={workers}"]


def run_prepare(cmd: list[str], out: str) -> tuple[float, int, int]:
    """(seconds, tokens written, peak resident bytes of the process tree)."""
    start, peak = time.perf_counter(), 0
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None:
        peak = max(peak, tree_rss_bytes(proc.pid))
        time.sleep(0.05)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"prepare failed: {proc.stderr.read()}")
    with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
    return seconds, meta["train_tokens"] + meta["val_tokens"], peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.3, 1.2], help="corpus sizes in GB")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokenizer", default="cl100k_base")
    parser.add_argument("--before", help="another checkout: run its preparation too, as the 'before' row")
    args = parser.parse_args()
    print(f"{'corpus GB':>9} {'workers':>7} {'seconds':>8} {'MB/s':>7} {'tokens/s':>11} {'peak tree RSS GB':>16}")
    runs = [*args.workers, *([args.before] if args.before else [])]
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            corpus = os.path.join(tmp, f"corpus{size}.jsonl")
            write_corpus(corpus, int(size * 1e9))
            megabytes = os.path.getsize(corpus) / 1e6
            for i, workers in enumerate(runs):
                out = os.path.join(tmp, f"out{size}_{i}")
                seconds, tokens, peak = run_prepare(prepare_cmd(corpus, out, workers, args.tokenizer), out)
                rates[size, workers] = megabytes / seconds
                label = "before" if isinstance(workers, str) else workers
                print(f"{size:>9} {label:>7} {seconds:>8.1f} {megabytes / seconds:>7.1f} {tokens / seconds:>11,.0f} "
                      f"{peak / 1e9:>16.3f}", flush=True)
                shutil.rmtree(out)
            os.remove(corpus)
            first = args.workers[0]
            ratios = [f"{w} workers / {first}: {rates[size, w] / rates[size, first]:.2f}x" for w in args.workers[1:]]
            if args.before:
                ratios.append(f"{first} workers / before: {rates[size, first] / rates[size, args.before]:.2f}x")
            print(f"{size} GB: {', '.join(ratios)}", flush=True)


if __name__ == "__main__":
    main()

"""The first run on a GPU machine, offline, with the torch it has (no pip):

    bash bench/gpu_check.sh [--key=value ...]      # (this file, run by the interpreter it finds)

One process wraps the model in FSDP2 all the same (force_fsdp), so one GPU runs what a cluster
runs: bf16 mixed precision, compile under FSDP's hooks, async sharded saves and a resume from them,
Muon and NorMuon with the recipe's parts, a mixture of experts, multiple-choice eval. With 2 or more GPUs the 2-rank runs
over NCCL follow (parity with one GPU, HYBRID_SHARD and NO_SHARD meshes, cpu_offload on a 2-D
mesh), then the GPU tests. Each row is the trainer as a user runs it, on the demo's byte corpus
with the vocabulary kept at 50,304 (the configs' shapes and FLOPs, no tokenizer download).

Time: a lent machine allows 10 minutes a command. The rows share GPU_CHECK_BUDGET seconds (default
510): each gets what is left, in the order below, and a row that no longer fits is shown as not
run. GPU_CHECK_ROWS=name,name runs those rows alone. One markdown table, printed and written to $GPU_CHECK_DIR/table.md: per row what ran, tok/s,
MFU (over the steps after the first log line, which holds start-up and compilation: 50 steps, lines every 25), the largest
rank's peak memory, and pass or fail with the reason. GPU_CHECK_KEEP=DIR copies the table and the logs (one
tar.gz) there: on a lent machine, $OUT/gpu_check (bring_back). Extra --key=value arguments go to every
trainer run, last (tests/test_gpu_paths.py runs this at tiny size on CPU that way). The rows run under
$PYTHON where it is set, else under this interpreter (python()).
"""
import datetime
import glob
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

# bench/mfu.py's timing: 75 steps, a line every 25 (the first holds start-up and compilation; the
# rows that log every step to compare losses step by step pay a host sync a step in their tok/s)
BYTES = ["--data_path=data/stdlib_bytes", "--data_source=stdlib", "--tokenizer=bytes", "--vocab_size=50304",
         "--train_batch=64", "--micro_batch=16", "--max_iters=75", "--warmup_iters=10", "--lr_decay_iters=75",
         "--log_interval=25", "--eval_interval=75", "--eval_iters=2", "--save_interval=75", "--sample_tokens=0",
         "--world_size=null", "--keep_last=0"]
FSDP = BYTES + ["--force_fsdp=true", "--dtype=bf16", "--compile=false"]
GPT2 = ["config/train90M_fsdp.yaml"]
PEAK = re.compile(r"^memory per rank, GB: peak ([\d. ]+) \|", re.M)


@dataclass
class Row:
    name: str
    what: str
    args: Callable[["Check"], list[str]] | list[str]  # the trainer's arguments (a function: made when it starts)
    nproc: int = 1
    gpus: int = 0  # GPUs the row needs (0: runs anywhere, on CPU too)
    check: Callable[["Check", str], str | None] | None = None  # a failure's reason, or None
    cap: int = 240  # seconds at most, within what the budget has left


@dataclass
class Check:
    dir: str
    budget: float
    extra: list[str]
    start: float = field(default_factory=time.monotonic)

    def run_dir(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)


def losses(check: Check, name: str, tag: str = "train/loss") -> dict[int, float]:
    from fsdp_gpt.observe.metrics import read_scalars
    return read_scalars(os.path.join(check.run_dir(name), "tb"), tag)


def figures(folder: str, tag: str) -> dict[int, float]:
    """{step: value} of a run's figure, from its metrics.jsonl (what programs read: not the console line)."""
    from fsdp_gpt.observe.figures_file import read_figures
    return read_figures(os.path.join(folder, "tb"), tag)


def first_checkpoint(check: Check, name: str) -> str:
    steps = sorted(int(re.search(r"cpt(\d+)_", p).group(1))
                   for p in glob.glob(os.path.join(check.run_dir(name), "ckpt", "fsdp_sharded_cpt*_rank0.pth")))
    return os.path.join(check.run_dir(name), "ckpt", f"fsdp_sharded_cpt{steps[0] if steps else 0}_rank0.pth")


def resumes(original: str) -> Callable[[Check, str], str | None]:
    """The resumed run's first step equals the original's bitwise (the same weights, the same batch,
    forward kernels are deterministic); later steps within 1e-3 (GPU backward kernels accumulate
    with atomics, so the updates differ in their last bits)."""
    def check(c: Check, name: str) -> str | None:
        whole, resumed = losses(c, original), losses(c, name)
        if not resumed:
            return "no resumed steps logged"
        first = int(re.search(r"cpt(\d+)_", first_checkpoint(c, original)).group(1)) + 1
        if first not in resumed or resumed[first] != whole.get(first):
            return f"step {first}: loss {resumed[first]!r} after the resume, {whole.get(first)!r} uninterrupted"
        off = [s for s in resumed if s not in whole or abs(resumed[s] - whole[s]) > 1e-3 * abs(whole[s])]
        return f"steps {off} differ by more than 1e-3" if off else None
    return check


def matches(reference: str, rel: float) -> Callable[[Check, str], str | None]:
    def check(c: Check, name: str) -> str | None:
        for tag in ("train/loss", "val/loss"):
            ours, theirs = losses(c, name, tag), losses(c, reference, tag)
            off = [s for s in theirs if s not in ours or abs(ours[s] - theirs[s]) > rel * abs(theirs[s])]
            if not theirs or off:
                return f"{tag} at steps {off or 'none logged'} not within {rel} of {reference}"
        return None
    return check


def learns(c: Check, name: str) -> str | None:
    """A training row passes when it exits 0 and its train loss fell."""
    seen = losses(c, name)
    if len(seen) < 2 or seen[max(seen)] >= seen[min(seen)]:
        return f"train loss did not fall: {seen}"
    return None


def mc_scored(c: Check, name: str) -> str | None:
    return learns(c, name) or (None if figures(c.run_dir(name), "eval/mc/acc") else "no multiple-choice score logged")


def mc_file(check: Check) -> str:
    from mc_cost import write_items
    path = os.path.join(check.dir, "mc.jsonl")
    write_items(path, 64, seed=0)
    return path


# the mixture of the moe rows: 8 experts, top 2, both balancing schemes, compiled
MOE = ["--arch=llama", "--qk_norm=true", "--moe_experts=8", "--moe_top_k=2", "--moe_bias_rate=0.001",
       "--moe_aux_loss=0.001", "--compile=true"]
ROWS = [
    # both log every step: the resumed run's first step is the one compared bitwise
    Row("fsdp_bf16", "GPT-2 90M, force_fsdp: FSDP2 bf16 mixed precision, eager; async sharded saves; "
        "multiple-choice eval", lambda c: GPT2 + FSDP + ["--async_save=true", "--checkpoint_type=sharded",
                                                         "--save_interval=10", "--log_interval=1",
                                                         f"--mc_eval_path={mc_file(c)}"], check=mc_scored),
    Row("fsdp_resume", "fsdp_bf16 resumed from its first sharded save: first step bitwise, then within 1e-3",
        lambda c: GPT2 + FSDP + ["--checkpoint_type=sharded", "--log_interval=1",
                                 f"--resume_from={first_checkpoint(c, 'fsdp_bf16')}"],
        check=resumes("fsdp_bf16"), cap=120),
    Row("fsdp_compile", "fsdp_bf16's run with its blocks compiled under FSDP's hooks",
        GPT2 + FSDP + ["--compile=true"], check=learns),
    Row("recipe_muon", "config/recipe_124M.yaml (Llama, untied head, value embeddings, soft cap, Muon with Polar "
        "Express, NorMuon, cautious decay), force_fsdp, bf16, compiled",
        ["config/recipe_124M.yaml"] + FSDP + ["--compile=true", "--checkpoint_type=sharded"], check=learns),
    Row("moe", "train90M's body as a Llama mixture (8 experts, top 2, qk_norm), force_fsdp, bf16, compiled: "
        "the experts through torch._grouped_mm, the balancing bias", GPT2 + FSDP + MOE, check=learns, cap=150),
    Row("demo", "config/demo_cpu.yaml as it is (one process, unwrapped)", ["config/demo_cpu.yaml"], check=learns,
        cap=120),
    Row("doc_mask", "fsdp_bf16's run (eager) with doc_mask: each document of a row attended alone, a flash call per "
        "document, no mask", GPT2 + FSDP + ["--doc_mask=true"], check=learns, cap=120),
    Row("ring_1gpu", "doc_mask's run with cp_mode ring on one GPU (no passes): the flash kernel's log-sum-exp "
        "forward and its backward given it, per document", GPT2 + FSDP + ["--doc_mask=true", "--cp_mode=ring"],
        check=learns, cap=120),
    Row("one_gpu_fp32", "the reference of 2gpu_fp32: force_fsdp, fp32 (TF32)", GPT2 + FSDP + ["--dtype=fp32"],
        gpus=2, check=learns),
    Row("2gpu_fp32", "2 ranks FULL_SHARD over NCCL, fp32: within 1e-3 of one GPU (TF32 rounding)",
        GPT2 + FSDP + ["--dtype=fp32"], nproc=2, gpus=2, check=matches("one_gpu_fp32", 1e-3)),
    Row("2gpu_hybrid", "2 ranks HYBRID_SHARD (replicate=2, shard=1): the 2-D mesh's sub-groups over NCCL",
        GPT2 + FSDP + ["--sharding_strategy=HYBRID_SHARD", "--fsdp_size=1"], nproc=2, gpus=2, check=learns),
    Row("2gpu_no_shard", "2 ranks NO_SHARD", GPT2 + FSDP + ["--sharding_strategy=NO_SHARD"], nproc=2, gpus=2,
        check=learns),
    Row("2gpu_offload", "2 ranks HYBRID_SHARD with cpu_offload: pinned host state, nccl and gloo in one group",
        GPT2 + FSDP + ["--sharding_strategy=HYBRID_SHARD", "--fsdp_size=1", "--cpu_offload=true"], nproc=2, gpus=2,
        check=learns),
    Row("2gpu_ep", "2 ranks, the moe row's mixture with ep_size 2: 4 experts a rank, tokens through NCCL "
        "all-to-alls", GPT2 + FSDP + MOE + ["--ep_size=2"], nproc=2, gpus=2, check=learns, cap=150),
    Row("2gpu_ring", "2 ranks, cp_size 2 in ring mode with doc_mask, bf16: key/value blocks and their gradients "
        "over NCCL's point-to-point sends", GPT2 + FSDP + ["--doc_mask=true", "--cp_mode=ring", "--cp_size=2"],
        nproc=2, gpus=2, check=learns),
]


def gpu_count() -> int:
    import torch
    return torch.cuda.device_count()


def failure(log: str, code: int) -> str:
    """The reason a run failed: its error line, else its last line."""
    lines = [line for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return f"exit {code}: " + (errors or lines or ["no output"])[-1][:160]


def descendants(pid: int) -> list[int]:
    """Every process under pid (torchrun starts its workers in sessions of their own: a process
    group kill would not reach them)."""
    children = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
        except (OSError, ValueError):
            continue
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def run_logged(cmd: list[str], log_path: str, timeout: float) -> int | None:
    """Run cmd with its output in log_path; its exit code, or None when it ran out of time (it and
    every process under it are then killed)."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in [*descendants(process.pid), process.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            process.wait()
            return None


def python() -> str:
    """The interpreter rows run under (here and in mfu.py): $PYTHON where it is set (gpu_check.sh runs
    this file with it too; the tests give their zygote's, tests/zygote_python), else this one."""
    return os.environ.get("PYTHON", sys.executable)


def run_row(check: Check, row: Row, gpus: int) -> dict:
    result = {"row": row, "log": check.run_dir(row.name) + ".log"}
    if gpus < row.gpus:
        return result | {"result": f"not run: needs {row.gpus} GPUs, found {gpus}"}
    timeout = min(row.cap, check.left())
    if timeout < 20:
        return result | {"result": "not run: the time budget is spent (GPU_CHECK_BUDGET)"}
    folder = check.run_dir(row.name)
    shutil.rmtree(folder, ignore_errors=True)  # a rerun starts clean (a resume refuses newer checkpoints)
    args = row.args(check) if callable(row.args) else row.args
    launcher = [python()] + ([] if row.nproc == 1 else [
        "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={row.nproc}"])
    cmd = launcher + ["train_fsdp.py", *args, f"--checkpoint_dir={folder}/ckpt", f"--tensorboard_dir={folder}/tb",
                      *check.extra]
    print(f"== {row.name} ({timeout:.0f} s at most)", flush=True)
    code = run_logged(cmd, result["log"], timeout)
    with open(result["log"]) as f:
        text = f.read()
    if code is None:
        reason = f"fail: timed out after {timeout:.0f} s"
    elif code:
        reason = "fail: " + failure(text, code)
    else:
        problem = row.check(check, row.name) if row.check else None
        reason = f"fail: {problem}" if problem else "pass"
    print(f"   {reason}", flush=True)
    return result | {"result": reason, "text": text, "folder": folder}


def measured(folder: str, text: str) -> tuple[str, str, str]:
    """tok/s and MFU from a trainer run's figures, its largest rank's peak memory from the end of its log."""
    rates, mfus = figures(folder, "perf/tokens_per_sec"), figures(folder, "perf/mfu")
    if not rates:
        return "", "", ""
    timed = sorted(rates)[1:] or list(rates)
    # over the steps after the first line: equal steps a line, so the rates' harmonic mean
    tokens = statistics.harmonic_mean([rates[step] for step in timed])
    mfu = [100 * mfus[step] for step in timed if step in mfus]
    peak = PEAK.search(text)
    return (f"{tokens:,.0f}", f"{statistics.harmonic_mean(mfu):.1f}%" if mfu else "n/a",
            f"{max(float(gb) for gb in peak.group(1).split()):.2f}" if peak else "")


def gpu_tests(check: Check) -> str:
    """The GPU tests in one process (no pytest-xdist: they share the device), with what is left."""
    import importlib.util
    if gpu_count() == 0:
        return "not run: torch sees no GPU"
    if importlib.util.find_spec("pytest") is None:
        return "not run: pytest is not installed (pip install -e .[dev])"
    if check.left() < 60:
        return "not run: the time budget is spent (GPU_CHECK_BUDGET)"
    print("== GPU tests", flush=True)
    log = os.path.join(check.dir, "gpu_tests.log")
    if run_logged([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-o", "addopts=",
                   "tests/"], log, check.left()) is None:
        return f"cut at the time budget ({check.budget:.0f} s): see {log}"
    with open(log) as f:
        return f.read().strip().splitlines()[-1]


def bring_back(folder: str, keep: str, names: tuple[str, ...]) -> None:
    """What a lent machine's call returns (its device tool brings back at most 8 files of 16 MiB, 2
    folders down, from $OUT): folder's named files, its logs in one logs.tar.gz, and up to 3 of its
    traces (mfu.py's *.trace.json.gz, the oldest first) that are under 16 MiB each."""
    os.makedirs(keep, exist_ok=True)
    for name in names:
        shutil.copy(os.path.join(folder, name), keep)
    with tarfile.open(os.path.join(keep, "logs.tar.gz"), "w:gz") as tar:
        for log in sorted(glob.glob(os.path.join(folder, "*.log"))):
            tar.add(log, arcname=os.path.basename(log))
    traces = sorted(glob.glob(os.path.join(folder, "*.trace.json.gz")), key=os.path.getmtime)
    for trace in [t for t in traces if os.path.getsize(t) < 16 << 20][:3]:
        shutil.copy(trace, keep)


def machine() -> str:
    import torch
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{gpu}, {torch.cuda.device_count()} GPU(s), torch {torch.__version__}, CUDA {torch.version.cuda}"


def table(results: list[dict], tests: str, started: str) -> str:
    lines = ["| run | what it runs | tok/s | MFU | peak memory, GB | result |", "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        cells = [r["row"].name, r["row"].what, *(measured(r["folder"], r["text"]) if "folder" in r else ("",) * 3),
                 r["result"]]
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    return "\n".join(lines + ["", f"{started}, {machine()}. GPU tests: {tests}"])


def main(extra: list[str]) -> int:
    check = Check(os.environ.get("GPU_CHECK_DIR", os.path.join(ROOT, "bench", "runs", "gpu_check")),
                  float(os.environ.get("GPU_CHECK_BUDGET", 510)), extra)
    os.makedirs(check.dir, exist_ok=True)
    started = datetime.date.today().isoformat()
    print(machine(), flush=True)
    gpus = gpu_count()
    chosen = os.environ.get("GPU_CHECK_ROWS")  # a comma-separated subset (a rerun of some rows), else all
    rows = [row for row in ROWS if chosen is None or row.name in chosen.split(",")]
    results = [run_row(check, row, gpus) for row in rows]
    text = table(results, gpu_tests(check), started)
    print(text)
    with open(os.path.join(check.dir, "table.md"), "w") as f:
        f.write(text + "\n")
    if keep := os.environ.get("GPU_CHECK_KEEP"):
        bring_back(check.dir, keep, ("table.md",))
    failed = any(r["result"].startswith("fail") for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""MFU on one GPU: the trainer as a user runs it, one factor at a time, against a plain compiled
PyTorch loop of the same model in the same run.

    python bench/mfu.py --rows gpt2_ref,gpt2,gpt2_fsdp     # rows by name (MFU_ROWS=... alike)
    python bench/mfu.py --list                             # the rows and what each changes
    python bench/mfu.py --rows all --budget 450            # every row that fits in 450 s

Each row is `train_fsdp.py`'s run of a shipped config (config/gpt2_124M.yaml, config/llama_124M.yaml,
config/llama_1B.yaml) on the demo's byte corpus with the config's vocabulary (its shapes and FLOPs, no
tokenizer download), in bf16, or the reference: `_plain`, a loop a user would write without this
trainer (the same model.GPT, the whole model compiled with the logits and cross-entropy inside,
bf16 autocast, fused AdamW, clipping), on the same batch. Timing, alike for every row: 60 steps,
a line every 20; the first line holds start-up and compilation, tok/s is over the 40 steps after it.
The bench's trainer runs skip the val loss at step 0 and the checkpoint after the last step: both
lie outside the timed steps, and on a lent GPU their seconds (a recompile for no_grad, a 15 GB
sharded save at 1B) are better spent on rows. MFU: tok/s x
GPT.flops_per_token() / the GPU's dense bf16 peak (fsdp_gpt/distributed/peak_flops.py), as the console
shows it. A row with `trace` (or named in --trace) also records two steps after the timed ones with
torch.profiler and splits their GPU time (matmuls, attention, loss, optimizer, FSDP copies and
collectives, other, idle); the trace is kept gzipped as {out}/{row}.trace.json.gz. The rows share --budget seconds; a row that no longer fits is shown as not run.
--keep DIR copies the table, the results, the logs (one tar.gz) and the traces there (a lent GPU: $OUT/mfu). Extra
--key=value arguments go to every run, last (tests/test_mfu.py runs two rows at tiny size on CPU). Each
row is a process of its own, under $PYTHON where it is set, else this interpreter (gpu_check.python).
The fp8 rows need torchao: installed, or unpacked into .torchao/ at the checkout's root for a machine
without pip (docs/fp8.md#on-a-machine-without-pip), which the rows then import first.
"""
import argparse
import glob
import gzip
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from gpu_check import bring_back, failure, machine, python, run_logged  # noqa: E402

# torchao unpacked into the checkout for a GPU machine without pip (docs/fp8.md#on-a-machine-without-pip)
TORCHAO = os.path.join(ROOT, ".torchao")
STEPS, LOG_EVERY = 60, 20
TRACED = [STEPS + 1, STEPS + 2]
BYTES = ["--data_path=data/stdlib_bytes", "--data_source=stdlib", "--tokenizer=bytes", "--dtype=bf16",
         f"--max_iters={STEPS}", f"--log_interval={LOG_EVERY}", "--warmup_iters=10", f"--lr_decay_iters={STEPS}",
         f"--eval_interval={STEPS}", "--eval_iters=1", "--save_interval=100000", "--sample_tokens=0",
         "--world_size=null", "--checkpoint_type=sharded", "--fsdp=true"]
GPT2 = ["config/gpt2_124M.yaml", "--train_batch=64", "--micro_batch=32"]
# what a user who writes FULL_SHARD for 124M gets (the config ships SHARD_GRAD_OP: gpt2_fsdp_once, shipped_gpt2_124M)
GPT2_FSDP = GPT2 + ["--force_fsdp=true", "--sharding_strategy=FULL_SHARD"]
LLAMA124 = ["config/llama_124M.yaml", "--vocab_size=50304", "--train_batch=64", "--micro_batch=32", "--compile=true"]
LLAMA1B = ["config/llama_1B.yaml", "--train_batch=8", "--micro_batch=8"]
OSS_SHAPE = ["--n_kv_head=4", "--sliding_window=128", "--window_pattern=[local,global]"]  # gpt-oss's attention


def shipped_share(config: str) -> tuple[int, int, int]:
    """(micro_batch, micro-steps, vocabulary) of one rank of the config's own launch (world_size), the
    micro-steps at most 2 (a row's step stays under a second), the vocabulary the config's or, where it
    takes the data's (null), GPT-2's. YAML and defaults as the trainer reads them (no torch)."""
    from fsdp_gpt.config_parse import parse_args
    cfg = parse_args([os.path.join(ROOT, "config", f"{config}.yaml")])
    return cfg.micro_batch, min(2, cfg.train_batch // (cfg.micro_batch * cfg.world_size)), cfg.vocab_size or 50304


@dataclass
class Row:
    name: str
    what: str
    args: list[str]
    vs: str | None = None  # the row its ratio is taken against: of tok/s, or with by_mfu of MFU
    by_mfu: bool = False  # models of other FLOPs a token (a mixture against its dense twin)
    variant: str = ""  # a change the trainer has no key for, made in-process (VARIANTS)
    plain: bool = False  # the reference loop instead of the trainer
    trace: bool = False


ROWS = [
    Row("gpt2_ref", "GPT-2 124M, plain loop: whole model compiled, logits + cross-entropy in the graph", GPT2,
        plain=True),
    Row("gpt2", "GPT-2 124M, train_fsdp.py, one process unwrapped, compiled (blocks and the chunked loss), "
        "micro_batch 32 x 2", GPT2, "gpt2_ref", trace=True),
    Row("gpt2_fsdp", "gpt2, force_fsdp with FULL_SHARD (units as auto lays them out: 4 of 3 blocks each at 32 x "
        "1,024 tokens a micro-step)", GPT2_FSDP, "gpt2"),
    Row("gpt2_fsdp_per_block", "gpt2_fsdp a unit a block (round seven's layout: 0.774x gpt2)",
        GPT2_FSDP + ["--fsdp_blocks_per_unit=1"], "gpt2_fsdp"),
    Row("gpt2_fsdp_prefetch", "gpt2_fsdp with fsdp_prefetch 2 (gathers issued two blocks ahead)",
        GPT2_FSDP + ["--fsdp_prefetch=2"], "gpt2_fsdp"),
    Row("gpt2_fsdp_once", "gpt2, force_fsdp with SHARD_GRAD_OP: gathered once a step",
        GPT2 + ["--force_fsdp=true", "--sharding_strategy=SHARD_GRAD_OP"], "gpt2"),
    Row("gpt2_logits_loss", "gpt2 with the loss before loss.py: [B, T, V] logits, then cross-entropy", GPT2,
        "gpt2_ref", variant="logits_loss"),
    Row("gpt2_eager", "gpt2, compile off", GPT2 + ["--compile=false"], "gpt2_ref"),
    Row("gpt2_doc_mask", "gpt2 with doc_mask (the corpus's files as documents: varlen flash)",
        GPT2 + ["--doc_mask=true"], "gpt2"),
    Row("gpt2_ring", "gpt2_doc_mask with cp_mode ring at cp_size 1 (the ring's kernels, no passes)",
        GPT2 + ["--doc_mask=true", "--cp_mode=ring"], "gpt2_doc_mask"),
    Row("llama124", "config/llama_124M.yaml (dense), compiled", LLAMA124),
    Row("moe", "llama124 as 8 experts, top 2 (the same active size), compiled: torch._grouped_mm",
        LLAMA124 + ["--moe_experts=8", "--moe_top_k=2", "--moe_bias_rate=0.001"], "llama124", by_mfu=True),
    # gpt-oss's layout at llama124's size (its 12 heads over 4 key/value heads, a window of 128 on every other
    # layer): Llama with that attention, then gpt-oss's dense twin (sinks: flash's forward and varlen call with the
    # sink on their log-sum-exp; biases; clamped SwiGLU), then its mixture of 8 experts of 768, top 2
    Row("llama124_oss_attention", "llama124 with gpt-oss's attention shape: 4 key/value heads, windows of 128 on "
        "every other layer, MLP 1,536 wide (the twin's)", LLAMA124 + OSS_SHAPE + ["--arch=llama", "--ffn_hidden=1536"]),
    Row("gptoss124_dense", "llama124_oss_attention as gpt-oss's layout, dense: attention sinks, biases, clamped "
        "SwiGLU", LLAMA124 + OSS_SHAPE + ["--arch=gpt_oss", "--ffn_hidden=1536"], "llama124_oss_attention", trace=True),
    Row("gptoss124", "gptoss124_dense as its mixture: 8 experts of 768, top 2 (the same active size), "
        "torch._grouped_mm", LLAMA124 + OSS_SHAPE + ["--arch=gpt_oss", "--moe_experts=8", "--moe_top_k=2",
                                                     "--moe_hidden=768"], "gptoss124_dense", by_mfu=True),
    Row("llama1b_ref", "Llama 3.2 1B's shape at 2,048 tokens, plain loop", LLAMA1B, plain=True),
    Row("llama1b", "config/llama_1B.yaml: one process unwrapped, compiled, micro_batch 8 x 1", LLAMA1B,
        "llama1b_ref"),
    Row("llama1b_fsdp", "llama1b, force_fsdp (FULL_SHARD; auto: a unit a block, 6.9 ms of compute each at the peak)",
        LLAMA1B + ["--force_fsdp=true"], "llama1b"),
    Row("llama1b_window", "llama1b with a sliding window of 512 on every layer (the flash kernel's own window)",
        LLAMA1B + ["--sliding_window=512"], "llama1b"),
    Row("llama1b_ac", "llama1b with activation checkpointing, 16 rows a micro-batch and a step",
        LLAMA1B + ["--activation_checkpointing=true", "--train_batch=16", "--micro_batch=16"], "llama1b_ref"),
    # FP8 (docs/fp8.md), each against its bf16 row: torchao's cut-offs (fp8_layers auto) take every linear
    # of Llama 1B under tensorwise, its 8192-wide c_fc alone under rowwise; GPT-2 124M's c_attn and c_fc
    Row("llama1b_fp8", "llama1b with fp8 tensorwise, auto (all 64 block linears)", LLAMA1B + ["--fp8=tensorwise"],
        "llama1b"),
    Row("llama1b_fp8_rowwise", "llama1b with fp8 rowwise, auto (the 16 c_fc)", LLAMA1B + ["--fp8=rowwise"], "llama1b"),
    Row("gpt2_fp8", "gpt2 with fp8 tensorwise, auto (c_attn and c_fc, 24 of 48)", GPT2 + ["--fp8=tensorwise"], "gpt2"),
    Row("gpt2_fsdp_fp8", "gpt2_fsdp with fp8 tensorwise, auto: the converted weights all-gathered in FP8",
        GPT2_FSDP + ["--fp8=tensorwise"], "gpt2_fsdp"),
    Row("gpt2_micro16", "gpt2, micro_batch 16 x 4", GPT2 + ["--micro_batch=16"], "gpt2_ref"),
    Row("gpt2_micro64", "gpt2, micro_batch 64 x 1", GPT2 + ["--micro_batch=64"], "gpt2_ref"),
    Row("gpt2_blocks_only", "gpt2, compile of the blocks only (the loss's chunks eager)", GPT2, "gpt2_ref",
        variant="blocks_only"),
    Row("gpt2_cudnn", "gpt2, SDPA on cuDNN's attention instead of flash", GPT2, "gpt2_ref", variant="cudnn"),
    Row("gpt2_cudagraphs", "gpt2, the blocks compiled in mode reduce-overhead: replayed as CUDA graphs", GPT2,
        "gpt2", variant="cudagraphs"),
    Row("gpt2_muon", "gpt2 with Muon (the blocks' matrices) beside AdamW", GPT2 + ["--optimizer=muon"], "gpt2"),
    Row("gpt2_autotune", "gpt2, compile_mode max-autotune-no-cudagraphs",
        GPT2 + ["--compile_mode=max-autotune-no-cudagraphs"], "gpt2_ref"),
    # the 8-GPU configs as shipped (their micro_batch, strategy, compile, activation checkpointing) on
    # one GPU wrapped as a cluster wraps them (force_fsdp), one rank's micro-steps: the figures their
    # comments give
    *(Row(f"shipped_{name}", f"config/{name}.yaml as shipped, FSDP on one GPU, {steps} micro-batch(es) of {micro}",
          [f"config/{name}.yaml", f"--vocab_size={vocab}", f"--train_batch={steps * micro}", "--force_fsdp=true"])
      for name, (micro, steps, vocab) in ((name, shipped_share(name)) for name in
                                   ("gpt2_124M", "llama_124M", "recipe_124M", "train90M_fsdp", "train300M_fsdp", "llama_1B"))),
]


def whole_logits_loss(h, weight, targets, softcap=None, chunk_fn=None, chunks_for=None):
    """The loss before loss.py (chunked_cross_entropy's arguments): the whole (B, T, V) logits, then
    cross-entropy in fp32."""
    import torch
    import torch.nn.functional as F
    logits = h @ weight.t()
    z = logits.float() if softcap is None else softcap * torch.tanh(logits.float() / softcap)
    return F.cross_entropy(z.flatten(0, -2), targets.flatten())


def apply_variant(variant: str) -> None:
    """Changes that are measurements, not options: made in this process before the trainer runs."""
    import torch
    from fsdp_gpt import model
    from fsdp_gpt.distributed import parallelize
    if variant == "cudagraphs":  # the loss's chunks stay as they are (a chunk's replay would overwrite the last's)
        def compile_model(gpt, mode):
            for block in gpt.blocks:
                block.compile(mode="reduce-overhead")
            gpt.head_loss_chunk = torch.compile(gpt.head_loss_chunk, mode=mode)
        parallelize.compile_model = compile_model
    elif variant == "logits_loss":
        model.chunked_cross_entropy = whole_logits_loss
    elif variant == "blocks_only":
        parallelize.compile_model = lambda gpt, mode: [block.compile(mode=mode) for block in gpt.blocks]
    elif variant == "cudnn":
        torch.backends.cuda.enable_flash_sdp(False)  # SDPA's next choice on Hopper: cuDNN's kernel
    elif variant:
        raise SystemExit(f"unknown variant {variant}")


def train_variant(variant: str, argv: list[str]) -> None:
    apply_variant(variant)
    import train_fsdp
    from fsdp_gpt.checkpoint.fsdp_ckpt import CheckpointManager
    # outside the timed steps: the val loss at step 0 (a no_grad recompile) and the last checkpoint
    train_fsdp.evaluate = lambda *args: (math.nan, "", {}, {})
    CheckpointManager.save = lambda self, step, model, optimizer: None
    from fsdp_gpt.config_parse import parse_args
    from fsdp_gpt.distributed.launch import run_entry_point
    run_entry_point(lambda: train_fsdp.train(parse_args(argv)))


def plain_loop(argv: list[str]) -> None:
    """The reference: what a user writes without this trainer, on the same model and batch."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from fsdp_gpt.config_parse import parse_args
    from fsdp_gpt.data.prepare import prepare_data
    from fsdp_gpt.model import GPT, GPTConfig
    cfg = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = prepare_data(cfg.data_path, cfg.data_source, cfg.tokenizer)
    data = np.memmap(os.path.join(cfg.data_path, "train.bin"), dtype=np.dtype(meta["dtype"]), mode="r")
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(**cfg.model_config)).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": others, "weight_decay": 0.0}], lr=cfg.learning_rate,
                                  betas=(cfg.beta1, cfg.beta2), fused=True)

    def loss_of(x, y):
        return F.cross_entropy(model(x)[0].float().flatten(0, 1), y.flatten())
    loss_of = torch.compile(loss_of) if cfg.compile else loss_of
    bf16 = device.type == "cuda" and cfg.dtype != "fp32"
    T, accum = cfg.block_size, cfg.train_batch // cfg.micro_batch
    generator = np.random.default_rng(cfg.seed)
    mark = time.perf_counter()
    for step in range(1, cfg.max_iters + 1):
        for _ in range(accum):
            starts = generator.integers(0, len(data) - T - 1, size=cfg.micro_batch)
            xy = torch.from_numpy(np.stack([data[s:s + T + 1] for s in starts]).astype(np.int64))
            xy = xy.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else xy
            with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                loss = loss_of(xy[:, :-1], xy[:, 1:]) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % cfg.log_interval == 0:
            loss.item()  # waits for the device, as the trainer's log line does
            now = time.perf_counter()
            peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else 0.0
            print(f"step {step} | {cfg.log_interval * cfg.train_batch * T / (now - mark):.0f} tok/s | mem {peak:.2f} GB",
                  flush=True)
            mark = now


PLAIN_LINE = re.compile(r"^step (\d+) \| (\d+) tok/s \| mem ([\d.]+) GB", re.M)


def logged(text: str, tb: str | None) -> list[tuple[int, float, float]]:
    """(step, tok/s, peak GB) of each log step: the plain loop's lines, or a trainer run's figures (tb:
    its tensorboard_dir, where metrics.jsonl is; the console line is for people)."""
    if tb is None:
        return [(int(s), float(r), float(m)) for s, r, m in PLAIN_LINE.findall(text)]
    from fsdp_gpt.observe.figures_file import read_figures
    rates, peaks = read_figures(tb, "perf/tokens_per_sec"), read_figures(tb, "mem/peak_gb")
    return [(step, rate, peaks[step]) for step, rate in rates.items()]


def steady(text: str, tb: str | None) -> tuple[float, float] | None:
    """(tok/s over the steps after the first line, up to STEPS; the largest peak GB among them)."""
    lines = logged(text, tb)
    timed = [(r, m) for s, r, m in lines if LOG_EVERY < s <= STEPS]
    if not timed:
        return None
    return statistics.harmonic_mean([r for r, _ in timed]), max(m for _, m in timed)  # equal tokens per line


def flops_per_token(args: list[str], extra: list[str]) -> int:
    import torch
    from fsdp_gpt.config_parse import parse_args
    from fsdp_gpt.model import GPT, GPTConfig
    cfg = parse_args(args + BYTES + extra)
    with torch.device("meta"):
        return GPT(GPTConfig(**cfg.model_config)).flops_per_token()


# a kernel's share of the traced steps, by the first pattern its name matches
KERNEL_KINDS = [
    ("attention", r"flash|fmha|attention|sdpa|cudnn"),
    ("loss", r"logsumexp|log_softmax|nll_loss|cross_entropy|scatter_add"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("FSDP copies and collectives", r"nccl|all_gather|reduce_scatter|chunk_cat|split_with_sizes|copy_in|copy_out"),
    ("matmuls", r"gemm|xmma|cutlass|nvjet|sm90_|sm80_|_mm_|triton_tem|splitk"),
]


def split_trace(path: str) -> tuple[dict[str, float], list[tuple[str, float]]] | None:
    """({kind: share of the traced window}, the 12 costliest kernels (name, ms)) of a Chrome trace;
    None without GPU kernels in it (a CPU run)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("dur")]
    if not kernels:
        return None
    start, end = min(e["ts"] for e in kernels), max(e["ts"] + e["dur"] for e in kernels)
    kinds = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    by_name = {}
    for e in kernels:
        name = e["name"] if e["cat"] == "kernel" else e["cat"]
        kind = next((k for k, pattern in KERNEL_KINDS if re.search(pattern, name, re.I)), "other")
        kinds[kind] += e["dur"]
        by_name[name] = by_name.get(name, 0.0) + e["dur"]
    busy, reach = 0.0, start  # the union of the kernels' intervals (streams overlap)
    for e in sorted(kernels, key=lambda e: e["ts"]):
        busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], reach))
        reach = max(reach, e["ts"] + e["dur"])
    window = end - start
    shares = {kind: t / window for kind, t in kinds.items()} | {"idle": 1 - busy / window}
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return shares, [(name[:90], t / 1e3) for name, t in top]


def keep_trace(path: str, packed: str) -> None:
    """The trace gzipped without its allocation events (most of its size), for Perfetto or a script."""
    with open(path) as f:
        trace = json.load(f)
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("cat") != "cpu_instant_event"]
    with gzip.open(packed, "wt") as f:
        json.dump(trace, f)


def carried_torchao() -> str:
    """Where the rows' torchao comes from: .torchao/ (put first on this process's path and, through
    PYTHONPATH, on every row's, before an installed torchao) where it holds one, else what is installed."""
    if os.path.isdir(os.path.join(TORCHAO, "torchao")):
        sys.path.insert(0, TORCHAO)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TORCHAO, os.environ.get("PYTHONPATH")) if p)
    from importlib.machinery import PathFinder
    from importlib.metadata import version
    spec = PathFinder.find_spec("torchao")  # what a row finds on its path (whatever this process imported)
    if spec is None:
        return "no torchao (the fp8 rows fail)"
    return f"torchao {version('torchao')} from {os.path.dirname(os.path.dirname(spec.origin))}"


def run_row(row: Row, folder: str, extra: list[str], left: float, trace: bool) -> dict:
    log = os.path.join(folder, f"{row.name}.log")
    own = [f"--checkpoint_dir={folder}/{row.name}/ckpt", f"--tensorboard_dir={folder}/{row.name}/tb"]
    if trace:
        own += [f"--max_iters={TRACED[1]}", f"--profile_steps={TRACED}".replace(" ", "")]
    mode = ["_plain"] if row.plain else ["_train", row.variant or "-"]
    print(f"== {row.name} ({left:.0f} s at most)", flush=True)
    code = run_logged([python(), __file__, *mode, *row.args, *BYTES, *own, *extra], log, left)
    with open(log) as f:
        text = f.read()
    measured = steady(text, None if row.plain else f"{folder}/{row.name}/tb")
    result = {"row": row.name, "what": row.what, "vs": row.vs, "by_mfu": row.by_mfu}
    if code is None or code or measured is None:
        reason = "timed out" if code is None else failure(text, code) if code else "no steady log lines"
        print(f"   fail: {reason}", flush=True)
        return result | {"result": f"fail: {reason}"}
    result |= {"result": "pass", "tok_s": measured[0], "peak_gb": measured[1],
               "flops_per_token": flops_per_token(row.args, extra)}
    traces = glob.glob(os.path.join(folder, row.name, "tb", "profile", "*.pt.trace.json"))
    if traces and (split := split_trace(traces[0])):
        result["split"], result["top"] = split
        keep_trace(traces[0], os.path.join(folder, f"{row.name}.trace.json.gz"))
    print(f"   {measured[0]:,.0f} tok/s", flush=True)
    return result


def table(results: list[dict], peak: float | None) -> str:
    by_name = {r["row"]: r for r in results}
    lines = ["| row | what it runs | tok/s | MFU | peak GB | ratio |", "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if "tok_s" not in r:
            lines.append(f"| {r['row']} | {r['what']} |  |  |  | {r['result']} |")
            continue
        mfu = f"{r['tok_s'] * r['flops_per_token'] / peak:.1%}" if peak else "n/a"
        other = by_name.get(r["vs"], {})
        flops = (r["flops_per_token"], other.get("flops_per_token")) if r.get("by_mfu") else (1, 1)
        ratio = f"{r['tok_s'] * flops[0] / (other['tok_s'] * flops[1]):.3f}x {r['vs']}" if "tok_s" in other else ""
        lines.append(f"| {r['row']} | {r['what']} | {r['tok_s']:,.0f} | {mfu} | {r['peak_gb']:.1f} | {ratio} |")
    for r in results:
        if "split" in r:
            split = ", ".join(f"{kind} {share:.1%}" for kind, share in r["split"].items())
            top = "; ".join(f"{name} {ms:.1f} ms" for name, ms in r["top"])
            lines += ["", f"GPU time of {r['row']}'s steps {TRACED[0]}-{TRACED[1]}: {split}", f"costliest kernels: {top}"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], usage=__doc__)
    parser.add_argument("--rows", default=os.environ.get("MFU_ROWS", ""), help="comma-separated row names, or all")
    parser.add_argument("--budget", type=float, default=float(os.environ.get("MFU_BUDGET", 450)),
                        help="seconds for all rows together")
    parser.add_argument("--out", default=os.environ.get("MFU_DIR", os.path.join(ROOT, "bench", "runs", "mfu")))
    parser.add_argument("--trace", default="", help="comma-separated rows to trace besides those that always do")
    parser.add_argument("--keep", help="a folder to copy the table, results, logs and traces to (a lent GPU: $OUT/mfu)")
    parser.add_argument("--list", action="store_true")
    args, extra = parser.parse_known_args()
    if args.list or not args.rows:
        return print("\n".join(f"{row.name}: {row.what}" for row in ROWS)) or 0
    named = {row.name: row for row in ROWS}
    unknown = set(args.rows.split(",")) - set(named) - {"all"}
    if unknown:
        sys.exit(f"error: no rows named {', '.join(sorted(unknown))} (--list)")
    chosen = ROWS if args.rows == "all" else [named[name] for name in args.rows.split(",")]  # in the order named
    import torch
    from fsdp_gpt.distributed.peak_flops import gpu_peak_flops
    peak = gpu_peak_flops(torch.cuda.get_device_name(), torch.bfloat16) if torch.cuda.is_available() else None
    torchao = carried_torchao() if any("--fp8" in " ".join(row.args) for row in chosen) else ""
    print(machine(), torchao, flush=True)
    os.makedirs(args.out, exist_ok=True)  # for the table, also where no row runs
    start, results = time.monotonic(), []
    for row in chosen:
        left = args.budget - (time.monotonic() - start)
        failed = [r for r in results[-2:] if r["result"].startswith("fail")]
        if left < 30 or len(failed) == 2:  # two failures in a row: the rest would fail alike, keep the time
            why = "the budget is spent" if left < 30 else "the two rows before it failed"
            results.append({"row": row.name, "what": row.what, "vs": row.vs, "result": f"not run: {why}"})
            continue
        results.append(run_row(row, args.out, extra, left, row.trace or row.name in args.trace.split(",")))
    text = table(results, peak) + f"\n\n{time.strftime('%Y-%m-%d')}, {machine()}{f', {torchao}' if torchao else ''}"
    print(text)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    if args.keep:
        bring_back(args.out, args.keep, ("table.md", "results.json"))
    return 1 if any(r["result"].startswith("fail") for r in results) else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["_plain"]:
        plain_loop(sys.argv[2:])
    elif sys.argv[1:2] == ["_train"]:
        train_variant("" if sys.argv[2] == "-" else sys.argv[2], sys.argv[3:])
    else:
        sys.exit(main())

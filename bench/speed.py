"""Training speed, measured side by side in one run: alternating runs, medians, ratios.

    python bench/speed.py plain [--rounds 5] [--compile]  # trainer vs a plain PyTorch loop, 1 process
    python bench/speed.py plain --widths 8                # the same at 8 wide: the step's fixed cost
    python bench/speed.py scaling [--rounds 3]            # 2 and 4 ranks vs 1, each strategy and DDP
    python bench/speed.py loader                          # data loader tokens/s vs the trainer's
    python bench/speed.py muon [--rounds 3]               # step time with muon vs adamw, 1 and 2 ranks
    python bench/speed.py muon_step                       # Muon's optimizer step alone: its share of a step
    python bench/speed.py fsdp [--rounds 3]               # 2 ranks: explicit prefetch, reduce_dtype bf16 vs fp32
    python bench/speed.py nanogpt --nanogpt PATH          # trainer vs nanoGPT's train.py (a checkout of it at PATH)
    python bench/speed.py fixed_cost [--rounds 3]         # FSDP2's fixed cost: 12 tiny blocks, 1 and 2 ranks

The model: 4 layers, 256 wide (plain: 128 and 256, or --widths), block 128, batch 16, fp32,
byte tokens (the demo's data).
Each run's tokens/s is the median over intervals of WARMUP steps (plain: PLAIN_INTERVAL) after the first interval
(start-up, compilation). Threads per rank: the machine's cores divided by the ranks.
"""
import argparse
import os
import pickle
import re
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from fsdp_gpt.config_parse import parse_args  # noqa: E402
from fsdp_gpt.data.prepare import prepare_data  # noqa: E402
from fsdp_gpt.data.loader import BatchLoader  # noqa: E402
from fsdp_gpt.model import GPT, GPTConfig  # noqa: E402
from fsdp_gpt.observe.figures_file import read_figures  # noqa: E402
from fsdp_gpt.optim.muon import newton_schulz_share  # noqa: E402

DEMO = os.path.join(ROOT, "config", "demo_cpu.yaml")
WIDTH = 256


def shape(width: int = WIDTH) -> dict:
    return dict(n_layer=4, n_head=4, n_embd=width, block_size=128)


BATCH, WARMUP, STEPS = 16, 3, 24  # timed: steps WARMUP+1 .. WARMUP+STEPS, in intervals of WARMUP
# plain: intervals of 10 steps (the trainer's default log_interval: its log line costs what it costs in
# a run), 6 of them timed after the first. Runs of 27 steps measured the first seconds of a process,
# which vary by several percent from run to run on a shared machine: ratios from 0.92 to 0.98.
PLAIN_INTERVAL, PLAIN_STEPS = 10, 60
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2", "DDP")


def demo_data() -> str:
    cfg = parse_args([DEMO])
    path = os.path.join(ROOT, cfg.data_path)
    prepare_data(path, cfg.data_source, cfg.tokenizer)
    return path


def in_turn(a, b, round_: int) -> tuple[float, float]:
    """(a(), b()), run A B in even rounds and B A in odd ones: a steady drift of the machine favours neither."""
    if round_ % 2:
        second = b()
        return a(), second
    first = a()
    return first, b()


def median_after_warmup(rates: list[float]) -> float:
    return statistics.median(rates[1:])


def run(cmd: list[str], nproc: int, workdir: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, os.cpu_count() // nproc)))
    result = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=1200)
    if result.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{result.stderr[-2000:]}")
    return result.stdout


def trainer_rate(nproc: int, workdir: str, strategy: str = "FULL_SHARD", compile: bool = False,
                 width: int = WIDTH, optimizer: str = "adamw", interval: int = WARMUP, steps: int = STEPS,
                 **extra) -> float:
    """Tokens/s the trainer logs (rank 0's line: the whole global batch); extra: more config keys."""
    launch = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    mode = ["--fsdp=false"] if strategy == "DDP" else [f"--sharding_strategy={strategy}", "--fsdp_size=2"]
    settings = shape(width) | dict(
        train_batch=BATCH, micro_batch=BATCH // nproc, max_iters=interval + steps, log_interval=interval,
        eval_interval=10 ** 6, eval_iters=1, save_interval=10 ** 6, dtype="fp32", compile=compile, sample_tokens=0,
        checkpoint_dir="ckpt", tensorboard_dir="tb", data_path=demo_data(), optimizer=optimizer,
        # the plain loop's training: its values, and so the arithmetic they cost, alike
        learning_rate=6e-4, min_lr=6e-4, warmup_iters=0, lr_schedule="constant") | extra
    run(launch + [os.path.join(ROOT, "train_fsdp.py"), DEMO] + mode + [f"--{k}={v}" for k, v in settings.items()],
        nproc, workdir)
    return median_after_warmup(list(read_figures(os.path.join(workdir, "tb"), "perf/tokens_per_sec").values()))


def plain_rate(workdir: str, compile: bool, width: int) -> float:
    out = run([sys.executable, __file__, "_plain_loop", f"--widths={width}"] + (["--compile"] if compile else []),
              1, workdir)
    return median_after_warmup([float(r) for r in out.split()])


def plain_loop(compile: bool, width: int, interval: int = PLAIN_INTERVAL, steps: int = PLAIN_STEPS) -> None:
    """What a user would write without this trainer: same model, batch, AdamW, clipping."""
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = np.memmap(os.path.join(demo_data(), "train.bin"), dtype=np.uint16, mode="r")
    model = GPT(GPTConfig(vocab_size=256, **shape(width))).to(device)
    if compile:
        model.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    T = shape()["block_size"]
    mark = time.perf_counter()
    for step in range(1, interval + steps + 1):
        starts = torch.randint(len(data) - T - 1, (BATCH,)).tolist()
        xy = torch.from_numpy(np.stack([data[s:s + T + 1] for s in starts]).astype(np.int64)).to(device)
        _, loss = model(xy[:, :-1], xy[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % interval == 0:
            loss.item()  # wait for the device, as the trainer's log line does
            now = time.perf_counter()
            print(interval * BATCH * T / (now - mark), flush=True)
            mark = now


def bench_against(label: str, other_rate, rounds: int, widths: list[int], workdir: str, compile: bool = False) -> None:
    """The trainer against another loop (other_rate(width) -> its tok/s), in alternating runs."""
    for width in widths:
        trainer, other = [], []
        for round_ in range(rounds):  # alternate: drifts of a shared machine hit both sides alike
            t, o = in_turn(lambda: trainer_rate(1, workdir, compile=compile, width=width, interval=PLAIN_INTERVAL,
                                                steps=PLAIN_STEPS), lambda: other_rate(width), round_)
            trainer.append(t)
            other.append(o)
            print(f"  {width} wide: trainer {t:,.0f} tok/s, {label} {o:,.0f} tok/s", flush=True)
        t, o = max(trainer), max(other)
        tokens = BATCH * shape()["block_size"]  # a step's
        # pair by pair: each trainer run against the other run beside it, which the machine's drift
        # (15% over minutes here) hits alike; one lucky run moves neither this nor the medians
        pairs = statistics.median(a / b for a, b in zip(trainer, other))
        print(f"{width} wide, compile={compile}: best of {rounds} alternating runs: trainer {t:,.0f} tok/s, {label} "
              f"{o:,.0f} tok/s, ratio {t / o:.3f}; medians: ratio "
              f"{statistics.median(trainer) / statistics.median(other):.3f}; median of the pairs' ratios {pairs:.3f}; "
              f"the trainer's own cost {1e3 * (tokens / t - tokens / o):.2f} ms a step (best of each)", flush=True)


def nanogpt_rate(checkout: str, workdir: str, width: int, iters: int = PLAIN_INTERVAL + PLAIN_STEPS) -> float:
    """Tokens/s of nanoGPT's own train.py (karpathy/nanoGPT, a checkout the user names: not part of this
    project) on the demo's bytes at the plain loop's shape and settings: the median over its logged
    iterations after the first interval. It reads configurator.py and data/{dataset}/ from its working
    directory, so the run's folder gets links to both (and meta.pkl: the vocabulary)."""
    folder = os.path.join(workdir, "nanogpt")
    data = os.path.join(folder, "data", "demo")
    os.makedirs(data, exist_ok=True)
    for name, source in (("configurator.py", os.path.join(checkout, "configurator.py")),
                         ("data/demo/train.bin", os.path.join(demo_data(), "train.bin")),
                         ("data/demo/val.bin", os.path.join(demo_data(), "val.bin"))):
        if not os.path.lexists(os.path.join(folder, name)):
            os.symlink(source, os.path.join(folder, name))
    with open(os.path.join(data, "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": 256}, f)
    settings = shape(width) | dict(dataset="demo", device="cpu", compile=False, dtype="float32", batch_size=BATCH,
                                   gradient_accumulation_steps=1, dropout=0.0, bias=True, max_iters=iters,
                                   log_interval=1, eval_interval=10 ** 6, eval_iters=1, always_save_checkpoint=False,
                                   learning_rate=6e-4, decay_lr=False, weight_decay=0.1, grad_clip=1.0,
                                   out_dir=os.path.join(folder, "out"), wandb_log=False)
    out = run([sys.executable, os.path.join(checkout, "train.py")] + [f"--{k}={v}" for k, v in settings.items()], 1, folder)
    times = [float(ms) for ms in re.findall(r"^iter \d+: loss \S+, time ([\d.]+)ms", out, re.M)]
    return BATCH * shape()["block_size"] / (statistics.median(times[PLAIN_INTERVAL:]) / 1e3)


def bench_nanogpt(rounds: int, widths: list[int], checkout: str, workdir: str) -> None:
    if not os.path.exists(os.path.join(checkout, "train.py")):
        sys.exit(f"error: no nanoGPT train.py in {checkout} (git clone https://github.com/karpathy/nanoGPT)")
    bench_against("nanoGPT", lambda width: nanogpt_rate(checkout, workdir, width), rounds, widths, workdir)


def bench_scaling(rounds: int, workdir: str) -> None:
    ratios = {(s, n): [] for s in STRATEGIES for n in (2, 4)}
    base = []
    for _ in range(rounds):
        base.append(trainer_rate(1, workdir))
        for strategy, nproc in ratios:
            ratios[strategy, nproc].append(trainer_rate(nproc, workdir, strategy) / base[-1])
            print(f"  {strategy} x{nproc}: {ratios[strategy, nproc][-1]:.3f} of 1 rank", flush=True)
    print(f"1 rank: {statistics.median(base):,.0f} tok/s ({os.cpu_count()} threads)")
    print("| strategy | 2 ranks / 1 | 4 ranks / 1 |\n| --- | --- | --- |")
    for strategy in STRATEGIES:
        print(f"| {strategy} | {statistics.median(ratios[strategy, 2]):.2f} | {statistics.median(ratios[strategy, 4]):.2f} |")


def bench_loader(workdir: str) -> None:
    path = demo_data()
    meta = prepare_data(path, None, "bytes")
    loader = BatchLoader({"data": (path, meta)}, shape()["block_size"], BATCH, BATCH, 0, 1, 0, torch.device("cpu"))
    n_steps, start = 200, time.perf_counter()
    for step in range(1, n_steps + 1):
        for x, y, _ in loader.micro_batches(step):
            pass
    loader_rate = n_steps * BATCH * shape()["block_size"] / (time.perf_counter() - start)
    consumed = trainer_rate(1, workdir)
    print(f"loader {loader_rate:,.0f} tok/s, trainer consumes {consumed:,.0f} tok/s: "
          f"{loader_rate / consumed:.0f}x headroom")


def bench_muon(rounds: int, workdir: str) -> None:
    """Step time is 1 / tokens/s at a fixed batch: muon's cost is adamw's rate over muon's."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, **shape()))
    print(f"Newton-Schulz adds {newton_schulz_share(model, BATCH * shape()['block_size']):.1%} to a step's "
          f"training FLOPs at this batch ({BATCH} x {shape()['block_size']} tokens)", flush=True)
    for nproc in (1, 2):
        ratios = []
        for round_ in range(rounds):
            adamw, muon = in_turn(lambda: trainer_rate(nproc, workdir, optimizer="adamw"),
                                  lambda: trainer_rate(nproc, workdir, optimizer="muon"), round_)
            ratios.append(adamw / muon)
            print(f"  {nproc} rank(s): adamw {adamw:,.0f} tok/s, muon {muon:,.0f} tok/s", flush=True)
        print(f"{nproc} rank(s), FULL_SHARD: step time muon / adamw {statistics.median(ratios):.3f} "
              f"(median of {rounds} alternating pairs)", flush=True)


def bench_fsdp(rounds: int, workdir: str) -> None:
    """FSDP2's levers at 2 ranks, FULL_SHARD, 2 micro-steps a step: explicit prefetch (fsdp_prefetch
    1 and 2 against FSDP2's own order) in fp32, and reduce_dtype bf16 against fp32 under bf16
    compute; each row's step time against its baseline's, pair by pair (A B, then B A). On CPU FSDP2
    waits for each all-gather, so prefetch can only reorder the gathers here, never overlap them."""
    accumulated = dict(micro_batch=BATCH // 4)  # 2 ranks x 4 rows x 2 micro-steps
    rows = {"fsdp_prefetch 1 / 0 (fp32)": (dict(fsdp_prefetch=0), dict(fsdp_prefetch=1)),
            "fsdp_prefetch 2 / 0 (fp32)": (dict(fsdp_prefetch=0), dict(fsdp_prefetch=2)),
            "reduce_dtype bf16 / fp32 (bf16 compute)": (dict(dtype="bf16", reduce_dtype="fp32"),
                                                       dict(dtype="bf16", reduce_dtype="bf16"))}
    def rate(settings: dict) -> float:
        return trainer_rate(2, workdir, interval=5, steps=40, **accumulated, **settings)

    for name, (base, change) in rows.items():
        ratios = []
        for round_ in range(rounds):
            a, b = in_turn(lambda: rate(base), lambda: rate(change), round_)
            ratios.append(a / b)  # step time: the change's over the baseline's
            print(f"  {name}: {b:,.0f} against {a:,.0f} tok/s", flush=True)
        print(f"{name}: step time {statistics.median(ratios):.3f} of the baseline's (median of {rounds} pairs)",
              flush=True)


# fixed_cost's model: 12 blocks too small for their compute to matter (a step is host work), a
# micro-batch of one 32-token row, 2 micro-steps a rank; 200 steps, tok/s the median of the last 5 of
# 10 log lines. Each launch's rows: its baseline (unwrapped, or DDP), then FSDP2 as the trainer lays it
# out (fsdp_blocks_per_unit: auto) under FULL_SHARD and SHARD_GRAD_OP, and FULL_SHARD a unit a block
# (round seven's layout), whose difference from auto is what the units themselves cost.
FIXED_COST_MODEL = dict(n_layer=12, n_head=2, n_embd=32, block_size=32, micro_batch=1)
FIXED_COST_ROWS = {  # name: config keys beside the launch's own
    "baseline": {}, "FULL_SHARD": dict(sharding_strategy="FULL_SHARD"),
    "SHARD_GRAD_OP": dict(sharding_strategy="SHARD_GRAD_OP"),
    "FULL_SHARD, a unit a block": dict(sharding_strategy="FULL_SHARD", fsdp_blocks_per_unit=1)}


def fixed_cost_rate(nproc: int, workdir: str, row: str) -> float:
    fsdp = dict(fsdp=True, force_fsdp=nproc == 1) if row != "baseline" else dict(fsdp=False)  # 1 rank: unwrapped
    settings = FIXED_COST_MODEL | fsdp | FIXED_COST_ROWS[row] | dict(
        train_batch=2 * nproc, max_iters=200, log_interval=20, dtype="fp32", compile=False, eval_interval=10 ** 6,
        eval_iters=1, save_interval=10 ** 6, sample_tokens=0, checkpoint_dir="ckpt", tensorboard_dir="tb",
        data_path=demo_data())
    launch = [sys.executable] + ([] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone",
                                                        f"--nproc_per_node={nproc}"])
    run(launch + [os.path.join(ROOT, "train_fsdp.py"), DEMO] + [f"--{k}={v}" for k, v in settings.items()], nproc,
        workdir)
    rates = read_figures(os.path.join(workdir, "tb"), "perf/tokens_per_sec")
    return statistics.median(rates[step] for step in sorted(rates)[-5:])


def gloo_latency(workdir: str) -> None:
    """What one gloo collective costs at 2 ranks on this machine (the floor under FSDP2's per unit):
    an all-gather and a reduce-scatter of fixed_cost's model (its 162K fp32 parameters, half a rank),
    an all-reduce of one number (the loss's, the norm's); medians of 200."""
    print(run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               "_gloo_latency"], 2, workdir).strip(), flush=True)


def gloo_latency_probe() -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    whole, one = torch.zeros(161_728), torch.zeros(())
    part = torch.zeros(whole.numel() // 2)
    timed = {"all-gather": lambda: dist.all_gather_into_tensor(whole, part),
             "reduce-scatter": lambda: dist.reduce_scatter_tensor(part, whole),
             "all-reduce of one number": lambda: dist.all_reduce(one)}
    medians = {}
    for name, collective in timed.items():
        times = []
        for _ in range(220):
            start = time.perf_counter()
            collective()
            times.append(time.perf_counter() - start)
        medians[name] = statistics.median(times[20:]) * 1e6
    if dist.get_rank() == 0:
        print("gloo at 2 ranks: " + ", ".join(f"{name} {us:.0f} us" for name, us in medians.items()))
    dist.destroy_process_group()


def bench_fixed_cost(rounds: int, workdir: str) -> None:
    """Each launch's rows in turn, the order rotated each round (a drift of the machine favours no
    row); each row's ratio to the baseline beside it, the median over rounds."""
    tokens = FIXED_COST_MODEL["block_size"] * 2  # a rank's step: 2 micro-steps of one row
    for nproc, baseline in ((1, "unwrapped"), (2, "DDP")):
        rates = {row: [] for row in FIXED_COST_ROWS}
        for round_ in range(rounds):
            rows = list(FIXED_COST_ROWS)
            for row in rows[round_ % len(rows):] + rows[:round_ % len(rows)]:
                rates[row].append(fixed_cost_rate(nproc, workdir, row))
            print(f"  {nproc} rank(s), round {round_ + 1}: " + ", ".join(
                f"{row} {r[-1]:,.0f}" for row, r in rates.items()) + " tok/s", flush=True)
        base_ms = 1e3 * tokens * nproc / statistics.median(rates["baseline"])
        print(f"\n{nproc} rank(s): {baseline} {statistics.median(rates['baseline']):,.0f} tok/s, a step {base_ms:.1f} ms\n"
              f"| layout | tok/s / {baseline} | a step, ms | FSDP2's cost a step, ms |\n| --- | --- | --- | --- |")
        step_ms = {}
        for row in list(FIXED_COST_ROWS)[1:]:
            ratio = statistics.median(r / b for r, b in zip(rates[row], rates["baseline"]))
            step_ms[row] = base_ms / ratio
            print(f"| {row} | {ratio:.2f}x | {step_ms[row]:.1f} | {step_ms[row] - base_ms:.1f} |")
        # a unit a block: 12 units and the root; auto: the whole model one unit. 12 units more, each
        # gathered in forward and again in backward, 2 micro-steps a step
        per_unit = (step_ms["FULL_SHARD, a unit a block"] - step_ms["FULL_SHARD"]) / (12 * 2)
        print(f"FULL_SHARD: {per_unit:.2f} ms a unit and micro-step (the 12 block units' cost over the whole "
              f"model's one unit, 2 micro-steps)\n", flush=True)
    gloo_latency(workdir)


def bench_muon_step(rounds: int) -> None:
    """Muon's optimizer step alone, one process, against the model's forward and backward: its share of
    a step (GPT-2 124M's matrices at the plain bench's batch would take minutes on a CPU: this
    model's 4 x 256, 16 x 128 tokens; fp32)."""
    import torch.distributed as dist
    from fsdp_gpt.optim.muon import MuonWithAdamW, is_muon_matrix
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the trainer's one process
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, **shape()))
    matrices = [p for n, p in model.named_parameters() if is_muon_matrix(n, p.shape)]
    others = [p for n, p in model.named_parameters() if not is_muon_matrix(n, p.shape)]
    optimizer = MuonWithAdamW([dict(params=matrices, muon=True, weight_decay=0.1, momentum=0.95),
                               dict(params=others, muon=False, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)],
                              lr=1e-3, device=torch.device("cpu"))
    x = torch.randint(0, 256, (BATCH, shape()["block_size"]))
    forward_backward, step = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        model(x, x)[1].backward()
        middle = time.perf_counter()
        optimizer.step()
        forward_backward.append(middle - start)
        step.append(time.perf_counter() - middle)
        optimizer.zero_grad(set_to_none=True)
    fb, st = statistics.median(forward_backward[1:]), statistics.median(step[1:])
    print(f"{len(matrices)} Muon matrices: step {st * 1e3:.1f} ms, forward and backward {fb * 1e3:.1f} ms: "
          f"the optimizer {st / (st + fb):.1%} of a step (medians of {rounds - 1})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("plain", "scaling", "loader", "muon", "muon_step", "fsdp", "nanogpt",
                                         "fixed_cost", "_plain_loop", "_gloo_latency"))
    parser.add_argument("--nanogpt", help="nanogpt: a checkout of karpathy/nanoGPT")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="plain: compile both sides")
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 256], help="plain: the models' widths")
    args = parser.parse_args()
    if args.what == "_plain_loop":
        return plain_loop(args.compile, args.widths[0])
    if args.what == "_gloo_latency":
        return gloo_latency_probe()
    workdir = os.path.join(ROOT, "bench", "runs")
    os.makedirs(workdir, exist_ok=True)
    print(f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {os.cpu_count()} CPU cores, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}")
    if args.what == "plain":
        bench_against("plain loop", lambda width: plain_rate(workdir, args.compile, width), args.rounds, args.widths,
                      workdir, args.compile)
    elif args.what == "scaling":
        bench_scaling(args.rounds, workdir)
    elif args.what == "muon":
        bench_muon(args.rounds, workdir)
    elif args.what == "fsdp":
        bench_fsdp(args.rounds, workdir)
    elif args.what == "nanogpt":
        bench_nanogpt(args.rounds, args.widths, args.nanogpt or "", workdir)
    elif args.what == "fixed_cost":
        bench_fixed_cost(args.rounds, workdir)
    elif args.what == "muon_step":
        bench_muon_step(max(args.rounds, 3) * 4)
    else:
        bench_loader(workdir)


if __name__ == "__main__":
    main()

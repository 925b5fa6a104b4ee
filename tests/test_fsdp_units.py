"""FSDP's units (fsdp_units.py): auto sizes them by a block's compute against FSDP2's host cost a unit,
and a number lays them out as asked. The runs under each layout: test_parity.py, test_checkpoints.py
(a checkpoint resumed bitwise under another layout), test_collectives.py (one reduction a unit)."""
import pytest
import torch

from fsdp_gpt.config_parse import parse_args
from fsdp_gpt.distributed import fsdp_units
from fsdp_gpt.distributed.fsdp_units import UnitLayout, auto_layout, choose_layout
from fsdp_gpt.distributed.precision import Chip
from fsdp_gpt.model import GPT, GPTConfig
from conftest import DEMO, ROOT, TINY, overrides
from test_bad_input import train_in_process

GPU = Chip("cuda", "NVIDIA H100 80GB HBM3", (9, 0), bf16=True)  # 989 TFLOP/s in bf16 (peak_flops' table)


def meta_model(config: str, *overrides: str) -> tuple[GPT, int]:
    """The config's model on the meta device, and a rank's tokens a micro-step."""
    cfg = parse_args([f"{ROOT}/config/{config}", "--vocab_size=50304", *overrides])
    with torch.device("meta"):
        return GPT(GPTConfig.of(cfg)), cfg.micro_batch * cfg.block_size


def test_a_number_lays_out_that_many_blocks_a_unit_and_auto_balances():
    assert UnitLayout.of(5, 12, "").sizes == (5, 5, 2)
    assert UnitLayout.of(12, 12, "").whole_model
    assert UnitLayout.balanced(2, 12, "").sizes == (6, 6)
    assert UnitLayout.balanced(6, 13, "").sizes == (3, 2, 2, 2, 2, 2)
    assert UnitLayout.balanced(1, 12, "").whole_model
    blocks = list(range(5))
    assert UnitLayout.of(2, 5, "").units(blocks) == [[0, 1], [2, 3], [4]]
    assert UnitLayout.of(5, 5, "").units(blocks) == []  # the root's unit holds them


@pytest.mark.parametrize("config, overrides, sizes", [
    # GPT-2 124M on an H100: a block computes 1.7 ms a micro-step of 32 x 1,024 tokens at the peak, 3.4 at 64
    ("gpt2_124M.yaml", ["--micro_batch=32"], (3,) * 4),
    ("gpt2_124M.yaml", [], (2,) * 6),
    ("llama_1B.yaml", [], (1,) * 16),  # 6.9 ms a block: a unit each
])
def test_auto_on_a_gpu(config, overrides, sizes):
    model, tokens = meta_model(config, *overrides)
    assert auto_layout(model, tokens, GPU, torch.bfloat16).sizes == sizes


@pytest.mark.parametrize("config, overrides, sizes", [
    ("gpt2_124M.yaml", [], (2,) * 6), ("llama_124M.yaml", [], (3,) * 4), ("train90M_fsdp.yaml", [], (3,) * 4),
    ("train300M_fsdp.yaml", [], (5,) * 4), ("llama_124M.yaml", ["--n_layer=7"], (2, 2, 2, 1))])
def test_auto_on_gpus_that_communicate_keeps_units_enough_to_overlap(config, overrides, sizes):
    """Several ranks on GPUs: at least 4 units, whose gathers and reductions hide behind compute
    (alone, llama_124M would take 2 of 6 blocks, train90M the whole model, train300M 3 of 7, 7 and 6;
    7 of llama_124M's blocks one unit: 4 units then, not 7 of a block)."""
    model, tokens = meta_model(config, *overrides)
    layout = auto_layout(model, tokens, GPU, torch.bfloat16, overlap=True)
    assert layout.sizes == sizes
    assert ("whose collectives overlap compute" in layout.describe()) == (config != "gpt2_124M.yaml")


def test_auto_gathers_a_gib_a_unit_at_most():
    """Llama 2 7B's blocks (4,096 wide, 32 heads, MLP 11,008: 202M parameters, 404 MB a block in bf16)
    compute in 0.08 ms at 64 tokens a micro-step: by host cost alone the whole model would be one unit;
    2 blocks a unit (in fp32, 808 MB: a block a unit)."""
    model, tokens = meta_model("llama_1B.yaml", "--n_embd=4096", "--n_head=32", "--n_kv_head=32",
                               "--ffn_hidden=11008", "--block_size=64", "--micro_batch=1")
    layout = auto_layout(model, tokens, GPU, torch.bfloat16)
    assert layout.sizes == (2,) * 8 and "at most 2 blocks a unit (1 GiB gathered)" in layout.describe()
    assert auto_layout(model, tokens, GPU, torch.float32).sizes == (1,) * 16


def test_auto_under_cpu_offload_keeps_a_unit_a_block():
    """Offloading is asked for memory: no unit gathers more than a block (decided from the config,
    before any rank is asked)."""
    cfg = parse_args([DEMO, "--cpu_offload=true", "--n_layer=6", "--vocab_size=256"])
    with torch.device("meta"):
        model = GPT(GPTConfig.of(cfg))
    assert choose_layout(cfg, model, Chip("cpu"), torch.float32).sizes == (1,) * 6


def test_auto_on_an_unknown_gpu_keeps_a_unit_a_block():
    model, tokens = meta_model("gpt2_124M.yaml")
    layout = auto_layout(model, tokens, Chip("cuda", "NVIDIA Future GPU", (12, 0), bf16=True), torch.bfloat16)
    assert layout.sizes == (1,) * 12 and "unknown" in layout.describe()


def test_auto_on_this_cpu(monkeypatch):
    """One thread's vector peak (a rank's, as the tests launch them): the tests' tiny model and the
    fixed-cost bench's 12 blocks of 32 are one unit; the 25M model of test_scale.py at 64 tokens a
    micro-step keeps a unit a block."""
    one_thread = fsdp_units.vector_peak_flops(1)
    if one_thread is None:
        pytest.skip("/proc/cpuinfo tells no vector width or clock here: auto times a matmul instead")
    monkeypatch.setattr(fsdp_units, "device_peak_flops", lambda chip, dtype: one_thread[0])
    cpu = Chip("cpu")
    for keys in (["--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=32", "--micro_batch=2"],
                 ["--n_layer=12", "--n_head=2", "--n_embd=32", "--block_size=32", "--micro_batch=1"]):
        model, tokens = meta_model("demo_cpu.yaml", *keys)
        assert auto_layout(model, tokens, cpu, torch.float32).whole_model
    model, tokens = meta_model("demo_cpu.yaml", "--n_layer=8", "--n_head=8", "--n_embd=512", "--block_size=64",
                               "--micro_batch=1")
    assert auto_layout(model, tokens, cpu, torch.float32).sizes == (1,) * 8


def test_the_key_refuses_what_is_not_auto_or_a_positive_count():
    from fsdp_gpt.config import UserError
    for value in ("0", "some", "-2"):
        with pytest.raises(UserError, match="fsdp_blocks_per_unit must be auto or 1 or more blocks"):
            parse_args([DEMO, f"--fsdp_blocks_per_unit={value}"])


@pytest.mark.parametrize("settings, said", [
    # one process runs unwrapped: nothing to lay out
    (dict(fsdp_blocks_per_unit=2), "note: fsdp_blocks_per_unit=2 takes no effect: one process runs the model unwrapped, "
                                   "nothing sharded (force_fsdp: true wraps it)"),
    # the depth counts units: 3 blocks in units of 2 and 1 prefetch one ahead at most
    (dict(force_fsdp=True, n_layer=3, fsdp_blocks_per_unit=2, fsdp_prefetch=2),
     "note: fsdp_prefetch=2 reaches past the 2 FSDP units of this layout: prefetching 1"),
    (dict(force_fsdp=True, fsdp_blocks_per_unit=2, fsdp_prefetch=1),
     "note: fsdp_prefetch=1 reaches past the 1 FSDP unit of this layout: nothing to prefetch (the whole model one unit)"),
])
def test_a_key_the_layout_takes_no_effect_of_says_so(settings, said, corpus, tmp_path, monkeypatch, capsys):
    argv = [DEMO] + overrides(**(TINY | corpus | dict(max_iters=1, eval_interval=100, checkpoint_dir="ckpt",
                                                       tensorboard_dir="tb") | settings))
    assert train_in_process(argv, tmp_path, monkeypatch) == 0
    assert said in capsys.readouterr().out.splitlines()

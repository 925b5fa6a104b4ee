"""gpt-oss (fsdp_gpt/families/gpt_oss.py) beyond its row in test_families.py: a folder transformers
saves, its experts in MXFP4 (blocks and scales made here) as the published folders hold them, read as
transformers dequantizes them, bit for bit; what a folder sets that is not built, refused by name; the
optimizers' share of its parameters. Then trained from that folder: a step at learning rate 0 exports
transformers' logits of the folder, the export loads as GptOssForCausalLM; 2 ranks train as one process
at ep_size 1 and 2, 4 ranks at ep_size 4; ep_size 2's sharded resume is bitwise, and resharded to one
process within 1e-4."""
import json
import os
import pathlib
import re

import pytest
import torch

from conftest import ROOT, assert_quiet, needs_class, needs_transformers, scalars, shared
from fsdp_gpt.config import UserError
from fsdp_gpt.hf_format import hf_config, hf_model_keys, read_hf_folder
from fsdp_gpt.model import GPT, GPTConfig
from fsdp_gpt.mxfp4 import dequantize

# a small folder of every feature: 4 experts (top 2) of width 64 (a multiple of MXFP4's 32), a window of 16
# on every other layer (rows of 64 are longer), YaRN stretching 64 positions 4 times
CONFIG = dict(vocab_size=576, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2,
              sliding_window=16, rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                                      truncate=False, original_max_position_embeddings=64,
                                                      rope_theta=150000.0))
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}


def make_folder(folder: str) -> None:
    """GptOssForCausalLM saved by transformers, every weight away from its start, then its experts' matrices
    replaced by MXFP4 blocks of random codes and scales of 2^-7 .. 2^-4, as config.json's quantization_config says
    (weights up to 0.375: with scales to 2^0 a quarter of the gates passed the clamp at 7, and one near it fell on
    the other side in 2 ranks' rounding, its gradient with it, likely: a grad norm 7e-5 from one process's at equal
    losses and routing);
    a byte-level tokenizer beside it (gpt-oss's o200k is one too)."""
    from safetensors.torch import load_file, save_file
    from transformers import GptOssConfig, GptOssForCausalLM

    from test_continued_pretraining import family_tokenizer
    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    tensors, g = load_file(path), torch.Generator().manual_seed(1)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows_in, rows_out = tensors.pop(name).shape  # (experts, in, out): stored by output row
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (experts, rows_out, rows_in // 32, 16), generator=g,
                                                  dtype=torch.uint8)
        tensors[f"{name}_scales"] = torch.randint(120, 124, (experts, rows_out, rows_in // 32), generator=g,
                                                  dtype=torch.uint8)
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config | {"quantization_config": MXFP4}, f)
    family_tokenizer(folder, "bytelevel", "PreTrainedTokenizerFast")


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory) -> str:
    import transformers
    needs_class("GptOssForCausalLM")
    return shared(tmp_path_factory, f"gpt_oss_mxfp4_{transformers.__version__}", make_folder)


def dequantized_by_transformers(folder: str):
    """The folder as transformers loads it for training: its MXFP4 experts dequantized to fp32 (Mxfp4Config's
    dequantize, as its docs advise for training and as a CPU without its kernels does anyway)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                quantization_config=Mxfp4Config(dequantize=True)).eval()


def test_mxfp4_values_are_transformers_dequantization_bit_for_bit():
    """Every code of both nibbles under every one of the 256 scales (2^-127 .. 2^127 and 255's
    infinities), in fp32, bf16 and fp16 (which overflows early): the same bits as transformers' own."""
    needs_transformers("its MXFP4 integration")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    codes = torch.arange(256, dtype=torch.uint8).view(16, 16)  # (groups, 16 bytes): each byte once
    blocks = codes.expand(1, 256, 16, 16).clone()  # (experts, rows, groups, 16)
    scales = torch.arange(256, dtype=torch.uint8).view(256, 1).expand(1, 256, 16).clone()  # a scale a row
    for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16), (torch.float16, torch.int16)):
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        ours = dequantize(blocks, scales, dtype)
        assert ours.shape == theirs.shape == (1, 512, 256) and ours.dtype == dtype
        assert torch.equal(ours.view(bits), theirs.view(bits)), dtype


def test_an_mxfp4_folder_reads_as_transformers_dequantizes_it(mxfp4_folder):
    """init_from's reader (no transformers) gives the experts transformers' dequantized weights exactly, every
    other weight as stored, and model.GPT transformers' logits within 1e-4 on rows longer than the window."""
    from fsdp_gpt.hf_format import to_hf
    hf = dequantized_by_transformers(mxfp4_folder)
    keys, state = read_hf_folder(mxfp4_folder)
    cfg = GPTConfig(**keys)
    theirs = hf.state_dict()
    ours = to_hf(state, cfg)
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[name], tensor) for name, tensor in theirs.items())
    gpt = GPT(cfg).eval()
    gpt.load_state_dict(state)
    idx = torch.randint(0, 576, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(gpt(idx)[0], hf(idx).logits, rtol=1e-4, atol=1e-4)


GPT_OSS_FOLDER = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=256, hidden_size=64,
                      intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_local_experts=8,
                      num_experts_per_tok=2, max_position_embeddings=8192)


def test_a_folder_silent_on_a_key_reads_as_its_class_does(tmp_path):
    """config.json with the shapes alone: its class's YaRN (factor 32 over 4,096 positions), base 150,000,
    window 128 on every other layer from the first, 8 key/value heads of 64, eps 1e-5, an untied head."""
    needs_class("GptOssForCausalLM")
    from transformers import AutoConfig
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_FOLDER))
    ours, theirs = hf_model_keys(str(tmp_path))[0], AutoConfig.from_pretrained(tmp_path)
    rope = dict(theirs.rope_parameters)
    assert (ours["rope_theta"], ours["rope_scaling"]) == (rope.pop("rope_theta"), rope)
    assert [GPTConfig(**ours).window_of(i) for i in range(4)] == \
        [theirs.sliding_window if kind == "sliding_attention" else None for kind in theirs.layer_types]
    assert (ours["n_kv_head"], ours["head_dim"], ours["norm_eps"], ours["tie_embeddings"]) == \
        (theirs.num_key_value_heads, theirs.head_dim, theirs.rms_norm_eps, theirs.tie_word_embeddings)


@pytest.mark.parametrize("config, refusal", [
    (dict(swiglu_limit=10.0), "has swiglu_limit: 10.0; built here: the experts' clamp at 7.0"),
    (dict(attention_bias=False), "has attention_bias: false; built here: q, k, v and o with biases"),
    (dict(layer_types=["chunked_attention"] * 4), "has layer_types ['chunked_attention'] (layer_types); built here: "
                                                  "sliding_attention, full_attention"),
    (dict(quantization_config={"quant_method": "bitsandbytes"}),
     "holds weights quantized by bitsandbytes (config.json's quantization_config); read here: fp8, mxfp4 (dequantized "
     "as read), or unquantized weights"),
    (dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4)), "RoPE scaling of type 'longrope' is not built"),
])
def test_a_folder_of_what_is_not_built_is_refused_naming_the_field(config, refusal, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_FOLDER | config))
    with pytest.raises(UserError, match=re.escape(f"init_from: {tmp_path}/") + "(: | )" + re.escape(refusal)):
        hf_model_keys(str(tmp_path))


DENSE = dict(arch="gpt_oss", vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)  # the mixture's dense twin
SMALL = DENSE | dict(moe_experts=4, moe_top_k=2, moe_hidden=32)


@pytest.mark.parametrize("keys, refusal", [
    (DENSE, "moe_experts: 0: GptOssForCausalLM has experts in every layer"),
    (SMALL | dict(moe_shared=1), "moe_shared: 1: GptOssForCausalLM has no shared experts"),
    (SMALL | dict(moe_dense_layers=1), "moe_dense_layers: 1: GptOssForCausalLM has experts in every layer"),
    (SMALL | dict(moe_norm_top_k=False), "moe_norm_top_k: False: GptOssForCausalLM weighs the chosen experts by a "
                                         "softmax"),
    (SMALL | dict(logit_softcap=30.0), "logit_softcap: 30.0: GptOssForCausalLM has no logit soft cap"),
])
def test_what_gpt_oss_cannot_express_is_not_exported(keys, refusal):
    with pytest.raises(UserError, match=re.escape(refusal)):
        hf_config(GPTConfig(**keys), eot=0)


def test_the_optimizers_take_its_matrices_as_todays():
    """Muon: attention's matrices and each expert's (stacked); AdamW without decay: biases (the experts', a
    vector an expert, among them), sinks, norms; AdamW with decay: the embeddings, the head and the routers."""
    from fsdp_gpt.optim.build import parameter_groups
    from fsdp_gpt.optim.muon import is_muon_matrix
    gpt = GPT(GPTConfig(**SMALL))
    decay, no_decay = parameter_groups(gpt)
    muon = {name for name, p in decay.items() if is_muon_matrix(name, p.shape)}
    block = {name.split(".", 2)[2] for name in muon if name.startswith("blocks.0.")}
    assert block == {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.experts.c_fc", "mlp.experts.c_proj"}
    assert {name.split(".", 2)[2] for name in no_decay if name.startswith("blocks.0.")} == {
        "ln_1.weight", "ln_2.weight", "attn.sinks", "attn.c_attn.bias", "attn.c_proj.bias", "mlp.router.bias",
        "mlp.experts.c_fc_bias", "mlp.experts.c_proj_bias"}
    assert set(decay) - muon == {"wte.weight", "lm_head.weight", "blocks.0.mlp.router.weight", "blocks.1.mlp.router.weight"}
    assert all(p.abs().sum() == 0 for name, p in gpt.named_parameters() if name.endswith(("_bias", ".bias", "sinks")))


# ---- trained from the folder ----

RUN = dict(block_size=64, max_iters=4, save_interval=2, log_interval=1, eval_interval=4, eval_iters=1, train_batch=8,
           micro_batch=2, warmup_iters=1, lr_decay_iters=4, sample_tokens=0, dtype="fp32", checkpoint_type="sharded")
LAYOUTS = {"one": (1, {}), "ep1": (2, {}), "ep2": (2, dict(ep_size=2)), "muon_one": (1, dict(optimizer="muon")),
           "ep4_muon": (4, dict(ep_size=4, optimizer="muon"))}
TAGS = ("train/loss", "train/grad_norm", "val/loss")


@pytest.fixture(scope="module")
def prepared(mxfp4_folder, tmp_path_factory) -> str:
    """The docs prepared with the folder's tokenizer, as transformers encodes them (checked here)."""
    import numpy
    from transformers import AutoTokenizer

    from fsdp_gpt.data.prepare import VAL_EVERY, prepare_data
    from test_hf_tokenizer import write_docs

    def make(folder: str) -> None:
        docs = write_docs(os.path.join(folder, "docs.jsonl"), n=60)
        meta = prepare_data(os.path.join(folder, "prepared"), [os.path.join(folder, "docs.jsonl")], mxfp4_folder)
        theirs = AutoTokenizer.from_pretrained(mxfp4_folder)
        prepared = [numpy.fromfile(os.path.join(folder, "prepared", f"{split}.bin"), dtype=meta["dtype"]).tolist()
                    for split in ("train", "val")]
        in_order = sorted(enumerate(docs), key=lambda doc: doc[0] % VAL_EVERY == VAL_EVERY - 1)  # train's, then val's
        assert prepared[0] + prepared[1] == [token for _, doc in in_order
                                             for token in theirs.encode(doc, add_special_tokens=False) + [meta["eot_token"]]]
    return shared(tmp_path_factory, "gpt_oss_prepared", make)


@pytest.fixture(scope="module")
def trained(mxfp4_folder, prepared, tmp_path_factory):
    """trained(name, **settings) -> the folder of a run from the MXFP4 folder (LAYOUTS' ranks and settings
    unless given), with no model key of its own, launched once a session."""
    from test_continued_pretraining import bare_config, run

    def launch(folder: str, nproc: int, settings: dict) -> None:
        result = run(folder, bare_config(pathlib.Path(folder), None), nproc, init_from=mxfp4_folder,
                     data_path=os.path.join(prepared, "prepared"), **settings)
        assert result.returncode == 0, result.stderr[-3000:]
        for stream in ("stdout", "stderr"):
            with open(os.path.join(folder, f"{stream}.txt"), "w") as f:
                f.write(getattr(result, stream))

    def trained(name: str, nproc: int | None = None, **settings) -> str:
        ranks, layout = LAYOUTS.get(name, (nproc, {}))
        return shared(tmp_path_factory, f"gpt_oss_runs/{name}", lambda folder: launch(folder, nproc or ranks,
                                                                                       RUN | layout | settings))
    return trained


def logged(run_dir: str) -> dict:
    return {tag: scalars(os.path.join(run_dir, "tb"), tag) for tag in TAGS}


@pytest.mark.slow
def test_a_step_at_learning_rate_0_exports_transformers_logits_of_the_folder(mxfp4_folder, trained, tmp_path):
    """init_from the MXFP4 folder with no model key: a step at learning rate 0 keeps its weights, which compute
    transformers' logits of the folder (within 1e-4, rows of 64 past the window of 16), and the export loads as
    GptOssForCausalLM with the folder's weights as transformers dequantizes them and its logits exactly; the
    export says it writes them unquantized, and its config.json holds no quantization_config."""
    from test_continued_pretraining import AT_LR_0, exported_as_it_came
    from conftest import tool
    kept = trained("kept", 1, **AT_LR_0, checkpoint_type="full")
    printed = "\n" + open(os.path.join(kept, "stdout.txt")).read()
    for key, value in dict(arch="gpt_oss", moe_experts=4, moe_top_k=2, sliding_window=16, mlp="clamped_swiglu").items():
        assert f"\n{key}: {value}\n" in printed, key
    checkpoint = os.path.join(kept, "ckpt", "fsdp_cpt1.pth")
    said = tool("export_hf.py", checkpoint, tmp_path / "hf")
    assert ("note: GptOssForCausalLM's published folders hold the experts in MXFP4 (quantization_config mxfp4); this "
            "export writes every weight in fp32, unquantized") in said
    config = exported_as_it_came(mxfp4_folder, checkpoint, tmp_path / "hf", ("rope_parameters",),
                                 loading=dict(dtype=torch.float32, quantization_config=__import__(
                                     "transformers").Mxfp4Config(dequantize=True)))
    assert "quantization_config" not in config and config["layer_types"] == ["sliding_attention", "full_attention"]


@pytest.mark.slow
@pytest.mark.parametrize("reference, name", [("one", "ep1"), ("one", "ep2"), ("muon_one", "ep4_muon")])
def test_n_ranks_train_the_run_of_one_process(reference, name, trained):
    """FSDP over 2 ranks with every expert on each (ep1), 2 experts a rank (ep2), one under Muon (ep4_muon: each
    expert's matrices orthogonalised where they lie, their biases AdamW's): the losses, gradient norms and val
    loss of one process within 1e-5, and a quiet console."""
    reference, got = logged(trained(reference)), logged(trained(name))
    for tag, values in reference.items():
        assert sorted(got[tag]) == sorted(values), tag
        for step, value in values.items():
            assert got[tag][step] == pytest.approx(value, rel=1e-5), (tag, step)
    assert reference["train/loss"][4] < reference["train/loss"][1]  # it trains
    assert_quiet(open(os.path.join(trained(name), "stderr.txt")).read())


@pytest.mark.slow
def test_the_resume_at_ep_size_2_is_bitwise_and_resharded_to_one_process(trained):
    """ep_size 2's sharded set of step 2: on its own layout, steps 3 and 4 bit for bit; on one process, with
    activation checkpointing (the sinks' kernels recomputed in backward), within 1e-4."""
    original = logged(trained("ep2"))["train/loss"]
    checkpoint = os.path.join(trained("ep2"), "ckpt", "fsdp_sharded_cpt2_rank0.pth")
    for name, nproc, switches in (("resumed_ep2", 2, dict(ep_size=2)),
                                  ("resumed_one", 1, dict(activation_checkpointing=True))):
        run_dir = trained(name, nproc, resume_from=checkpoint, **switches)
        got = logged(run_dir)["train/loss"]
        assert sorted(got) == [3, 4], name
        for step in got:
            assert got[step] == original[step] if nproc == 2 else got[step] == pytest.approx(original[step], rel=1e-4)

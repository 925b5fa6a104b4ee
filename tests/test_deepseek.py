"""DeepSeek's layout (families/deepseek.py): multi-head latent attention on every attention core path
(whole rows, documents, windows, its v head unlike q and k's), YaRN and the routing against
transformers' own code, FP8 block-scaled folders read as transformers dequantizes them, the
multi-token-prediction layers named and skipped, what the classes compute one way refused by name.
The families' logits against transformers: tests/test_families.py's MODELS rows; from a folder:
tests/test_continued_pretraining.py's FOLDERS rows; trained over ranks: below."""
import json
import math
import re

import pytest
import torch

from fsdp_gpt.attention import Documents, causal_attention
from fsdp_gpt.config import TrainConfig, UserError
from fsdp_gpt.config_checks import validate
from fsdp_gpt.hf_format import define_model, hf_config, hf_model_keys, read_hf_folder
from fsdp_gpt.hf_quantized import block_dequantized
from fsdp_gpt.latent_attention import latent_scale, one_head_size
from fsdp_gpt.model import GPT, GPTConfig
from fsdp_gpt.rope import rotary, yarn_scaled
from test_window import window_mask
from conftest import needs_class, needs_transformers

SMALL = dict(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
LATENT = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)
V3 = SMALL | LATENT | dict(arch="deepseek_v3", q_lora_rank=24, moe_experts=8, moe_top_k=2, moe_hidden=16, moe_shared=1,
                           moe_dense_layers=1, moe_groups=4, moe_top_groups=2, moe_scale=2.5)


@pytest.mark.parametrize("v_dim", [5, 40])  # narrower than q and k's 24, and wider
@pytest.mark.parametrize("window, documents", [(None, False), (None, True), (7, False), (7, True)])
def test_latent_heads_on_every_core_path_are_masked_attention(v_dim, window, documents):
    """q and k of one head size, v of another, padded to one size for the core: whole rows, doc_mask's
    documents, a window, both; output and gradients against a dense mask, in fp64."""
    B, H, T = 2, 4, 40
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, H, T, 24, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    v = torch.randn(B, H, T, v_dim, generator=g, dtype=torch.float64).requires_grad_()
    opens = torch.zeros(B, T, dtype=torch.bool)
    opens[0, [9, 25]], opens[1, 30] = True, True
    docs = Documents.of_rows(opens.numpy()) if documents else None
    dout = torch.randn(B, H, T, v_dim, generator=g, dtype=torch.float64)
    ours = causal_attention(*one_head_size(q, k, v), 0.0, False, docs, window, 0.3)[..., :v_dim]
    mask = window_mask(T, window, torch.from_numpy(docs.ids) if documents else None)
    truth = torch.softmax((q @ k.transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf")), -1) @ v
    for a, b in zip([ours, *torch.autograd.grad(ours, (q, k, v), dout)], [truth, *torch.autograd.grad(truth, (q, k, v), dout)]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


YARN = {  # DeepSeek V3's kind (mscale over mscale_all_dim), the plain factor's, gpt-oss's (truncate false)
    "deepseek": dict(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.8, beta_fast=32,
                     beta_slow=1),
    "plain": dict(factor=4.0, original_max_position_embeddings=64),
    "untruncated": dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, truncate=False),
}


@pytest.mark.parametrize("kind", YARN)
def test_yarn_is_transformers_and_deepseeks_scale_takes_its_mscale(kind):
    """The frequencies and the attention factor against transformers' _compute_yarn_parameters, at
    the width MLA turns; the softmax scale against its DeepSeek classes' yarn_apply_mscale."""
    needs_transformers("DeepSeek's yarn_apply_mscale")
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale
    scaling = YARN[kind]
    theirs = DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=16, qk_nope_head_dim=16,
                              max_position_embeddings=131072, rope_scaling=dict(type="yarn", **scaling), rope_theta=5e4)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](theirs)
    cfg = GPTConfig(**V3 | dict(qk_rope_head_dim=16, rope_theta=5e4, rope_scaling=dict(rope_type="yarn", **scaling)))
    ours, factor = yarn_scaled(5e4 ** (-torch.arange(0, 16, 2) / 16), cfg.rope_scaling, 5e4)
    torch.testing.assert_close(ours, inv_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(attention_factor, rel=1e-12)
    positions = torch.arange(32)  # and the model's cos and sin take them, at MLA's width
    cos, sin = rotary(cfg, positions, cfg.rope_theta, cfg.rope_scaling)
    angles = torch.outer(positions.float(), inv_freq)
    torch.testing.assert_close(cos[:, :8], angles.cos() * attention_factor, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin[:, 8:], angles.sin() * attention_factor, rtol=1e-6, atol=1e-6)
    assert latent_scale(cfg) == pytest.approx(yarn_apply_mscale(theirs.rope_parameters, 32 ** -0.5), rel=1e-12)
    assert (attention_factor != 1.0) == (kind != "deepseek" or scaling["mscale"] != scaling["mscale_all_dim"])


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_the_choice_of_experts_is_transformers_routers(family):
    """Grouped top-k over 16 experts in 4 groups (the best 2 groups), against DeepseekV3TopkRouter
    (sigmoid, the selection bias, a group ranked by its best two, renormalised, scaled) and
    DeepseekV2TopkRouter (softmax, group_limited_greedy: a group ranked by its best, scaled)."""
    needs_transformers("DeepSeek's TopkRouter classes")
    import importlib

    import transformers
    options = dict(moe_experts=16, moe_top_k=4, moe_groups=4, moe_top_groups=2, moe_scale=1.7) | (
        dict(arch="deepseek_v2", moe_norm_top_k=False) if family == "deepseek_v2" else {})
    cfg = GPTConfig(**V3 | options)
    moe = GPT(cfg).blocks[1].mlp
    keys = hf_config(cfg, eot=0)
    config = transformers.AutoConfig.for_model(keys.pop("model_type"), **keys)
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    router = getattr(module, f"Deepseek{family[-2:].upper()}TopkRouter")(config)
    with torch.no_grad():
        router.weight.copy_(moe.router.weight)
        if family == "deepseek_v3":  # a bias that moves the choice (it enters no weight)
            moe.expert_bias.copy_(torch.randn(16) * 0.3)
            router.e_score_correction_bias.copy_(moe.expert_bias)
    x = torch.randn(64, 64)
    chosen, weights, scores = moe.route(x)
    _, their_weights, their_chosen = router(x)
    ours, order = chosen.sort(-1)
    theirs, their_order = their_chosen.sort(-1)
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(weights.gather(-1, order), their_weights.gather(-1, their_order), rtol=1e-6, atol=1e-7)
    assert all(len(set(row)) <= 2 for row in (chosen // 4).tolist())  # every token's experts within two groups
    ungrouped = torch.topk(scores + moe.expert_bias, 4).indices.sort(-1).values
    assert not torch.equal(ours, ungrouped)  # and the groups changed some token's choice


def quantized(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w (..., rows, cols) as float8 e4m3 and a scale per block (..., ceil(rows / block), ceil(cols / block)),
    the edge blocks cut short, as DeepSeek quantizes: each block's largest magnitude at e4m3's 448."""
    rows, cols = w.shape[-2:]
    R, C = -(-rows // block), -(-cols // block)
    padded = torch.zeros(*w.shape[:-2], R * block, C * block)
    padded[..., :rows, :cols] = w
    blocks = padded.unflatten(-1, (C, block)).unflatten(-3, (R, block))  # (..., R, block, C, block)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-12) / 448
    q = (blocks / scale[..., :, None, :, None]).flatten(-2).flatten(-3, -2)[..., :rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("shape", [(40, 72), (32, 64), (3, 40, 24)])  # edge blocks cut short, whole ones, per expert
def test_fp8_blocks_dequantize_as_transformers(shape):
    """Block-scaled FP8 (weight_scale_inv) made full precision as transformers' finegrained_fp8 does it:
    its backward's dequantization (edge blocks) and its loader's (whole blocks), bit for bit."""
    needs_transformers("its finegrained_fp8 dequantization")
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight
    weight, scale = quantized(torch.randn(shape, generator=torch.Generator().manual_seed(0)), 16)
    ours = block_dequantized(weight, scale, (16, 16))
    assert ours.dtype == torch.float32 and torch.equal(ours, _dequantize_fp8_weight(weight, scale, [16, 16], torch.float32))
    if all(n % 16 == 0 for n in shape[-2:]):
        assert torch.equal(ours, Fp8Dequantize(None)._dequantize_one(weight, scale, torch.float32))
    assert (ours - weight.float()).abs().max() > 0  # the scales matter: a weight read as if it were bf16 is wrong


@pytest.fixture(scope="module")
def v3_folder(tmp_path_factory) -> str:
    """A small DeepseekV3ForCausalLM saved by transformers (q through a low rank, a dense first layer,
    4 experts in 2 groups), every weight away from its initial value."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    folder = tmp_path_factory.mktemp("deepseek_v3")
    config = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                              num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=40,
                              kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                              max_position_embeddings=64, num_nextn_predict_layers=0)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    return str(folder)


def rewrite(folder, tensors: dict, **config) -> None:
    from safetensors.torch import save_file
    save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
    with open(f"{folder}/config.json") as f:
        keys = json.load(f)
    with open(f"{folder}/config.json", "w") as f:
        json.dump(keys | config, f)


def cfg_of(folder) -> TrainConfig:
    """A run's config with init_from the folder, as the trainer reads it (no key given beside it)."""
    from conftest import ROOT
    from fsdp_gpt.config_parse import parse_args
    return parse_args([f"{ROOT}/config/continue_hf.yaml", f"--init_from={folder}", "--block_size=32"])


def test_an_fp8_folder_is_read_dequantized_and_says_so(v3_folder, tmp_path):
    """Kimi K2's and DeepSeek V3's kind of folder: the block's matrices float8 with a scale per block
    (blocks of 16 here, so that the edges of these small matrices are cut short), the rest bf16: read
    as transformers dequantizes them, the note at start-up says so; the same files without their
    quantization_config, and a method not built here, are refused by name."""
    needs_transformers("its finegrained_fp8 dequantization")
    import shutil

    from safetensors.torch import load_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    shutil.copytree(v3_folder, tmp_path / "fp8")
    folder = tmp_path / "fp8"
    stored = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        if re.search(r"layers\.\d+\.(self_attn|mlp)\..*proj(_with_mqa)?\.weight$", name):
            stored[name], stored[name + "_scale_inv"] = quantized(tensor, 16)
        else:
            stored[name] = tensor.bfloat16()
    quantization = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[16, 16])
    rewrite(folder, stored, quantization_config=quantization)
    keys, state = read_hf_folder(str(folder))
    expected = {"blocks.0.attn.kv_a.weight": "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",  # 40 rows: 3 blocks
                "blocks.1.attn.q_b.weight": "model.layers.1.self_attn.q_b_proj.weight"}
    for ours, theirs in expected.items():
        assert torch.equal(state[ours], _dequantize_fp8_weight(stored[theirs], stored[theirs + "_scale_inv"], [16, 16],
                                                               torch.float32))
    experts = [_dequantize_fp8_weight(stored[f"model.layers.1.mlp.experts.{e}.down_proj.weight"],
                                      stored[f"model.layers.1.mlp.experts.{e}.down_proj.weight_scale_inv"], [16, 16],
                                      torch.float32) for e in range(4)]
    assert torch.equal(state["blocks.1.mlp.experts.c_proj"], torch.stack(experts))
    assert torch.equal(state["wte.weight"], stored["model.embed_tokens.weight"].float())
    assert define_model(cfg_of(folder)) == ["its FP8 weights (quantization_config: fp8, blocks of 16 x 16) are "
                                            "dequantized to fp32 as they are read; training and an export keep them in "
                                            "full precision"]
    rewrite(folder, stored, quantization_config=None)
    with pytest.raises(UserError, match=re.escape(
            f"init_from: {folder}/: model.layers.0.mlp.down_proj.weight is float8_e4m3fn with no "
            f"model.layers.0.mlp.down_proj.weight_scale_inv beside it (config.json's quantization_config: None): not "
            f"read as if it were full precision")):
        read_hf_folder(str(folder))
    rewrite(folder, stored, quantization_config=dict(quant_method="bitsandbytes", load_in_4bit=True))
    with pytest.raises(UserError, match=re.escape(f"init_from: {folder}/ holds weights quantized by bitsandbytes "
                                                  f"(config.json's quantization_config); read here: fp8")):
        define_model(cfg_of(folder))


def test_multi_token_prediction_layers_are_named_and_never_read(v3_folder, tmp_path):
    """DeepSeek V3's folder holds its multi-token-prediction layer as model.layers.{num_hidden_layers}:
    start-up names it, the reader takes the same weights as without it."""
    import shutil

    from safetensors.torch import load_file
    shutil.copytree(v3_folder, tmp_path / "mtp")
    folder = tmp_path / "mtp"
    tensors = load_file(folder / "model.safetensors")
    mtp = {name.replace("layers.1.", "layers.2."): t.clone() for name, t in tensors.items() if ".layers.1." in name}
    mtp |= {"model.layers.2.eh_proj.weight": torch.randn(64, 128), "model.layers.2.enorm.weight": torch.ones(64)}
    rewrite(folder, tensors | mtp, num_nextn_predict_layers=1)
    assert define_model(cfg_of(folder)) == ["config.json names 1 multi-token-prediction layer (num_nextn_predict_layers: "
                                            "1; model.layers.2 in the Hub's files): not trained here, so never read, and "
                                            "an export names none"]
    keys, state = read_hf_folder(str(folder))
    assert keys["n_layer"] == 2
    assert all(torch.equal(t, read_hf_folder(v3_folder)[1][name]) for name, t in state.items())


# a DeepSeek folder's config.json with only what its class can't default
REQUIRED = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=16, qk_rope_head_dim=8,
                qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=64)


@pytest.mark.parametrize("architecture", ["DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"])
def test_a_folder_silent_on_a_key_reads_as_its_class_does(architecture, tmp_path):
    """Each class's defaults where config.json is silent (V3: q through a low rank of 1536, 3 dense layers,
    8 groups, the top 4, 2.5 times the renormalised weights; V2: one shared expert more, none dense, none
    renormalised), read as transformers reads them."""
    needs_class(architecture)
    import transformers
    model_type = {"DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v2"}[architecture]
    (tmp_path / "config.json").write_text(json.dumps(REQUIRED | dict(architectures=[architecture], model_type=model_type)))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    ours = hf_model_keys(str(tmp_path))[0]
    v2_groups = getattr(theirs, "topk_method", None) == "group_limited_greedy"
    assert (ours["q_lora_rank"], ours["moe_shared"], ours["moe_scale"], ours["moe_dense_layers"], ours["moe_norm_top_k"],
            ours["norm_eps"], ours["rope_theta"], ours["rope_interleave"], ours["tie_embeddings"]) == (
        theirs.q_lora_rank, theirs.n_shared_experts, theirs.routed_scaling_factor, theirs.first_k_dense_replace,
        bool(theirs.norm_topk_prob), theirs.rms_norm_eps, theirs.rope_parameters["rope_theta"],
        getattr(theirs, "rope_interleave", True), theirs.tie_word_embeddings)
    groups = (theirs.n_group, theirs.topk_group) if architecture == "DeepseekV3ForCausalLM" or v2_groups else (1, 1)
    assert (ours["moe_groups"], ours["moe_top_groups"]) == groups


@pytest.mark.parametrize("config, refusal", [
    (dict(architectures=["DeepseekV3ForCausalLM"], scoring_func="softmax"),
     'has scoring_func: "softmax"; built here: sigmoid scores (DeepseekV3ForCausalLM\'s)'),
    (dict(architectures=["DeepseekV3ForCausalLM"], topk_method="greedy"), 'has topk_method: "greedy"; built here: noaux_tc'),
    (dict(architectures=["DeepseekV3ForCausalLM"], num_key_value_heads=2),
     "has num_key_value_heads: 2 beside num_attention_heads: 4; built here: latent attention's own key and value"),
    (dict(architectures=["DeepseekV3ForCausalLM"], moe_layer_freq=2), "has moe_layer_freq: 2; built here: experts in every"),
    (dict(architectures=["DeepseekV2ForCausalLM"], norm_topk_prob=True),
     "has norm_topk_prob: true; built here: the chosen experts' scores as they are (DeepseekV2ForCausalLM never"),
    (dict(architectures=["DeepseekV2ForCausalLM"], attention_bias=True), "has attention_bias: true; built here: attention"),
    (dict(architectures=["DeepseekV3ForCausalLM"], rope_scaling=dict(type="longrope", short_factor=[1.0] * 4)),
     ": RoPE scaling of type 'longrope' is not built here (only llama3, Llama 3.1's, and yarn)"),
])
def test_what_its_class_computes_one_way_is_refused_naming_the_field(config, refusal, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(REQUIRED | config))
    with pytest.raises(UserError, match=re.escape(f"init_from: {tmp_path}/{'' if refusal[0] == ':' else ' '}{refusal}")):
        hf_model_keys(str(tmp_path))


@pytest.mark.parametrize("options, refusal", [
    (dict(moe_score="softmax"), "moe_score: softmax: DeepseekV3ForCausalLM scores experts by sigmoid"),
    (dict(arch="deepseek_v2"), "moe_norm_top_k: True: DeepseekV2ForCausalLM weighs the chosen experts by their scores"),
    (dict(arch="deepseek_v2", moe_norm_top_k=False, rope_interleave=False),
     "rope_interleave: False: DeepseekV2ForCausalLM turns q and k by adjacent pairs"),
    (dict(sliding_window=8), "sliding_window: 8: DeepseekV3ForCausalLM attends to every earlier token"),
    (dict(moe_shared=0), "moe_shared: 0: DeepseekV3ForCausalLM has shared experts beside the routed ones"),
    (dict(attn_scale_dim=16), "attn_scale_dim: 16: DeepseekV3ForCausalLM scales attention by 1/sqrt(qk_nope_head_dim"),
])
def test_what_its_class_cannot_express_is_not_exported(options, refusal):
    with pytest.raises(UserError, match=re.escape(refusal)):
        hf_config(GPTConfig(**V3 | options), eot=0)


@pytest.mark.parametrize("options, refusal", [
    (dict(moe_groups=3), "moe_groups=3 must divide moe_experts=8"),
    (dict(moe_groups=8, moe_top_groups=1), "moe_groups=8 leaves one expert a group"),
    (dict(moe_top_groups=5), "moe_top_groups=5 must be 1 to moe_groups=4"),
    (dict(moe_top_groups=1, moe_top_k=3), "moe_top_k=3 is more experts than moe_top_groups=1 groups of 2 hold"),
    (dict(moe_scale=0.0), "moe_scale must be positive, got 0.0"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim must be positive and even for RoPE, got 7"),
    (dict(q_lora_rank=0), "q_lora_rank must be positive (null: one q projection), got 0"),
    (dict(value_embeds=1), "value_embeds=1 mixes embeddings into multi-head attention's v; DeepSeek V3's attention"),
    (dict(n_kv_head=2), "n_kv_head=2 needs arch: llama or gemma3 or qwen2"),
    (dict(arch="llama", kv_lora_rank=64, moe_experts=0, moe_top_k=2, moe_hidden=None, moe_shared=0, moe_dense_layers=0,
          moe_groups=1, moe_top_groups=1, moe_scale=1.0, q_lora_rank=None), "kv_lora_rank=64 needs arch: deepseek_v3"),
])
def test_bad_deepseek_keys_are_refused(options, refusal):
    with pytest.raises(UserError, match=re.escape(refusal)):
        validate(TrainConfig(**V3 | options))


def test_muon_takes_the_latent_attentions_and_the_experts_matrices():
    """Every 2-D matrix of a block (q_a, q_b, kv_a, kv_b, c_proj, the dense and shared MLPs) and the stacked
    experts; the norms, the router and the selection bias are AdamW's (or nobody's)."""
    from fsdp_gpt.optim.muon import is_muon_matrix
    model = GPT(GPTConfig(**V3))
    muon = {name for name, p in model.named_parameters() if is_muon_matrix(name, p.shape)}
    assert muon == {f"blocks.{i}.{name}" for i in range(2) for name in (
        "attn.q_a.weight", "attn.q_b.weight", "attn.kv_a.weight", "attn.kv_b.weight", "attn.c_proj.weight")} | {
        "blocks.0.mlp.c_fc.weight", "blocks.0.mlp.c_proj.weight", "blocks.1.mlp.experts.c_fc", "blocks.1.mlp.experts.c_proj",
        "blocks.1.mlp.shared.c_fc.weight", "blocks.1.mlp.shared.c_proj.weight"}


def test_flops_count_the_latent_heads_own_widths():
    """Attention's products at q and k's width (24) and v's (12), not a padded one; the linears as they are."""
    model = GPT(GPTConfig(**V3))
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    experts = sum(m.top_k * m.expert_params() for m in model.moe_layers())
    assert model.flops_per_token() == 3 * (2 * (linears + experts) + 2 * 2 * 32 * 4 * (24 + 12))
    assert math.isclose(latent_scale(model.config), 24 ** -0.5)


# --- trained runs: each family over ranks against one process -----------------------------------------

# 4 steps of 24 rows, checkpoints at 2 and 4. DeepSeek V3's kind under Muon, its choice balanced by the
# selection bias alone, documents (doc_mask) and a local layer: every attention path of MLA's and context
# parallelism's; V2's kind under AdamW with the balancing loss, on whole rows
TRAINED = dict(n_layer=2, n_head=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, moe_experts=8,
               moe_top_k=2, moe_hidden=16, moe_dense_layers=1, train_batch=24, max_iters=4, save_interval=2,
               eval_interval=2)
FAMILY_RUNS = {
    "deepseek_v3": dict(arch="deepseek_v3", q_lora_rank=16, moe_shared=1, moe_groups=4, moe_top_groups=2, moe_scale=2.5,
                        moe_bias_rate=0.001, doc_mask=True, sliding_window=8, window_pattern=["global", "local"],
                        optimizer="muon"),
    "deepseek_v2": dict(arch="deepseek_v2", moe_shared=2, moe_norm_top_k=False, moe_aux_loss=0.01),
}
LAYOUTS = {"one": (1, dict(checkpoint_type="full")), "ep2": (2, dict(ep_size=2, checkpoint_type="sharded")),
           "ep4": (4, dict(ep_size=4)), "ulysses": (2, dict(cp_size=2)), "ring": (2, dict(cp_size=2, cp_mode="ring"))}
TAGS = ("train/loss", "train/grad_norm", "val/loss", "moe/layer1/busiest")


@pytest.fixture(scope="module")
def family_runs(corpus, tmp_path_factory):
    from conftest import launcher_once
    launch = launcher_once(tmp_path_factory, "deepseek", **TRAINED, **corpus)
    return lambda family, name: launch(f"{family}_{name}", LAYOUTS[name][0], **FAMILY_RUNS[family] | LAYOUTS[name][1])


def logged(run_dir) -> dict:
    from conftest import scalars
    return {tag: scalars(f"{run_dir}/tb", tag) for tag in TAGS}


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", [("deepseek_v3", "ep2"), ("deepseek_v3", "ep4"), ("deepseek_v3", "ulysses"),
                                            ("deepseek_v3", "ring"), ("deepseek_v2", "ep2"), ("deepseek_v2", "ep4")])
def test_n_ranks_train_the_run_of_one_process(family, layout, family_runs):
    """Experts over 2 and 4 ranks (4 and 2 a rank), and rows over 2 (Ulysses' heads, the ring's blocks and
    its window's tiles, with documents): the losses, the gradient norm and the experts' loads of one process."""
    from conftest import assert_quiet, stderr_of
    reference, got = logged(family_runs(family, "one")), logged(family_runs(family, layout))
    for tag, values in reference.items():
        assert sorted(got[tag]) == sorted(values) and values, tag
        for step, value in values.items():
            assert got[tag][step] == pytest.approx(value, rel=1e-5), (tag, step)
    assert reference["train/loss"][4] < reference["train/loss"][1] - 0.2  # it trains
    assert_quiet(stderr_of(family_runs(family, layout)))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_RUNS)
def test_an_expert_parallel_checkpoint_resumes_bitwise_and_on_one_process(family, family_runs, corpus, tmp_path):
    """ep_size 2's sharded set at step 2: on its own layout bit for bit, on one process within 1e-4."""
    from conftest import checkpoint_of, run_trainer, scalars
    original = family_runs(family, "ep2")
    expected = scalars(f"{original}/tb", "train/loss")
    for name, nproc, ep_size in (("same", 2, 2), ("one", 1, 1)):
        (tmp_path / name).mkdir()
        run_trainer(str(tmp_path / name), nproc=nproc, resume_from=checkpoint_of(original, "sharded", 2, rank=0),
                    **TRAINED | corpus | FAMILY_RUNS[family] | dict(ep_size=ep_size, checkpoint_type="sharded"))
        got = scalars(str(tmp_path / name / "tb"), "train/loss")
        assert sorted(got) == [3, 4]
        for step in got:
            assert (got[step] == expected[step]) if name == "same" else got[step] == pytest.approx(expected[step], rel=1e-4)

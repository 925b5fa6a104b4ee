"""Model families (fsdp_gpt/families/): each builds what its entry says, takes only its keys, and
maps onto its Hugging Face class both ways (transformers' logits, a folder read back, every weight's
name). A new family adds its row to MODELS."""
import json
import re

import pytest
import torch

from fsdp_gpt.config import TrainConfig, UserError
from fsdp_gpt.config_checks import archs_taking, validate
from fsdp_gpt.families import FAMILIES
from fsdp_gpt.hf_format import fused_like, hf_config, hf_model_keys, read_hf_folder, their_weight, to_hf
from fsdp_gpt.family_parts import ALL_BIASES, ONE_WINDOW, Absent
from fsdp_gpt.model import ACTIVATIONS, ATTENTIONS, GPT, MIXERS, NORM_PLACES, NORMS, QK_NORM_WIDTHS, GPTConfig
from fsdp_gpt.moe import MoE
from conftest import needs_class

SMALL = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
# a small model of each family, and of the options its Hugging Face class maps otherwise: (family, options)
MODELS = {
    "llama": ("Llama", dict(arch="llama", n_kv_head=2)),  # LlamaForCausalLM, untied
    "qwen3": ("Qwen3", dict(arch="llama", n_kv_head=1, qk_norm=True, tie_embeddings=True, rope_theta=5e5)),
    "gpt2": ("GPT-2", dict(arch="gpt2")),
    "gpt2_relu2": ("GPT-2", dict(arch="gpt2", mlp="relu2")),  # activation_function relu2
    # a dense first layer (transformers 4 holds each expert's matrices, 5 stacks them)
    "qwen3_moe": ("Qwen3-MoE", dict(arch="llama", n_kv_head=2, qk_norm=True, moe_experts=4, moe_top_k=2, moe_hidden=32,
                                    moe_dense_layers=1, moe_norm_top_k=False)),
    # a local layer (a window of 8 on rows of 32) and a global one, a RoPE base each, another attention
    # scale, the final soft cap: every key of config.json it maps
    "gemma3": ("Gemma 3", dict(arch="gemma3", n_kv_head=2, sliding_window=8, window_pattern=["local", "global"],
                               rope_theta=1e6, rope_local_theta=1e4, attn_scale_dim=24, logit_softcap=30.0,
                               norm_eps=1e-6)),
    "qwen2": ("Qwen2", dict(arch="qwen2", n_kv_head=2, tie_embeddings=True)),  # q, k and v biased, the head tied
    "mistral": ("Mistral", dict(arch="mistral", n_kv_head=2, sliding_window=8)),  # v0.1's window, on rows of 32
    "mistral_v03": ("Mistral", dict(arch="mistral", n_kv_head=1, head_dim=32)),  # no window; Nemo's own head_dim
    "olmo2": ("OLMo 2", dict(arch="olmo2", n_kv_head=2)),  # norms after each sublayer, q and k's over each projection
    # OLMo 2's block, a local layer (a window of 8 on rows of 32) then a global one, a RoPE base each
    "olmo3": ("OLMo 3", dict(arch="olmo3", n_kv_head=2, sliding_window=8, window_pattern=["local", "global"],
                             rope_theta=5e5, rope_local_theta=1e4)),
    # OLMo 3's long-context models: YaRN on the full-attention layers alone (the original context 8, rows of 32)
    "olmo3_yarn": ("OLMo 3", dict(arch="olmo3", n_kv_head=2, sliding_window=8, window_pattern=["local", "global"],
                                  rope_theta=5e5, rope_local_theta=5e5, rope_scaling=dict(
                                      rope_type="yarn", factor=8.0, original_max_position_embeddings=8,
                                      attention_factor=1.2, beta_fast=32, beta_slow=1))),
    "llama_yarn": ("Llama", dict(arch="llama", n_kv_head=2, rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                                           original_max_position_embeddings=8))),
    "phi3": ("Phi-3", dict(arch="phi3", n_kv_head=2, sliding_window=8)),  # qkv_proj and gate_up_proj fused, a window
    "phi4_mini": ("Phi-3", dict(arch="phi3", n_kv_head=2, partial_rotary_factor=0.75)),  # RoPE on 12 of 16 dimensions
    "smollm3": ("SmolLM3", dict(arch="smollm3", n_kv_head=2, rope_pattern=["rope", "nope"])),  # a NoPE layer, tied
    # a Gated DeltaNet layer (2 key heads, 4 value heads) then gated attention, q and k normalised per head, (1 + weight)
    # norms, RoPE on a quarter of each head (4 of 16)
    "qwen3_5": ("Qwen3.5", dict(arch="qwen3_5", n_kv_head=2, rope_theta=1e6, attn_pattern=["linear", "full"],
                                linear_key_heads=2, linear_value_heads=4, linear_key_dim=16, linear_value_dim=16)),
    # every layer's experts beside a shared one its gate weighs
    "qwen3_5_moe": ("Qwen3.5-MoE", dict(arch="qwen3_5", n_kv_head=2, moe_experts=4, moe_top_k=2, moe_hidden=32,
                                       moe_shared=1, tie_embeddings=True, attn_pattern=["linear", "full"],
                                       linear_key_heads=2, linear_value_heads=4, linear_key_dim=16)),
    # DeepSeek V3's layout: q through a low rank, RoPE by pairs with YaRN (its attention factor and, in the
    # scale, mscale over mscale_all_dim), a dense first layer, 8 experts in 4 groups (top 2 groups, top 2
    # experts) beside a shared one, the weights renormalised and scaled; v's head unlike q and k's
    "deepseek_v3": ("DeepSeek V3", dict(arch="deepseek_v3", q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                        qk_nope_head_dim=16, v_head_dim=12, moe_experts=8, moe_top_k=2, moe_hidden=16,
                                        moe_shared=1, moe_dense_layers=1, moe_groups=4, moe_top_groups=2, moe_scale=2.5,
                                        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8,
                                                          mscale=1.0, mscale_all_dim=0.8))),
    # Moonlight's kind: one q matrix, no groups, RoPE by halves, a v head wider than q and k's, tied
    "moonlight": ("DeepSeek V3", dict(arch="deepseek_v3", kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                      v_head_dim=24, rope_interleave=False, moe_experts=4, moe_top_k=2, moe_hidden=16,
                                      moe_shared=2, moe_dense_layers=1, moe_scale=2.446, tie_embeddings=True)),
    # V2-Lite's: softmax scores as they are, YaRN's mscale both ways (attention factor 1), V2's grouped choice
    "deepseek_v2": ("DeepSeek-V2", dict(arch="deepseek_v2", kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                        v_head_dim=16, moe_experts=8, moe_top_k=3, moe_hidden=16, moe_shared=2,
                                        moe_dense_layers=1, moe_norm_top_k=False, moe_groups=4, moe_top_groups=2,
                                        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8,
                                                          mscale=0.707, mscale_all_dim=0.707))),
    # sinks, biases everywhere, a local layer then a global one, YaRN stretching 8 positions 4 times over rows
    # of 32 (its attention factor 1.14), 4 experts of clamped SwiGLU, the top 2 weighed by a softmax
    "gpt_oss": ("gpt-oss", dict(arch="gpt_oss", n_kv_head=2, sliding_window=8, window_pattern=["local", "global"],
                                rope_theta=15e4, moe_experts=4, moe_top_k=2, moe_hidden=32,
                                rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8,
                                                  beta_fast=32.0, beta_slow=1.0, truncate=False))),
}


def hf_model(cfg: GPTConfig, state: dict):
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    needs_class(cfg.family.hf_class)
    keys = hf_config(cfg, eot=0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(keys.pop("model_type"), **keys)).eval()
    model.load_state_dict(fused_like(to_hf(state, cfg), model.state_dict()))
    return model


def trained(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    # an MoE's selection bias where the class has a place for it (DeepSeek V3's e_score_correction_bias)
    bias_kept = not isinstance(cfg.family.hf_names.get("mlp.expert_bias", Absent("")), Absent)
    with torch.no_grad():  # norms and biases away from their initial ones and zeros
        for name, p in model.named_parameters():
            if p.requires_grad or (bias_kept and name.endswith("mlp.expert_bias")):
                p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("model", MODELS)
def test_each_family_builds_what_its_entry_says(model):
    name, options = MODELS[model]
    cfg = GPTConfig(**SMALL, **options)
    family, gpt = cfg.family, GPT(cfg)
    assert family.name == name
    assert type(gpt.ln_f) is type(NORMS[family.norm](cfg, 8))
    assert hasattr(gpt, "wpe") == (family.positions == "learned")
    assert (gpt.lm_head.weight is gpt.wte.weight) == options.get("tie_embeddings", family.tied)
    assert [type(block.attn) for block in gpt.blocks] == [
        ATTENTIONS[family.attention] if cfg.mixer_of(i) == "full" else MIXERS[cfg.mixer_of(i)] for i in range(cfg.n_layer)]
    block = next(block for block in gpt.blocks if isinstance(block.attn, ATTENTIONS[family.attention]))  # the entry's
    mlp = block.mlp.shared if isinstance(block.mlp, MoE) else block.mlp  # a mixture's dense MLP: its shared experts
    for linear in dict.fromkeys(ALL_BIASES + family.biases) if family.attention == "mha" else ():
        owner, name = linear.split(".")
        # a mixture's router and experts (gpt-oss's biased), or the attention's and dense MLP's linears
        module = getattr(block.mlp, name, None) if name in ("router", "experts") else getattr(
            mlp if owner == "mlp" else block.attn, name, None)
        if module is None:  # a dense MLP's linears in a block of experts alone, or a mixture's in a dense block
            assert name in ("router", "experts") or mlp is None, linear
            continue
        biased = module.bias is not None if isinstance(module, torch.nn.Linear) else hasattr(module, "c_fc_bias")
        assert biased == (linear in family.biases and cfg.bias), linear
    # a latent attention's linears have no biases, nor its heads sinks
    assert all(m.bias is None for m in block.attn.modules() if isinstance(m, torch.nn.Linear)) or family.attention == "mha"
    assert (getattr(block.attn, "sinks", None) is not None) == family.sinks
    before, after = NORM_PLACES[family.norms]
    assert [type(getattr(block, name)) is not torch.nn.Identity for name in ("ln_1", "ln_2", "ln_attn_out", "ln_mlp_out")
            ] == [before, before, after, after]
    assert hasattr(block.attn, "ln_q") == cfg.qk_norm
    if cfg.qk_norm:  # each head's width or the whole projection's
        assert (block.attn.ln_q.weight.numel(), block.attn.ln_k.weight.numel()) == QK_NORM_WIDTHS[family.qk_norm_scope](cfg)
    activated = block.mlp.experts if isinstance(block.mlp, MoE) else block.mlp
    assert activated.activation is ACTIVATIONS[options.get("mlp", family.mlp)]
    # a gated family's gate rows beside the queries' (a latent attention has no c_attn)
    assert family.attention != "mha" or block.attn.c_attn.out_features == sum(cfg.qkv_widths) == (
        (1 + family.attn_gate) * cfg.n_head * cfg.head_dim + 2 * cfg.n_kv_head * cfg.head_dim)
    if isinstance(block.mlp, MoE):
        assert (block.mlp.shared_gate is not None) == family.shared_expert_gate
    assert gpt.wte.weight.std().item() == pytest.approx(family.init_std, rel=0.05)


def test_a_refinement_applies_where_its_keys_are_set():
    """Qwen3 is Llama's layout with qk_norm, Qwen3-MoE with experts (qk_norm or not: its export
    refuses the latter); GPT-2's layout has no refinement, and refuses the keys."""
    def family(**options) -> str:
        return GPTConfig(**SMALL, **options).family.name
    assert family(arch="llama", moe_experts=4) == family(arch="llama", qk_norm=True, moe_experts=4) == "Qwen3-MoE"
    assert family(arch="gpt2", qk_norm=True) == "GPT-2"


@pytest.mark.parametrize("options, refused", [
    (dict(qk_norm=True), "qk_norm=True"),
    (dict(tie_embeddings=False), "tie_embeddings=False"),
    (dict(rope_theta=5e5), "rope_theta=500000.0"),
    (dict(n_kv_head=2), "n_kv_head=2"),
    (dict(arch="llama", bias=True, n_kv_head=2), None),  # bias's default: Llama has none all the same
    (dict(n_kv_head=4, tie_embeddings=True), None),  # what GPT-2 makes of them, said outright
    (dict(n_embd=66, n_head=2), None),  # an odd head (33 dimensions): learned positions, no RoPE to turn them in pairs
])
def test_a_key_the_family_does_not_take_is_refused_naming_the_layouts_that_do(options, refused):
    """The layouts named are those whose families take the key, from the families' table (a new family
    needs no edit here): Llama's among them, GPT-2's never."""
    cfg = TrainConfig(**SMALL | dict(n_layer=2) | options)
    if refused is None:
        validate(cfg)
        return
    key = refused.split("=")[0]
    named = archs_taking(key).split(" or ")
    assert "llama" in named and "gpt2" not in named
    with pytest.raises(UserError, match=re.escape(f"{refused} needs arch: {' or '.join(named)} (GPT-2 takes no {key})")):
        validate(cfg)


@pytest.mark.parametrize("options", [options for _, options in MODELS.values()] + [dict(arch="gpt2", bias=False),
                                                                                   dict(arch="qwen2", bias=False)])
def test_every_weight_maps_to_its_hugging_face_names_and_back(options):
    """to_hf and init_from's reader by the entry's names, no transformers involved: GPT-2 and Qwen2
    without biases export zeros in their place, which the reader leaves where model.GPT has none."""
    cfg = GPTConfig(**SMALL, **options)
    state = trained(cfg).state_dict()
    theirs = to_hf(state, cfg)
    for name, tensor in state.items():
        assert torch.equal(their_weight(theirs, cfg.family, name, tensor, cfg.moe_experts), tensor), name


@pytest.mark.parametrize("model", MODELS)
def test_transformers_computes_the_same_logits_and_the_folder_reads_back(model, tmp_path):
    cfg = GPTConfig(**SMALL, **MODELS[model][1])
    ours = trained(cfg)
    hf = hf_model(cfg, ours.state_dict())
    idx = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        expected = ours(idx)[0]
        assert torch.allclose(hf(idx).logits, expected, rtol=1e-4, atol=1e-4)
        hf.save_pretrained(tmp_path)
        keys, state = read_hf_folder(str(tmp_path))  # init_from's reader: no transformers involved
        assert GPTConfig(**keys) == cfg
        # as rank 0 broadcasts them into the shards: a transposed view (GPT-2's, gpt-oss's experts) arrived in
        # its memory order, another model than one process's
        assert all(tensor.is_contiguous() for tensor in state.values())
        back = GPT(GPTConfig(**keys)).eval()
        back.load_state_dict(state)
        assert torch.equal(back(idx)[0], expected)


def test_gemma3_scales_its_embeddings_by_one_value_in_every_dtype():
    """sqrt(48) is 6.9282 in fp32 and 6.9375 in bf16: the embeddings in fp32 (one process, DDP) and
    in bf16 (FSDP2's gather) are both scaled by transformers' value for the fp32 export."""
    cfg = GPTConfig(**SMALL | dict(n_embd=48), **MODELS["gemma3"][1])
    ours = trained(cfg)
    scale = hf_model(cfg, ours.state_dict()).model.embed_tokens.embed_scale.float().item()
    assert scale != torch.tensor(scale).bfloat16().item()  # a width where bf16 rounds it otherwise
    idx = torch.randint(0, 256, (2, 32))
    entering = {}  # what the first block receives: the scaled embeddings
    ours.blocks[0].register_forward_pre_hook(lambda block, args: entering.update({args[0].dtype: args[0]}))
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            ours.to(dtype)(idx)
            expected = (ours.wte.weight[idx].float() * scale).to(dtype)
            assert torch.equal(entering[dtype], expected), dtype


@pytest.mark.parametrize("options, key", [
    (dict(arch="llama", logit_softcap=30.0), "logit_softcap: 30.0: LlamaForCausalLM has no logit soft cap"),
    (dict(arch="llama", mlp="relu2"), "mlp: relu2: LlamaForCausalLM computes swiglu MLPs only"),
    (dict(arch="llama", qk_norm=True, mlp="gelu"), "mlp: gelu: Qwen3ForCausalLM computes swiglu MLPs only"),
    (dict(arch="gpt2", mlp="swiglu"), "mlp: swiglu: GPT2LMHeadModel computes gelu or relu2 MLPs only"),
    (dict(arch="gpt2", value_embeds=1), "value_embeds: 1: GPT2LMHeadModel has no value embeddings"),
    (dict(arch="llama", sliding_window=8), "sliding_window: 8: LlamaForCausalLM attends to every earlier token"),
    (dict(arch="llama", rope_pattern=["nope"]), "rope_pattern: ['nope']: LlamaForCausalLM rotates q and k in every layer"),
    (dict(arch="llama", partial_rotary_factor=0.5),
     "partial_rotary_factor: 0.5: LlamaForCausalLM rotates the whole of each head"),
    (dict(arch="gpt2", attn_scale_dim=24), "attn_scale_dim: 24: GPT2LMHeadModel scales attention by 1/sqrt(head_dim)"),
    (dict(arch="gemma3", n_layer=2, sliding_window=8, window_pattern=["global", "local"]),
     "window_pattern: ['global', 'local']: Gemma3ForCausalLM reads N - 1 local layers then a global one"),
    (dict(arch="gemma3", qk_norm=False), "qk_norm: False: Gemma3ForCausalLM normalises q and k"),
    (dict(arch="olmo2", qk_norm=False), "qk_norm: False: Olmo2ForCausalLM normalises q and k"),
    (dict(arch="mistral", n_layer=2, sliding_window=8, window_pattern=["local", "global"]),
     "window_pattern: ['local', 'global']: MistralForCausalLM slides one window over every layer"),
])
def test_what_hugging_face_cannot_express_is_refused_naming_the_key(options, key):
    with pytest.raises(UserError, match=re.escape(key)):
        hf_config(GPTConfig(**(SMALL | dict(n_layer=1) | options)), eot=0)


# a Llama folder's config.json, and beside it what the folders of each family may set that is not built here
LLAMA_FOLDER = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
                    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=64)


@pytest.mark.parametrize("config, refusal", [
    (dict(hidden_act="gelu"), 'has hidden_act: "gelu"; built here: silu (SwiGLU)'),
    (dict(attention_bias=True), "has attention_bias: true; built here: attention without biases"),
    (dict(attn_logit_softcapping=50.0), "has attn_logit_softcapping: 50.0; built here: attention without a soft cap"),
    (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True),
     "has use_sliding_window: true; built here: full attention in every layer"),
    (dict(architectures=["Phi3ForCausalLM"], model_type="phi3", rope_scaling=dict(type="longrope", short_factor=[1.0] * 8,
                                                                                  long_factor=[2.0] * 8)),
     'has rope_scaling: "longrope"; built here: plain RoPE'),  # transformers 4's form, Phi-3-mini-128k's
    (dict(architectures=["Phi3ForCausalLM"], model_type="phi3", rope_parameters=dict(rope_type="longrope")),
     'has rope_scaling: "longrope"'),  # transformers 5's
    (dict(architectures=["SmolLM3ForCausalLM"], model_type="smollm3", use_sliding_window=True, sliding_window=16),
     "has use_sliding_window: true; built here: full attention in every layer"),
    (dict(architectures=None, model_type="falcon"), "holds a falcon (config.json's model_type); this trainer starts from"),
])
def test_a_folder_of_what_is_not_built_is_refused_naming_the_field(config, refusal, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_FOLDER | config))
    with pytest.raises(UserError, match=re.escape(f"init_from: {tmp_path}/ {refusal}")):
        hf_model_keys(str(tmp_path))


# the hybrids whose other layers are not built, as their folders name them: class, model_type, what is named
HYBRIDS = [("KimiLinearForCausalLM", "kimi_linear", "Kimi Delta Attention (KDA) layers"),
           ("GraniteMoeHybridForCausalLM", "granitemoehybrid", "Mamba 2 layers (Granite 4's"),
           ("FalconH1ForCausalLM", "falcon_h1", "a Mamba 2 mixer beside attention in every layer"),
           ("Lfm2ForCausalLM", "lfm2", "convolution-only blocks (layer_types' conv)"),
           ("OlmoHybridForCausalLM", "olmo_hybrid", "OLMo Hybrid's Gated DeltaNet layers"),
           (None, "bamba", "Mamba 2 layers")]  # a folder naming no class: by its model_type


@pytest.mark.parametrize("architecture, model_type, layers", HYBRIDS)
def test_a_hybrid_whose_layers_are_not_built_is_refused_naming_them(architecture, model_type, layers, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_FOLDER | dict(
        architectures=architecture and [architecture], model_type=model_type, layer_types=["linear_attention"] * 2)))
    with pytest.raises(UserError) as refused:
        hf_model_keys(str(tmp_path))
    assert str(refused.value).startswith(f"init_from: {tmp_path}/ holds a ") and f", whose {layers}" in str(refused.value)
    assert str(refused.value).endswith("are not built here; this trainer builds attention, and Gated DeltaNet layers "
                                       "beside it as Qwen3.5 has them (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM)")


def test_a_qwen3_5_folder_with_a_layer_type_not_built_is_refused_naming_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_FOLDER | dict(
        architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", layer_types=["mamba", "full_attention"])))
    with pytest.raises(UserError, match=re.escape(f"init_from: {tmp_path}/ has layer_types ['mamba'] (layer_types); "
                                                  f"built here: full_attention")):
        hf_model_keys(str(tmp_path))


def test_a_folder_naming_no_class_is_read_by_its_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_FOLDER | dict(architectures=None)))
    assert hf_model_keys(str(tmp_path))[0]["arch"] == "llama"


def test_smollm3s_nope_layers_without_no_rope_layers_are_its_class_default(tmp_path):
    """SmolLM3's config.json without no_rope_layers: every no_rope_layer_interval-th layer (4) has no RoPE."""
    smollm3 = LLAMA_FOLDER | dict(architectures=["SmolLM3ForCausalLM"], model_type="smollm3", num_hidden_layers=8)
    (tmp_path / "config.json").write_text(json.dumps(smollm3))
    assert hf_model_keys(str(tmp_path))[0]["rope_pattern"] == ["rope", "rope", "rope", "nope"]
    (tmp_path / "config.json").write_text(json.dumps(smollm3 | dict(no_rope_layer_interval=2)))
    assert hf_model_keys(str(tmp_path))[0]["rope_pattern"] == ["rope", "nope"]


@pytest.mark.parametrize("arch", ["mistral", "phi3"])
def test_a_window_no_layer_slides_is_not_exported(arch, tmp_path):
    """A window folder (Mistral v0.1's, Phi-3-mini-4k's) trained with every layer global: these classes
    slide config.json's window over every layer, so the export writes none, and transformers computes
    the model's logits on rows longer than the window."""
    cfg = GPTConfig(**SMALL, **MODELS[arch][1], window_pattern=["global"])
    assert hf_config(cfg, eot=0)["sliding_window"] is None
    ours = trained(cfg)
    idx = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        assert torch.allclose(hf_model(cfg, ours.state_dict())(idx).logits, ours(idx)[0], rtol=1e-4, atol=1e-4)


# Llama's folder and its refinements': GPT-2's, Gemma 3's, Qwen3-MoE's, gpt-oss's and DeepSeek's folders need keys it lacks
@pytest.mark.parametrize("family", [f for f in FAMILIES if f.arch not in ("gpt2", "gemma3", "gpt_oss")
                                    and "moe_experts" not in f.when and f.attention == "mha"],
                         ids=lambda family: family.name)
def test_a_folder_silent_on_a_key_reads_as_its_class_does(family, tmp_path):
    """config.json without rms_norm_eps, the RoPE base, the window or the tying: each is what the
    family's class takes then (OLMo 2's and Phi-3's eps 1e-5, SmolLM3's base 2e6, Mistral's window
    4,096, OLMo 3's base 5e5), not Llama's. The window where the class slides one over every layer
    (ONE_WINDOW) or over the layers its default layer_types make sliding (OLMo 3's): Qwen2's and Qwen3's
    slide theirs only with use_sliding_window, which is refused."""
    import transformers
    needs_class(family.hf_class)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_FOLDER | dict(
        architectures=[family.hf_class], model_type=family.hf_model_type, max_position_embeddings=8192)))
    ours, theirs = hf_model_keys(str(tmp_path))[0], transformers.AutoConfig.from_pretrained(tmp_path)
    rope = getattr(theirs, "rope_parameters", None) or {}
    rope_theta = (rope.get("full_attention") or rope).get("rope_theta") or theirs.rope_theta  # per layer type: OLMo 3
    slides = ONE_WINDOW in family.hf_limits or "sliding_attention" in (getattr(theirs, "layer_types", None) or [])
    window = theirs.sliding_window if slides else None
    assert (ours["norm_eps"], ours["rope_theta"], ours.get("sliding_window"), ours["tie_embeddings"]) == \
        (theirs.rms_norm_eps, rope_theta, window, theirs.tie_word_embeddings)


def test_only_the_keys_a_family_lets_change_may_change_on_resume():
    from fsdp_gpt.checkpoint.ckpt_format import check_model_shape
    for arch in ("llama", "gpt2"):
        saved = GPTConfig(**SMALL, arch=arch).model_config
        cfg = TrainConfig(**SMALL | dict(arch=arch, block_size=64, vocab_size=256))
        validate(cfg)
        if arch == "llama":  # RoPE holds no weights per position
            assert check_model_shape("old.pth", saved, cfg) == {"block_size": (32, 64)}
        else:
            resumable = [family.name for family in FAMILIES if "block_size" in family.resumable]
            assert "Llama" in resumable and "GPT-2" not in resumable
            with pytest.raises(UserError, match=re.escape(f"to resume it (only {', '.join(resumable)} may change "
                                                          f"block_size on resume)")):
                check_model_shape("old.pth", saved, cfg)


def test_the_whole_folders_export_finds_each_trained_tensor_by_the_sources_name():
    """A multimodal source's names (model.language_model.*, the experts stored fused, the vision tower
    beside them): each trained tensor goes where the source holds it, the fused experts stacked; a source
    tensor of the language model the trained model lacks is refused, naming it."""
    from fsdp_gpt.config import UserError
    from fsdp_gpt.hf_whole_folder import by_stored_name
    cfg = GPTConfig(**SMALL, **MODELS["qwen3_5_moe"][1])
    hf = to_hf(trained(cfg).state_dict(), cfg)
    fused = fused_like(hf, [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")])
    stored = [name.replace("model.", "model.language_model.", 1) for name in fused if name != "lm_head.weight"]  # tied
    found = by_stored_name(hf, stored + ["model.visual.patch_embed.proj.weight"], cfg.family, True, "src")
    assert sorted(found) == sorted(stored)
    name = "model.language_model.layers.1.mlp.experts.gate_up_proj"
    assert torch.equal(found[name], fused["model.layers.1.mlp.experts.gate_up_proj"])
    with pytest.raises(UserError, match=re.escape("src/ holds 'model.language_model.layers.2.mlp.gate.weight', which "
                                                  "the trained model has no weight for")):
        by_stored_name(hf, stored + ["model.language_model.layers.2.mlp.gate.weight"], cfg.family, True, "src")


def test_a_folder_whose_experts_are_stored_fused_reads_as_one_stored_per_expert(tmp_path):
    """transformers 5's model holds a mixture's experts fused (experts.gate_up_proj, down_proj): a
    file written from that layout reads back as save_pretrained's per-expert one."""
    from safetensors.torch import load_file, save_file
    cfg = GPTConfig(**SMALL, **MODELS["qwen3_moe"][1])
    hf = hf_model(cfg, trained(cfg).state_dict())
    hf.save_pretrained(tmp_path)
    per_expert = read_hf_folder(str(tmp_path))[1]
    (path,) = tmp_path.glob("*.safetensors")
    stored = load_file(path)
    fused_keys = [k for k in hf.state_dict() if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    fused = fused_like(stored, fused_keys or [f"model.layers.1.mlp.experts.{p}" for p in ("gate_up_proj", "down_proj")])
    assert any(k.endswith("experts.gate_up_proj") for k in fused) and not any(".experts.0." in k for k in fused)
    save_file(fused, path, metadata={"format": "pt"})
    assert all(torch.equal(tensor, per_expert[name]) for name, tensor in read_hf_folder(str(tmp_path))[1].items())

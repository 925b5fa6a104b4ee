"""model.GPT: shapes, tying, initialisation, and the FLOPs formula against PyTorch's counter."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fsdp_gpt.model import GPT, GPTConfig
from conftest import needs_transformers


def test_forward_shapes_tying_and_initial_loss():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg)
    idx = torch.randint(0, 256, (3, 16))
    logits, loss = model(idx, torch.randint(0, 256, (3, 16)))
    assert logits is None  # with targets: the loss without a logits tensor (loss.py)
    assert model(idx)[0].shape == (3, 16, 256)
    assert model.lm_head.weight is model.wte.weight
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.2  # near-uniform at init
    assert model.num_params() == sum(p.numel() for p in model.parameters())


def test_generate_is_deterministic_for_a_seed():
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)).eval()
    start = torch.zeros(1, 1, dtype=torch.long)
    runs = [model.generate(start, 20, top_k=10, generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert runs[0].shape == (1, 21) and torch.equal(*runs)


@pytest.mark.parametrize("shape", [
    dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128),  # demo
    dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=10, n_embd=640),  # 90M
    dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, arch="llama", n_kv_head=4,
         tie_embeddings=False, qk_norm=True),  # llama_124M's layout with GQA and qk_norm
    dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, arch="llama", n_kv_head=4,
         tie_embeddings=False, qk_norm=True, mlp="relu2", logit_softcap=15.0, zero_init_proj=True, value_embeds=3),  # recipe
    dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, mlp="relu2", ffn_hidden=96),  # gpt2, relu2
])
def test_flops_formula_matches_flop_counter(shape):
    with torch.device("meta"):
        model = GPT(GPTConfig(**shape))
        idx = torch.zeros(1, shape["block_size"], dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        model(idx, idx)[1].backward()
    counted_per_token = counter.get_total_flops() / shape["block_size"]
    assert model.flops_per_token() == counted_per_token  # exactly: every matmul and attention product


def test_the_recipes_model_parts():
    torch.manual_seed(0)
    shape = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    idx = torch.randint(0, 64, (2, 16))
    relu2 = GPT(GPTConfig(**shape, mlp="relu2"))
    mlp, x = relu2.blocks[0].mlp, torch.randn(2, 16, 32)
    assert mlp.c_fc.out_features == 128 and torch.equal(mlp(x), mlp.c_proj(torch.relu(mlp.c_fc(x)) ** 2))
    capped = GPT(GPTConfig(**shape, logit_softcap=2.0))
    raw = GPT(GPTConfig(**shape))
    raw.load_state_dict(capped.state_dict())
    assert torch.allclose(capped(idx)[0], 2.0 * torch.tanh(raw(idx)[0] / 2.0)) and capped(idx)[0].abs().max() < 2.0
    zero = GPT(GPTConfig(**shape, zero_init_proj=True))
    assert all(p.abs().sum() == 0 for name, p in zero.named_parameters() if name.endswith("c_proj.weight"))
    embedded = zero.wte(idx) + zero.wpe(torch.arange(16))
    assert torch.equal(zero(idx)[0], zero.lm_head(zero.ln_f(embedded)))  # every block starts as the identity

    valued = GPT(GPTConfig(**shape, value_embeds=1))
    first, second = (block.attn for block in valued.blocks)
    assert first.value_embed.weight.shape == (64, 32) and not hasattr(second, "value_embed")
    assert first.value_mix.tolist() == [0.5, 0.5]
    plain = GPT(GPTConfig(**shape))
    plain.load_state_dict({k: v for k, v in valued.state_dict().items() if ".value_" not in k})
    with torch.no_grad():
        first.value_mix.copy_(torch.tensor([1.0, 0.0]))  # v alone: the plain model
        assert torch.equal(valued(idx)[0], plain(idx)[0])
        first.value_mix.copy_(torch.tensor([1.0, 1.0]))
        assert not torch.allclose(valued(idx)[0], plain(idx)[0])


def test_a_layer_that_does_not_rotate_attends_without_positions():
    """rope_pattern's nope layers (SmolLM3's): a one-layer model's last prediction is then the same for any
    order of the tokens before it, a rotating layer's is not."""
    torch.manual_seed(0)
    shape = dict(arch="llama", vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    idx = torch.randint(0, 64, (1, 16))
    shuffled = torch.cat((idx[:, :-1].flip(1), idx[:, -1:]), dim=1)
    nope = GPT(GPTConfig(**shape, rope_pattern=["nope"]))
    rope = GPT(GPTConfig(**shape))
    rope.load_state_dict(nope.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(nope(shuffled)[0][:, -1], nope(idx)[0][:, -1])
        assert not torch.allclose(rope(shuffled)[0][:, -1], rope(idx)[0][:, -1])
    assert [block.rotates for block in GPT(GPTConfig(**shape | dict(n_layer=5), rope_pattern=["rope", "nope"])).blocks
            ] == [True, False, True, False, True]


def test_under_autocast_the_residual_stream_is_in_its_dtype():
    """As FSDP2's bf16 parameters give it: each block takes and returns x in autocast's dtype, so one
    process computes as its sharded twin does; without autocast the stream stays fp32."""
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16))
    seen = []
    for block in model.blocks:
        block.register_forward_hook(lambda module, args, out: seen.append((args[0].dtype, out.dtype)))
    idx = torch.randint(0, 64, (2, 8))
    with torch.autocast("cpu", torch.bfloat16):
        model(idx, idx)
    assert seen == [(torch.bfloat16, torch.bfloat16)] * 2
    seen.clear()
    model(idx, idx)
    assert seen == [(torch.float32, torch.float32)] * 2


def test_under_autocast_attention_takes_q_k_v_in_one_dtype():
    """The value embedding is no autocast op (its rows come out fp32) and CUDA's autocast runs the qk
    norms in fp32: the core still gets q, k and v all in c_attn's bf16, as flash's varlen call needs."""
    model = GPT(GPTConfig(arch="llama", vocab_size=64, block_size=8, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                          qk_norm=True, value_embeds=2))
    seen = []
    for block in model.blocks:
        core = block.attn.core
        block.attn.core = lambda q, k, v, *rest, core=core: seen.append((q.dtype, k.dtype, v.dtype)) or core(
            q, k, v, *rest)
        block.attn.ln_q.register_forward_hook(lambda module, args, out: out.float())  # as CUDA's fp32 norm returns
    idx = torch.randint(0, 64, (2, 8))
    with torch.autocast("cpu", torch.bfloat16):
        model(idx, idx)
    assert seen == [(torch.bfloat16,) * 3] * 2


# model_keys.py's one rule for what a checkpoint keeps of the model: each key, changed from a small
# model's (the base, with the keys it needs beside it), and whether that changes the weights' shapes or,
# with the same weights, the logits. Every model key has a row: a new key must say which it is.
RULE_BASE = dict(arch="llama", vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
MOE = dict(moe_experts=4)
LINEAR = dict(attn_pattern=["linear", "full"])
LATENT = dict(arch="deepseek_v3", kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
GROUPS = LATENT | dict(moe_experts=8, moe_groups=4)  # 4 groups of 2, a token's 2 experts from its best group
CHANGED = {  # key: (another value, the keys it needs beside it)
    "arch": ("gpt2", {}), "vocab_size": (128, {}), "block_size": (32, dict(arch="gpt2")), "n_layer": (3, {}),
    "n_head": (2, {}), "n_embd": (64, {}), "dropout": (0.5, {}), "bias": (False, dict(arch="gpt2")),
    "n_kv_head": (2, {}), "head_dim": (16, {}), "rope_theta": (500.0, {}),
    "rope_scaling": (dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=4), {}),
    "qk_norm": (True, {}), "tie_embeddings": (True, {}), "ffn_hidden": (128, {}), "norm_eps": (0.1, {}),
    "mlp": ("geglu", {}), "sliding_window": (4, {}), "window_pattern": (["local", "global"], dict(sliding_window=4)),
    "rope_local_theta": (100.0, dict(sliding_window=4)), "rope_pattern": (["rope", "nope"], {}),
    "partial_rotary_factor": (0.5, {}),
    "attn_scale_dim": (16, {}), "logit_softcap": (0.5, {}), "zero_init_proj": (True, {}), "value_embeds": (1, {}),
    "moe_experts": (4, {}), "moe_top_k": (1, MOE), "moe_hidden": (16, MOE), "moe_shared": (1, MOE),
    "moe_dense_layers": (1, MOE), "moe_score": ("sigmoid", MOE), "moe_norm_top_k": (False, MOE),
    "moe_aux_loss": (0.01, MOE),
    "attn_pattern": (["linear", "full"], {}), "linear_key_heads": (2, LINEAR), "linear_value_heads": (8, LINEAR),
    "linear_key_dim": (16, LINEAR), "linear_value_dim": (16, LINEAR), "linear_conv": (2, LINEAR),
    # a chunk past the row's 16 tokens sums alike; a shorter one differs by rounding alone (how, not what:
    # tests/test_linear_attention.py holds chunks of 16 and 64 to transformers' layer within 1e-5)
    "linear_chunk": (32, LINEAR),
    "moe_scale": (2.5, LATENT | MOE), "moe_groups": (2, LATENT | MOE),
    "moe_top_groups": (2, GROUPS), "q_lora_rank": (8, LATENT), "kv_lora_rank": (12, LATENT),
    "qk_rope_head_dim": (8, LATENT), "qk_nope_head_dim": (8, LATENT), "v_head_dim": (4, LATENT),
    "rope_interleave": (False, LATENT),
}


def what_changes(keys: dict, other: dict) -> str:
    """"weights" where the two models' weights differ in name or shape; else "logits" where, with the
    same weights, evaluation's logits differ; else "nothing"."""
    torch.manual_seed(0)
    one, two = GPT(GPTConfig(**keys)), GPT(GPTConfig(**other))
    if {k: v.shape for k, v in one.state_dict().items()} != {k: v.shape for k, v in two.state_dict().items()}:
        return "weights"
    two.load_state_dict(one.state_dict())
    x = torch.randint(0, keys["vocab_size"], (2, keys["block_size"]))
    with torch.no_grad():
        return "nothing" if torch.equal(one.eval()(x)[0], two.eval()(x)[0]) else "logits"


@pytest.mark.parametrize("key", CHANGED)
def test_a_key_defines_the_model_exactly_when_it_changes_what_the_model_computes(key):
    from fsdp_gpt.model_keys import DEFINING_KEYS, MODEL_FIELDS
    assert set(CHANGED) == set(MODEL_FIELDS), "a model key without a row here: give it one"
    value, beside = CHANGED[key]
    keys = RULE_BASE | beside
    changes = what_changes(keys, keys | {key: value})
    assert (changes != "nothing") == (key in DEFINING_KEYS), (
        f"{key}: its change changes {changes}, but model_keys.py has defines={key in DEFINING_KEYS}")


def test_clamped_swiglu_is_gpt_oss_experts_gate_beyond_its_clamps():
    """ACTIVATIONS["clamped_swiglu"] on [gates | ups] against transformers' GptOssExperts on the same
    values interleaved (gate, up, gate, up, ... as its gate_up_proj computes them), past the clamp at 7
    on both sides: the gate clamped from above only, up from both."""
    needs_transformers("gpt-oss's experts")
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from fsdp_gpt.model import ACTIVATIONS
    gate, up = (torch.linspace(-12, 12, 97)[torch.randperm(97, generator=torch.Generator().manual_seed(s))]
                for s in (0, 1))
    theirs = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=97, num_local_experts=1))
    interleaved = torch.stack([gate, up], dim=-1).flatten()
    ours = ACTIVATIONS["clamped_swiglu"](torch.cat([gate, up]))
    assert torch.equal(ours, theirs._apply_gate(interleaved))
    assert (gate > 7).any() and (gate < -7).any() and (up > 7).any() and (up < -7).any()  # every clamp reached

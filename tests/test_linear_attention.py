"""Gated DeltaNet (fsdp_gpt/linear_attention.py): transformers' own torch reference of Qwen3.5's layer
computes what ours does, in fp32 and in bf16; the chunked rule is the token-by-token recurrence (from any
state, with probes); doc_mask runs each document alone; the model's FLOPs, initialisation and optimizer
take the layer."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fsdp_gpt.attention import Documents
from fsdp_gpt.linear_attention import chunked_delta_rule, l2_normed
from fsdp_gpt.model import GPT, GPTConfig
from conftest import needs_transformers

# grouped heads (2 key heads, each serving 2 value heads), key and value widths apart, a row of 150 tokens
# (two chunks of 64 and a part), and a shorter chunk
HYBRID = dict(arch="llama", vocab_size=64, block_size=160, n_layer=2, n_head=4, n_embd=64, attn_pattern=["linear", "full"],
              linear_key_heads=2, linear_value_heads=4, linear_key_dim=16, linear_value_dim=8)


def layer_pair(dtype: torch.dtype = torch.float32, **options):
    """Our layer, its weights moved off their start, and transformers' Qwen3_5GatedDeltaNet holding the same tensors
    under the same names."""
    needs_transformers("Qwen3.5's Gated DeltaNet")
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    torch.manual_seed(0)
    cfg = GPTConfig(**HYBRID | options)
    ours = GPT(cfg).blocks[0].attn
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    theirs = Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(
        hidden_size=cfg.n_embd, linear_num_key_heads=cfg.linear_key_heads, linear_num_value_heads=cfg.linear_value_heads,
        linear_key_head_dim=cfg.linear_key_dim, linear_value_head_dim=cfg.linear_value_dim,
        linear_conv_kernel_dim=cfg.linear_conv, rms_norm_eps=cfg.norm_eps, num_hidden_layers=1,
        layer_types=["linear_attention"]), 0)
    assert theirs.load_state_dict(ours.state_dict()).missing_keys == []  # strict: every name alike
    return ours.to(dtype), theirs.to(dtype)


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference relative to the largest entry (0 where both are zeros: a single token's
    gradient of the decay, which acts on no earlier state)."""
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("T, chunk", [(150, 64), (64, 64), (1, 64), (150, 16)])
def test_the_layer_is_transformers_qwen3_5_gated_deltanet_in_fp32(T, chunk):
    """Outputs and every gradient (the input's and each weight's) within 1e-5, on rows that are not a
    multiple of the chunk and on one that is."""
    ours, theirs = layer_pair(linear_chunk=chunk)
    x = torch.randn(2, T, 64, generator=torch.Generator().manual_seed(T), requires_grad=True)
    got, expected = ours(x), theirs(x)
    assert relative(got, expected) < 1e-5
    names = [name for name, _ in ours.named_parameters()]
    grads = [torch.autograd.grad(model(x).square().sum(), [x] + [model.get_parameter(n) for n in names])
             for model in (ours, theirs)]
    for name, mine, its in zip(["x"] + names, *grads):
        assert relative(mine, its) < 1e-5, name


def test_the_layer_in_bf16_is_transformers_within_bf16_rounding():
    """Both in bf16 (as FSDP2's bf16 parameters compute), the output within a few bf16 roundings of
    transformers' and of the fp32 layer's."""
    ours, theirs = layer_pair(torch.bfloat16)
    x = torch.randn(2, 150, 64, generator=torch.Generator().manual_seed(1))
    got, expected = ours(x.bfloat16()), theirs(x.bfloat16())
    assert got.dtype == torch.bfloat16 and relative(got, expected) < 2e-2
    reference = ours.float()(x)
    assert relative(got, reference) < 3e-2 and relative(got, reference) > 1e-4  # bf16's rounding, not fp32 again


def recurrence(q, k, v, g, beta, state):
    """The rule a token at a time, as its definition reads: S_t = exp(g_t)(I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,
    o_t = S_t^T q_t / sqrt(dk); q, k (N, T, heads, dk), v (N, T, heads, W) where W > dv: probe columns of zero values."""
    outputs = []
    eye = torch.eye(q.shape[-1], dtype=torch.float64)
    for t in range(q.shape[1]):
        kt = k[:, t].unsqueeze(-1)
        state = g[:, t].exp()[..., None, None] * (eye - beta[:, t][..., None, None] * kt @ kt.mT) @ state \
            + beta[:, t][..., None, None] * kt @ v[:, t].unsqueeze(-2)
        outputs.append((state.mT @ q[:, t].unsqueeze(-1)).squeeze(-1) / q.shape[-1] ** 0.5)
    return torch.stack(outputs, 1), state


def test_the_chunked_rule_is_the_recurrence_from_any_state_and_with_probes():
    """Outputs and the final state against the recurrence in fp64: from zeros, from a given state, and with
    probe columns started at the identity, whose outputs and final state are what carries the state
    before the row (o = o(0) + probes' o @ S0, final = probes' final @ S0 + final(0))."""
    gen = torch.Generator().manual_seed(0)
    N, T, heads, dk, dv = 2, 100, 2, 8, 4
    q, k = (l2_normed(torch.randn(N, T, heads, dk, generator=gen)) for _ in range(2))
    v = torch.randn(N, T, heads, dv, generator=gen)
    g, beta = -torch.rand(N, T, heads, generator=gen) * 2, torch.rand(N, T, heads, generator=gen)
    start = torch.randn(N, heads, dk, dv, generator=gen)
    as64 = [t.double() for t in (q, k, v, g, beta)]
    for state in (None, start):
        out, final = chunked_delta_rule(q, k, v, g, beta, 32, state, final=True)
        expected, expected_final = recurrence(*as64, torch.zeros(N, heads, dk, dv, dtype=torch.float64)
                                              if state is None else state.double())
        assert relative(out, expected) < 1e-5 and relative(final, expected_final) < 1e-5
    probes = torch.cat([torch.eye(dk).expand(N, heads, dk, dk), torch.zeros(N, heads, dk, dv)], -1)
    out, final = chunked_delta_rule(q, k, v, g, beta, 32, probes, final=True)
    carried = out[..., dk:] + torch.einsum("nthk,nhkv->nthv", out[..., :dk], start)
    carried_final = final[..., dk:] + final[..., :dk] @ start
    expected, expected_final = recurrence(*as64, start.double())
    assert relative(carried, expected) < 1e-5 and relative(carried_final, expected_final) < 1e-5


def test_doc_mask_runs_each_document_alone():
    """With documents, every position's output is the layer's on its document alone: the convolution and
    the state start at zero at each document (a row that opens with a separator, single-token documents,
    one longer than a chunk, a document ending at the row's end)."""
    ours, _ = layer_pair(linear_chunk=16)
    T = 150
    opens = torch.zeros(2, T, dtype=torch.bool)
    opens[0, [0, 3, 4, 40, 41, 100]] = True
    opens[1, [70]] = True
    x = torch.randn(2, T, 64, generator=torch.Generator().manual_seed(2))
    docs = Documents.of_rows(opens)
    got = ours(x, docs=docs)
    for row in range(2):
        starts = sorted({0, *opens[row].nonzero().flatten().tolist()}) + [T]
        for start, end in zip(starts, starts[1:]):
            alone = ours(x[row:row + 1, start:end])
            assert relative(got[row:row + 1, start:end], alone) < 1e-5, (row, start, end)
    assert relative(got, ours(x)) > 1e-2  # documents change what a row computes


@pytest.mark.parametrize("block_size", [128, 150])
def test_flops_formula_matches_flop_counter_with_linear_layers(block_size):
    """GPT.flops_per_token against FlopCounterMode over a forward and backward, for a model of a linear
    layer and a full one. The counter takes a grouped convolution's backward for a dense one's (its formula
    ignores groups: C times a depthwise convolution's work), so it counts the convolution's backward as
    twice its forward, as every other backward here is."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**HYBRID | dict(block_size=block_size)))
        idx = torch.zeros(1, block_size, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        model(idx, idx)[1].backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    counted = counter.get_total_flops() - counts["aten.convolution_backward"] + 2 * counts["aten.convolution"]
    assert model.flops_per_token() == pytest.approx(counted / block_size, rel=1e-12)


def test_a_linear_layer_starts_as_its_own_and_muon_takes_its_maps_not_its_gates():
    """The convolution uniform within 1/sqrt(kernel), decay rates exp(A_log) over 0.01 .. 16, the step bias at
    one, the gated norm at ones, out_proj a residual projection (std / sqrt(2 n_layer), zero with
    zero_init_proj); Muon orthogonalises the projections of q, k, v, the gate and the output, AdamW the per-head
    gates (in_proj_a, in_proj_b), the convolution and the vectors."""
    from fsdp_gpt.optim.muon import is_muon_matrix
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**HYBRID | dict(n_embd=256, linear_value_heads=64, linear_key_heads=32)))
    layer = gpt.blocks[0].attn
    assert layer.conv1d.weight.abs().max() <= 0.5 and layer.conv1d.weight.std() > 0.25  # uniform in +-1/sqrt(4)
    rates = layer.A_log.exp()
    assert rates.min() >= 0.01 and rates.max() <= 16 and rates.std() > 2
    assert torch.equal(layer.dt_bias, torch.ones(64)) and torch.equal(layer.norm.weight, torch.ones(8))
    assert layer.out_proj.weight.std().item() == pytest.approx(0.02 / 2, rel=0.05)  # n_layer 2
    assert layer.in_proj_qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    zero = GPT(GPTConfig(**HYBRID | dict(zero_init_proj=True)))
    assert not zero.blocks[0].attn.out_proj.weight.any()
    muon = {name.removeprefix("blocks.0.attn.") for name, p in gpt.named_parameters()
            if name.startswith("blocks.0.attn.") and is_muon_matrix(name, p.shape)}
    assert muon == {"in_proj_qkv.weight", "in_proj_z.weight", "out_proj.weight"}

"""The 90M, 124M and 300M configs hold what their names say, as the trainer counts them."""
import os

import pytest
import yaml

from conftest import ROOT, counted_parameters, overrides


GPT2_VOCAB = 50304


def gpt2_parameters(vocab_size, block_size, n_layer, n_embd, bias=True, **_) -> int:
    """Counted by hand from the GPT-2 layout (tied LM head): embeddings, per block two LayerNorms,
    attention (qkv + projection) and MLP (4x up + down), and the final LayerNorm."""
    b = 1 if bias else 0
    block = 2 * (n_embd + b * n_embd) + (3 * n_embd * n_embd + b * 3 * n_embd) + (n_embd * n_embd + b * n_embd) + (
        4 * n_embd * n_embd + b * 4 * n_embd) + (4 * n_embd * n_embd + b * n_embd)
    return vocab_size * n_embd + block_size * n_embd + n_layer * block + n_embd + b * n_embd


def llama_parameters(vocab_size, n_layer, n_head, n_embd, n_kv_head=None, tie_embeddings=False, qk_norm=False,
                     **_) -> int:
    """Counted by hand from the Llama layout: embeddings (and an untied head), per block two
    RMSNorms, q, k, v (GQA: n_kv_head heads for k and v), the output projection, SwiGLU's gate,
    up and down at 8/3 n_embd rounded up to 256, qk_norm's two head-wide norms; the final norm."""
    head_dim, kv = n_embd // n_head, n_kv_head or n_head
    hidden = 256 * -(-(8 * n_embd // 3) // 256)
    block = 2 * n_embd + n_embd * (n_head + 2 * kv) * head_dim + n_embd * n_embd + 3 * n_embd * hidden + (
        2 * head_dim if qk_norm else 0)
    return vocab_size * n_embd * (1 if tie_embeddings else 2) + n_layer * block + n_embd


def count_parameters(shape: dict) -> int:
    return (llama_parameters if shape.get("arch") == "llama" else gpt2_parameters)(**shape)


@pytest.mark.parametrize("name, target", [("train90M_fsdp.yaml", 90e6), ("train300M_fsdp.yaml", 300e6),
                                          ("llama_124M.yaml", 124e6), ("gpt2_124M.yaml", 124e6)])
def test_config_holds_the_parameters_its_name_says(name, target):
    # the vocabulary the configs have on GPT-2 tokens (50,257 rounded up to 50,304)
    count = counted_parameters(os.path.join(ROOT, "config", name), *overrides(vocab_size=GPT2_VOCAB))
    with open(os.path.join(ROOT, "config", name)) as f:
        shape = yaml.safe_load(f) | dict(vocab_size=GPT2_VOCAB)
    assert count == count_parameters(shape)
    assert abs(count - target) <= 0.05 * target, count  # the name says what the config holds

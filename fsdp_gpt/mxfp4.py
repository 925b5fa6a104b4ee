"""MXFP4 weights (the OCP Microscaling format: gpt-oss's published folders hold their experts so) made
plain: each weight a 4-bit float (E2M1: a sign, two exponent bits, one mantissa bit), 32 of them
sharing one power-of-two scale (E8M0: a biased exponent, 127 for 1).

A folder stores a tensor W (..., rows, cols) as W_blocks (..., cols, cols / 32, 16) uint8, two weights
a byte (the low nibble first), and W_scales (..., cols, cols / 32) uint8, with the last two dimensions
of W transposed (gpt-oss's gate_up_proj (experts, width, 2 hidden) is stored by its 2 hidden output
rows). Every value is a number fp32 (and bf16) holds exactly: dequantized, the weights are the same
bits transformers' own dequantization gives (integrations/mxfp4.py, tested here).
"""
import torch

# E2M1's 16 codes: 0, 0.5, 1, 1.5, 2, 3, 4, 6, then the same negative
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W (..., cols, rows) in dtype from its MXFP4 blocks (..., rows, groups, 16) and scales (..., rows, groups)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not fit their scales {list(scales.shape)} "
                         f"(blocks: (..., rows, groups, 16), scales: (..., rows, groups))")
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # (..., rows, groups, 32)
    values = torch.ldexp(table[codes], (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1))
    return values.flatten(-2).transpose(-2, -1).to(dtype).contiguous()


def dequantized(tensors: dict) -> dict:
    """A folder's tensors with each W_blocks and W_scales pair replaced by W in fp32 (stacked experts one
    at a time: the 4-bit codes' indices take 16 bytes a weight while they last)."""
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith("_blocks")]:
        weight = name.removesuffix("_blocks")
        if f"{weight}_scales" in out:
            blocks, scales = out.pop(name), out.pop(f"{weight}_scales")
            out[weight] = torch.stack([dequantize(b, s) for b, s in zip(blocks, scales)]) if blocks.dim() > 3 else \
                dequantize(blocks, scales)
    return out

"""A Hugging Face folder's quantized weights, as its config.json's quantization_config names them, made
full precision as they are read (init_from), never read as if they were: fine-grained FP8 (DeepSeek
V3's, Kimi K2's, the FP8 folders of Qwen3 and others), each weight's float8 matrix beside a scale per
block (weight_scale_inv: one fp32 a block of 128 x 128, the blocks at the edges cut short), and
MXFP4 (gpt-oss's experts: mxfp4.py). A method
not built here is refused by name; a float8 tensor without its scale too. Training and the export
keep the weights in full precision (the export writes fp32, or bf16 with --dtype)."""
import math

import torch

from fsdp_gpt.config import UserError
from fsdp_gpt.mxfp4 import dequantized as mxfp4_dequantized

SCALE = "_scale_inv"  # a weight's scales beside it: X.weight_scale_inv for X.weight (X_scale_inv for a fused X)
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)


def block_dequantized(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """(..., rows, cols) float8 weights times their blocks' scales (..., ceil(rows / b0), ceil(cols / b1)),
    in fp32: each entry its own product, as transformers' and DeepSeek's dequantization take it."""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return weight.float() * scale.repeat_interleave(block[1], dim=-1)[..., :cols]


def fp8_blocks(tensors: dict, quantization: dict, where: str) -> dict:
    """Every weight with scales beside it dequantized (the scales dropped), each grid checked against its
    weight's shape at the config's weight_block_size."""
    block = tuple(quantization.get("weight_block_size") or (128, 128))
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE):
            continue
        scale = tensors.get(name + SCALE)
        if scale is not None:
            grid = tuple(math.ceil(n / b) for n, b in zip(tensor.shape[-2:], block))
            if tuple(scale.shape[-2:]) != grid or scale.shape[:-2] != tensor.shape[:-2]:
                raise UserError(f"{where}: {name} of shape {list(tensor.shape)} has scales of shape {list(scale.shape)}; "
                                f"its weight_block_size {list(block)} makes them {list(tensor.shape[:-2]) + list(grid)}")
            tensor = block_dequantized(tensor, scale, block)
        out[name] = tensor
    return out


# quantization_config's quant_method -> (the weights made full precision, what start-up says of it)
QUANTIZATIONS = {"fp8": (fp8_blocks, lambda q: f"its FP8 weights (quantization_config: fp8, blocks of "
                                               f"{' x '.join(map(str, q.get('weight_block_size') or (128, 128)))}) "
                                               f"are dequantized to fp32 as they are read; training and an export keep "
                                               f"them in full precision"),
                 # gpt-oss's published folders: the experts' weights as 4-bit floats, 32 a power-of-two scale
                 "mxfp4": (lambda tensors, quantization, where: mxfp4_dequantized(tensors),
                           lambda q: "its MXFP4 experts (quantization_config: mxfp4) are dequantized to fp32 as they "
                                     "are read; training and an export keep them in full precision")}


def quantization_of(config: dict, where: str) -> dict | None:
    """config.json's quantization_config where its method is built here (None: not quantized); another refused by name."""
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method")
    if method not in QUANTIZATIONS:
        raise UserError(f"{where} holds weights quantized by {method} (config.json's quantization_config); read here: "
                        f"{', '.join(QUANTIZATIONS)} (dequantized as read), or unquantized weights")
    return quantization


def full_precision(tensors: dict, config: dict, where: str) -> dict:
    """A folder's tensors with its quantized weights made full precision; a float8 tensor left (no scale
    beside it, or a folder that says it is not quantized) is refused, naming it."""
    if quantization := quantization_of(config, where):
        tensors = QUANTIZATIONS[quantization["quant_method"]][0](tensors, quantization, where)
    for name, tensor in tensors.items():
        if tensor.dtype in FLOAT8:
            raise UserError(f"{where}: {name} is {str(tensor.dtype).removeprefix('torch.')} with no {name}{SCALE} "
                            f"beside it (config.json's quantization_config: {config.get('quantization_config')}): not "
                            f"read as if it were full precision")
    return tensors


def quantization_note(config: dict, where: str) -> str | None:
    quantization = quantization_of(config, where)
    return QUANTIZATIONS[quantization["quant_method"]][1](quantization) if quantization else None

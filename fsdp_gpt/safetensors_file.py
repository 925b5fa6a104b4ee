"""Reading safetensors files (a Hugging Face folder's weights) without the safetensors library:
every tensor as fp32 (a quantized one as it is: float8 and uint8 tensors, which hf_quantized.py
reads by their scales), a damaged or truncated file refused in one line that names it."""
import json
import math
import os

import torch

from fsdp_gpt.config import UserError
from fsdp_gpt.files import read_json

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# quantized weights and their scales, kept in their dtype (never read as if they were full precision):
# fine-grained FP8's float8 blocks, MXFP4's uint8 blocks and scales (gpt-oss's)
QUANTIZED_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
                    "U8": torch.uint8}


def read_safetensors(folder: str) -> dict:
    """Every tensor of model.safetensors, or of the files model.safetensors.index.json names, as fp32
    (quantized ones in their dtype)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index, "init_from: the folder is damaged: download the model again",
                               keys=("weight_map",))["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise UserError(f"init_from: {path} is missing (only safetensors weights are read)")
        tensors |= _read_safetensors_file(path)
    return tensors


def _read_safetensors_file(path: str) -> dict:
    """The format: an 8-byte little-endian header length, a JSON header ({name: dtype, shape,
    data_offsets}), then the raw bytes. Checked against the file's size before anything is read."""
    def refuse(what: str) -> UserError:
        return UserError(f"init_from: {path}: {what}")

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < 8:
            raise refuse(f"truncated: {size} bytes, shorter than the header's length field")
        header_size = int.from_bytes(f.read(8), "little")
        if 8 + header_size > size:
            raise refuse(f"the header claims {header_size:,} bytes, more than the {size - 8:,} after its length: "
                         f"truncated, or not a safetensors file")
        try:
            header = json.loads(f.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise refuse(f"the header is not JSON ({e})")
        data_size, tensors = size - 8 - header_size, {}
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            try:
                dtype, shape, (start, end) = meta["dtype"], meta["shape"], meta["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise refuse(f"tensor {key}'s header entry lacks dtype, shape or data_offsets")
            if dtype not in SAFETENSORS_DTYPES | QUANTIZED_DTYPES:
                raise refuse(f"tensor {key} is {dtype}; F32, F16, BF16 and (with their scales) {', '.join(QUANTIZED_DTYPES)} "
                             f"are read")
            as_stored = (SAFETENSORS_DTYPES | QUANTIZED_DTYPES)[dtype]
            needed = math.prod(shape) * as_stored.itemsize
            if not 0 <= start <= end <= data_size:
                raise refuse(f"tensor {key} lies at data bytes {start:,}..{end:,}, past the data's end ({data_size:,} "
                             f"bytes): a truncated download? fetch it again")
            if end - start != needed:
                raise refuse(f"tensor {key} of shape {shape} needs {needed:,} bytes, its offsets hold {end - start:,}")
            f.seek(8 + header_size + start)  # one tensor in memory at a time, besides the fp32 copies
            raw = torch.frombuffer(bytearray(f.read(needed)), dtype=torch.uint8) if needed else \
                torch.empty(0, dtype=torch.uint8)
            tensor = raw.view(as_stored).reshape(shape)
            tensors[key] = tensor if dtype in QUANTIZED_DTYPES else tensor.float()
    return tensors

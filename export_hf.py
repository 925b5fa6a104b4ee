"""Export a checkpoint as a Hugging Face folder of its family's class (needs `pip install transformers`).
The classes are the families' (FAMILIES in fsdp_gpt/families/; --help lists them, docs/families.md too).

python export_hf.py CHECKPOINT OUT_DIR [--dtype fp32|bf16] [--max_shard_size 5GB] [--whole_folder [SOURCE]]

CHECKPOINT: a full file, any rank's file of a sharded set or its .complete marker, or a folder (its newest complete
checkpoint). OUT_DIR gets config.json and the weights as safetensors (shards of at most
--max_shard_size with their index for large models; an earlier export's weight files there go), which
transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR) loads with model.GPT's logits, and the
run's tokenizer: a Hugging Face tokenizer's files copied (its tokenizer_config.json in a form
transformers 4.51 and 5.x both load, whichever wrote it), a tiktoken encoding or bytes converted
(encoding alike). --dtype fp32 (the default) writes the trained weights exactly;
bf16 halves the folder (for serving and sharing) at bf16's rounding of every weight. A family whose
published folders hold quantized weights (gpt-oss's MXFP4 experts) is written unquantized too, in
that dtype, and the export says so in a line.

--whole_folder writes instead the Hugging Face folder the run started from (its init_from, or SOURCE)
with the trained weights in place of its language model's: every other file as it was (a multimodal
folder's vision tower and processor files, its tokenizer, chat template), so that a Qwen3.5 continued on
text stays the Qwen3_5ForConditionalGeneration it was; the weights in the dtypes the folder held them
in (fp32 with --dtype fp32, bf16 with bf16), config.json's language-model config updated where the run
changed it (RoPE's base or scaling, a window).
"""
import argparse
import json
import os
import re
import sys

import torch

from fsdp_gpt.checkpoint.ckpt_format import read_model
from fsdp_gpt.config import UserError, exit_code
from fsdp_gpt.data.tokenizer import get_tokenizer
from fsdp_gpt.data.tokenizer_export import save_tokenizer
from fsdp_gpt.distributed.float8 import quiet_torchao
from fsdp_gpt.families import FAMILIES
from fsdp_gpt.hf_format import fused_like, hf_config, to_hf
from fsdp_gpt.hf_whole_folder import write_whole_folder
from fsdp_gpt.model import GPTConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WEIGHT_FILES = re.compile(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?")  # what save_pretrained writes


def clear_weights(out_dir: str) -> None:
    """An earlier export's weight files in out_dir go: save_pretrained leaves a shard set beside a
    single file (or the reverse), and transformers and init_from would then each read another model."""
    for name in os.listdir(out_dir) if os.path.isdir(out_dir) else []:
        if WEIGHT_FILES.fullmatch(name):
            os.remove(os.path.join(out_dir, name))


def add_legacy_keys(path: str, keys: dict, dtype: str) -> None:
    """transformers 5 writes RoPE's settings into rope_parameters (per layer type for Gemma 3) and the
    dtype as `dtype`, and drops the keys it reads no more, which transformers 4 reads alone (it would
    run plain RoPE at theta 10,000, Gemma 3's local layers at 10,000): every key of `keys` (hf_config:
    what each supported transformers reads, the experts' count under both versions' names) goes
    beside them, with the same values, so that both load the same model."""
    with open(path) as f:
        config = json.load(f)
    config |= keys | {"torch_dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype]}
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def export(checkpoint: str, out_dir: str, dtype: str | None = None, max_shard_size: str = "5GB",
           whole_folder: str | None = None) -> None:
    """A plain export (dtype None: fp32), or with whole_folder (a path, or "init_from": the run's) the
    source folder with the trained weights in it (dtype None: the source's own)."""
    try:
        with quiet_torchao():  # the models' module imports torchao where it is installed (fp8's extra)
            from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel  # noqa: F401
    except ImportError:
        raise UserError("export_hf.py needs transformers: pip install transformers")
    ckpt, state = read_model(checkpoint)
    cfg = GPTConfig(**ckpt["model_config"])
    tokenizer = get_tokenizer(ckpt["config"]["tokenizer"])
    bos = getattr(tokenizer, "bos_token", None)  # a Hugging Face tokenizer's own (Gemma's <bos>), where it names one
    keys = hf_config(cfg, tokenizer.eot_token, bos)
    if whole_folder:
        source = ckpt["config"].get("init_from") if whole_folder == "init_from" else whole_folder
        if not source:
            raise UserError(f"export_hf.py --whole_folder: {checkpoint}'s run has no init_from: name the source folder "
                            f"(--whole_folder=FOLDER)")
        clear_weights(out_dir)
        wrote = write_whole_folder(to_hf(state, cfg), keys, cfg.family, cfg.tie_embeddings, source, out_dir,
                                   DTYPES.get(dtype))
        print(f"wrote {out_dir}/ ({source}/ as it was, a {wrote}, with the trained {cfg.family.hf_class}'s weights in "
              f"{dtype or 'its dtypes'}) from {checkpoint}, step {ckpt['step']}")
        return
    dtype = dtype or "fp32"
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(keys.pop("model_type"), **keys))
    model.load_state_dict(fused_like(to_hf(state, cfg), model.state_dict()))
    model.to(DTYPES[dtype]).config.torch_dtype = DTYPES[dtype]
    clear_weights(out_dir)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    # a fresh dict: AutoConfig took `keys` and wrote into its rope_scaling
    add_legacy_keys(os.path.join(out_dir, "config.json"), hf_config(cfg, tokenizer.eot_token, bos), dtype)
    save_tokenizer(tokenizer, out_dir, cfg.block_size)
    print(f"wrote {out_dir}/ ({cfg.family.hf_class} in {dtype}, tokenizer files of '{ckpt['config']['tokenizer']}') "
          f"from {checkpoint}, step {ckpt['step']}")
    if cfg.family.hf_quantized:  # gpt-oss's MXFP4 experts: init_from dequantized them, this writes them as trained
        print(f"note: {cfg.family.hf_class}'s published folders hold {cfg.family.hf_quantized}; this export writes "
              f"every weight in {dtype}, unquantized (quantize it again to serve it so)")


def main(argv: list[str]) -> int:
    classes = ", ".join(f"{family.name} as {family.hf_class}" for family in FAMILIES)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=f"The families' classes: {classes}.")
    parser.add_argument("checkpoint",
                        help="a full file, any rank's file of a sharded set or its .complete marker, or a folder")
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="fp32 (exact; the default) or bf16 (half the size); with --whole_folder: the folder's own")
    parser.add_argument("--max_shard_size", default="5GB", help="largest safetensors file (default 5GB)")
    parser.add_argument("--whole_folder", nargs="?", const="init_from", default=None, metavar="SOURCE",
                        help="write the folder the run started from (its init_from, or SOURCE) with the trained "
                             "weights in place of its language model's, every other file as it was")
    args = parser.parse_args(argv)
    export(args.checkpoint, args.out_dir, args.dtype, args.max_shard_size, args.whole_folder)
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(lambda: main(sys.argv[1:])))

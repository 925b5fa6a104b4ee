"""Export a checkpoint as a Hugging Face GPT-2 folder (needs `pip install transformers`).

python export_hf.py CHECKPOINT OUT_DIR

CHECKPOINT: a full file, any rank's file of a sharded set, or a folder (its newest complete
checkpoint). OUT_DIR gets config.json and model.safetensors, which
transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR) loads with the same logits as
model.GPT, plus tokenizer files for tiktoken tokenizers.
"""
import sys

import torch

from config import UserError
from data import get_tokenizer
from fsdp_ckpt import read_model
from model import GPTConfig

# model.GPT uses nn.Linear (out, in); GPT-2's Conv1D stores the transpose (in, out)
CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def hf_state_dict(state: dict, cfg: GPTConfig) -> dict:
    """model.GPT names and layouts -> GPT2LMHeadModel's."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(CONV1D_SUFFIXES):
            tensor = tensor.t()
        hf_name = "lm_head.weight" if name == "lm_head.weight" else "transformer." + name.replace("blocks.", "h.")
        out[hf_name] = tensor.contiguous()
    if not cfg.bias:  # GPT-2 always has biases: zeros compute the same as none
        for name, tensor in list(out.items()):
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight", "c_attn.weight", "c_proj.weight",
                              "c_fc.weight")):
                out[name.removesuffix("weight") + "bias"] = torch.zeros(tensor.shape[-1])  # the output width
    return out


def export(checkpoint: str, out_dir: str) -> None:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise UserError("export_hf.py needs transformers: pip install transformers")
    ckpt, state = read_model(checkpoint)
    cfg = GPTConfig(**ckpt["model_config"])
    tokenizer = get_tokenizer(ckpt["config"]["tokenizer"])
    hf_config = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_inner=4 * cfg.n_embd, activation_function="gelu_new", layer_norm_epsilon=1e-5,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
        bos_token_id=tokenizer.eot_token, eos_token_id=tokenizer.eot_token)
    model = GPT2LMHeadModel(hf_config)
    model.load_state_dict(hf_state_dict(state, cfg))
    model.save_pretrained(out_dir)
    print(f"wrote {out_dir}/ (config.json, model.safetensors) from {checkpoint}, step {ckpt['step']}")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.splitlines()[2], file=sys.stderr)
        return 2
    try:
        export(*argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

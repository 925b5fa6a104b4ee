"""Export a checkpoint as a Hugging Face folder (needs `pip install transformers`): GPT2LMHeadModel
for arch gpt2, LlamaForCausalLM for llama, Qwen3ForCausalLM for llama with qk_norm.

python export_hf.py CHECKPOINT OUT_DIR

CHECKPOINT: a full file, any rank's file of a sharded set, or a folder (its newest complete
checkpoint). OUT_DIR gets config.json and model.safetensors, which
transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR) loads with the same logits as
model.GPT, plus tokenizer files for tiktoken tokenizers.
"""
import re
import sys


from config import UserError, exit_code
from data import get_tokenizer
from ckpt_format import read_model
from hf_format import hf_architecture, hf_config, to_hf
from model import GPTConfig

def oniguruma_pattern(pattern: str) -> str:
    r"""tiktoken's regex for the tokenizers library: Oniguruma reads a possessive `{1,3}+` as a
    repeat (greedy forms split these patterns alike) and `$` as any line's end (`\z`: the text's)."""
    return re.sub(r"([+*?}])\+", r"\1", pattern).replace("$", r"\z")


def save_tokenizer(encoding, out_dir: str) -> bool:
    """A tiktoken BPE encoding as Hugging Face tokenizer files; False for byte tokens (no such files)."""
    if not hasattr(encoding, "_mergeable_ranks"):
        return False
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_to_char = bytes_to_unicode()  # GPT-2's printable stand-in for every byte

    def text(token: bytes) -> str:
        return "".join(byte_to_char[b] for b in token)

    ranks = encoding._mergeable_ranks
    vocab = {text(token): rank for token, rank in ranks.items()} | encoding._special_tokens
    # tiktoken merges the adjacent pair whose union ranks lowest: every split of a token into
    # two tokens is a merge, ordered by the rank of the token it makes
    merges = sorted(((token[:i], token[i:], rank) for token, rank in ranks.items() for i in range(1, len(token))
                     if token[:i] in ranks and token[i:] in ranks), key=lambda m: m[2])
    bpe = Tokenizer(BPE(vocab, [(text(left), text(right)) for left, right, _ in merges], ignore_merges=True))
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(oniguruma_pattern(encoding._pat_str)), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(list(encoding._special_tokens))
    eot = encoding.decode([encoding.eot_token])
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=eot, eos_token=eot).save_pretrained(out_dir)
    return True


def export(checkpoint: str, out_dir: str) -> None:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise UserError("export_hf.py needs transformers: pip install transformers")
    ckpt, state = read_model(checkpoint)
    cfg = GPTConfig(**ckpt["model_config"])
    tokenizer = get_tokenizer(ckpt["config"]["tokenizer"])
    keys = hf_config(cfg, tokenizer.eot_token)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(keys.pop("model_type"), **keys))
    model.load_state_dict(to_hf(state, cfg))
    model.save_pretrained(out_dir)
    files = "config.json, model.safetensors" + (", tokenizer files" if save_tokenizer(tokenizer, out_dir) else "")
    print(f"wrote {out_dir}/ ({hf_architecture(cfg)}: {files}) from {checkpoint}, step {ckpt['step']}")
    if files.endswith("safetensors"):
        print(f"no tokenizer files: '{ckpt['config']['tokenizer']}' has no Hugging Face equivalent")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.splitlines()[2], file=sys.stderr)
        return 2
    export(*argv)
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(lambda: main(sys.argv[1:])))

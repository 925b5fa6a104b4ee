"""The model, where nanoGPT's users look for it:

    from model import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024))
    logits, _ = model(idx)                 # idx (B, T) token ids -> (B, T, vocab) logits
    _, loss = model(idx, targets)          # the mean cross-entropy, no logits tensor made
    model.generate(idx, max_new_tokens=64, top_k=50)

A face, not a copy: the code lives in fsdp_gpt/model.py (plain PyTorch, no distributed code), with
its parts beside it (attention.py, moe.py, loss.py) and the families' layouts in families/
(`GPTConfig(arch="llama", ...)`). train_fsdp.py imports the package itself.
"""
from fsdp_gpt.model import GPT, DecoderBlock, GPTConfig

__all__ = ["GPT", "GPTConfig", "DecoderBlock"]

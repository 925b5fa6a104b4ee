"""Text from a model: a prompt's sampled continuation, decoded (sample.py, and the samples at each eval)."""
import torch


def complete(model, tokenizer, prompt: str, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, seed: int = 0, device: torch.device = torch.device("cpu")) -> str:
    """The prompt and its sampled continuation; an empty prompt starts after a document separator."""
    ids = tokenizer.encode_ordinary(prompt) or [tokenizer.eot_token]
    generator = torch.Generator(device).manual_seed(seed)
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens, temperature, top_k, generator)
    # the vocabulary is padded to a multiple of 64: ids past the tokenizer's have no text
    return tokenizer.decode([i for i in out[0].tolist() if i < tokenizer.n_vocab and i != tokenizer.eot_token])

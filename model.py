"""A GPT-2 style decoder in plain PyTorch: no distributed code lives here.

The layout and names follow GPT-2 (pre-norm blocks, tanh GELU, learned positions,
LM head tied to the token embedding) so a checkpoint maps one to one onto Hugging
Face's GPT2LMHeadModel.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    vocab_size: int = 50304  # GPT-2's 50257 rounded up to a multiple of 64 for fast matmuls
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # SDPA picks flash / memory-efficient kernels on GPU, a fused math kernel on CPU
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # tanh GELU is GPT-2's "gelu_new": keeps exported logits identical
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class DecoderBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.tie_weights()
        # recompute each block's activations in backward instead of storing them
        self.activation_checkpointing = False
        if self.wte.weight.device.type != "meta":
            self.init_weights()

    def tie_weights(self) -> None:
        """One matrix embeds tokens and scores them (GPT-2). Moving a module off the meta device
        (to_empty) makes each module a new parameter, so this is redone after it."""
        self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialisation; residual projections scaled by 1/sqrt(2 * n_layer)."""
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))
            elif p.dim() >= 2:
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif ".ln_" in name or name.startswith("ln_"):
                nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)
            else:
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx, targets: (B, T) token ids. Returns logits (B, T, vocab) and the mean loss."""
        B, T = idx.shape
        assert T <= self.config.block_size, f"sequence of {T} exceeds block_size {self.config.block_size}"
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss

    def num_params(self, exclude_position_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # tied weights counted once
        return n - self.wpe.weight.numel() if exclude_position_embedding else n

    def flops_per_token(self) -> int:
        """Training FLOPs per token: forward + backward = 3x the forward's matmuls.

        Forward: 2 FLOPs per weight of every Linear (LM head included), plus the
        attention products QK^T and AV, 2 * 2 * T * n_embd per layer at full context.
        """
        cfg = self.config
        matmul_weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        attention = 4 * cfg.n_layer * cfg.block_size * cfg.n_embd
        return 3 * (2 * matmul_weights + attention)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Extend idx (B, T) by max_new_tokens sampled tokens."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]
            logits = self(context)[0][:, -1, :]
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, next_id), dim=1)
        return idx

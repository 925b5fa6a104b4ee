"""Multi-head latent attention (MLA: DeepSeek-V2's, V3's, Moonlight's and Kimi K2's), in plain PyTorch:
no distributed code lives here (context parallelism swaps the core, as it does CausalSelfAttention's).

Each token's keys and values come from one small latent: kv_a makes it (kv_lora_rank wide, normed)
together with a key part that RoPE turns, qk_rope_head_dim wide and shared by every head; kv_b makes
each head's key part without positions (qk_nope_head_dim) and its value (v_head_dim) from the latent.
A head's query is the same two parts, through one matrix (q_proj) or a low rank normed between two
(q_a, q_b: q_lora_rank). Scores are q . k over both parts, scaled by 1/sqrt(qk_nope + qk_rope) (times
YaRN's mscale squared where the RoPE is YaRN's); the heads' outputs, v_head_dim each, go through c_proj.

The fused attention kernels (the CPU's flash kernel, CUDA's flash kernel and its variable-length call,
the ring's) take one head size for q, k and v; where v's differs, the narrower side is padded with zeros
to the wider and the output cut back (zeros add nothing to a score, and a zero column of v gives a zero
column of the output), so every core runs: SDPA would otherwise compute a T x T matrix on the CPU.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_gpt.attention import Documents, causal_attention
from fsdp_gpt.rope import ROTATIONS, yarn_mscale

# the latent's and the low-rank q's norms: DeepSeek's classes build them at their default epsilon
# whatever rms_norm_eps says (the block's norms take norm_eps)
LATENT_NORM_EPS = 1e-6


def latent_scale(cfg) -> float:
    """The scores' factor: 1/sqrt(q and k's head width) (attn_scale_dim's where set), times YaRN's
    mscale(factor, mscale_all_dim) squared where the RoPE is YaRN's with an mscale_all_dim (DeepSeek's)."""
    scale = (cfg.attn_scale_dim or cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


def one_head_size(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k and v with zeros padded onto the narrower head size (q and k's, or v's): the fused kernels' one size."""
    extra = q.shape[-1] - v.shape[-1]
    if extra > 0:
        return q, k, F.pad(v, (0, extra))
    return F.pad(q, (0, -extra)), F.pad(k, (0, -extra)), v


class LatentAttention(nn.Module):
    """The attention of a DecoderBlock whose family's is latent (model.ATTENTIONS)."""
    plain_core = staticmethod(causal_attention)  # over whole rows in one process

    def __init__(self, cfg, layer: int):
        super().__init__()
        self.core = self.plain_core  # replaceable from outside, as CausalSelfAttention's
        self.n_head, self.window = cfg.n_head, cfg.window_of(layer)
        self.rotate = ROTATIONS[cfg.rope_interleave]  # as the folder lays out q and k: adjacent pairs, or halves
        self.nope, self.rope, self.v_dim, self.latent = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                                         cfg.kv_lora_rank)
        self.scale = latent_scale(cfg)
        q_width = cfg.n_head * (self.nope + self.rope)
        if cfg.q_lora_rank:  # DeepSeek V3's: q through a normed low rank
            self.q_a = nn.Linear(cfg.n_embd, cfg.q_lora_rank, bias=False)
            self.q_a_norm = nn.RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b = nn.Linear(cfg.q_lora_rank, q_width, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.n_embd, q_width, bias=False)
        self.kv_a = nn.Linear(cfg.n_embd, self.latent + self.rope, bias=False)  # the latent, then k's rotated part
        self.kv_a_norm = nn.RMSNorm(self.latent, eps=LATENT_NORM_EPS)
        self.kv_b = nn.Linear(self.latent, cfg.n_head * (self.nope + self.v_dim), bias=False)  # per head: k's part, v
        self.c_proj = nn.Linear(cfg.n_head * self.v_dim, cfg.n_embd, bias=False)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                idx: torch.Tensor | None = None, docs: Documents | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q_b(self.q_a_norm(self.q_a(x))) if hasattr(self, "q_a") else self.q_proj(x)
        q_pass, q_rot = q.view(B, T, self.n_head, -1).transpose(1, 2).split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a(x).split([self.latent, self.rope], dim=-1)
        kv = self.kv_b(self.kv_a_norm(latent)).view(B, T, self.n_head, -1).transpose(1, 2)
        k_pass, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_rot, k_rot = self.rotate(q_rot, *rope), self.rotate(k_rot.view(B, 1, T, self.rope), *rope)
        # in kv_b's dtype, all three (a norm's output may be fp32 under autocast): the kernels take one dtype
        q = torch.cat((q_pass, q_rot), dim=-1).to(kv.dtype)
        k = torch.cat((k_pass, k_rot.expand(-1, self.n_head, -1, -1)), dim=-1).to(kv.dtype)
        y = self.core(*one_head_size(q, k, v), self.dropout if self.training else 0.0, False, docs, self.window,
                      self.scale)
        y = y[..., :self.v_dim].transpose(1, 2).reshape(B, T, self.n_head * self.v_dim)
        return self.resid_dropout(self.c_proj(y))

"""Rotary position embeddings (RoPE) in plain PyTorch: each layer's cos and sin per position, with
the rotate_half convention, over the whole of each head or its first part (partial_rotary_factor), a
base per kind of layer (rope_theta, the local layers' rope_local_theta) and the long-context scalings
of the rope_scaling key (Llama 3.1's, YaRN), as transformers computes them; q and k turned by their halves
(rotate_half) or, as DeepSeek's folders lay them out, by adjacent pairs (rope_interleave)."""
import math

import torch


def llama3_scaled(inv_freq: torch.Tensor, scaling: dict, theta: float) -> tuple[torch.Tensor, float]:
    """Llama 3.1's long-context frequencies: pairs whose wavelength exceeds the original context /
    low_freq_factor turn `factor` times slower, those under original / high_freq_factor keep their
    speed, and the ones between are interpolated; no attention factor."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    between = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(between, (1 - smooth) * scaled / factor + smooth * scaled, scaled), 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's temperature for a context `factor` times the original: 0.1 mscale ln(factor) + 1 (1 unscaled);
    latent attention's scores take it squared (latent_attention.latent_scale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_scaled(inv_freq: torch.Tensor, scaling: dict, theta: float) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): pairs that turn fewer than beta_slow times over the original context are
    interpolated (`factor` times slower), those that turn more than beta_fast times keep their speed, a
    linear ramp between; cos and sin are scaled by the attention factor (0.1 ln(factor) + 1 unless
    config.json gives it, or DeepSeek's ratio of two mscales)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    dim = 2 * inv_freq.numel()
    attention = scaling.get("attention_factor")
    if attention is None:
        both = scaling.get("mscale") and scaling.get("mscale_all_dim")
        attention = (yarn_mscale(factor, scaling["mscale"]) / yarn_mscale(factor, scaling["mscale_all_dim"]) if both
                     else yarn_mscale(factor))

    def turning(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = turning(scaling.get("beta_fast") or 32), turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, device=inv_freq.device, dtype=torch.float32) - low) / (high - low or 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), attention


# the rope_scaling key's types (family_parts.ROPE_SCALINGS their numbers): (inv_freq, scaling, theta) -> (the
# scaled inv_freq, the factor cos and sin take)
SCALINGS = {"llama3": llama3_scaled, "yarn": yarn_scaled}


def rotary(cfg, positions: torch.Tensor, theta: float, scaling: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, rotary_dim) of RoPE at positions (T,): pair i of a head's rotated dimensions turns at
    theta^(-2i/rotary_dim) per position (rope_scaling's type applied when given). Computed in fp32 per
    forward (cheap): no buffer to move off the meta device."""
    dim = cfg.rotary_dim  # head_dim, its first part (partial_rotary_factor), or latent attention's qk_rope_head_dim
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)
    attention = 1.0
    if scaling:
        inv_freq, attention = SCALINGS[scaling.get("rope_type", scaling.get("type"))](inv_freq, scaling, theta)
    angles = torch.outer(positions.float(), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)  # rotate_half pairs dimension i with i + rotary_dim/2
    if attention == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * attention, angles.sin() * attention


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, head_dim) rotated over its first rotary_dim dimensions (cos's width: the whole head
    but with partial_rotary_factor): x cos + rotate_half(x) sin; the others pass as they are."""
    dim = cos.shape[-1]
    part = x[..., :dim]  # x itself where the whole head rotates
    x1, x2 = part.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    out = (part.float() * cos + rotated.float() * sin).to(x.dtype)
    return torch.cat((out, x[..., dim:]), dim=-1) if dim < x.shape[-1] else out


def apply_rotary_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, d) rotated by adjacent pairs (x0, x1), (x2, x3), ... (DeepSeek's layout, its
    rope_interleave): pair i turns at cos's frequency i, out in halves (the turned first of each pair,
    then the second: how transformers' DeepSeek V3 lays them out; q's and k's alike, so the scores are
    the pairs' whatever order). The whole of x turns (latent attention's rotated part)."""
    cos, sin = cos[..., :cos.shape[-1] // 2], sin[..., :sin.shape[-1] // 2]
    first, second = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(x.dtype)


# how a latent attention's q and k turn (the rope_interleave key): adjacent pairs, or halves
ROTATIONS = {True: apply_rotary_pairs, False: apply_rotary}


def rotaries(cfg, positions: torch.Tensor) -> tuple:
    """(the global layers' cos and sin, the local layers'): rope_theta's with rope_scaling, and where
    rope_local_theta is set the local (sliding-window) layers' own base, unscaled (Gemma 3's, OLMo 3's)."""
    both = rotary(cfg, positions, cfg.rope_theta, cfg.rope_scaling)
    return both, rotary(cfg, positions, cfg.rope_local_theta, None) if cfg.rope_local_theta else both

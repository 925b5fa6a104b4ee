"""Attention kernels that return each row's log-sum-exp, and backwards that take a row's merged output
and log-sum-exp: what ring attention merges its blocks by, and what a row's attention sink (gpt-oss)
is applied on. No distributed code lives here.

Kernels (KERNELS, lse_kernels): the CPU's fused flash kernel (fp32, bf16; a mask too) and CUDA's flash
kernel (bf16, fp16 from sm80; no mask); elsewhere, attention written out in fp32 matmuls (the whole
scores matrix of a call: for CUDA in fp32 or before sm80, and a mask on CUDA). Each takes grouped
key/value heads.

A sink is a learned logit per head that joins every row's softmax denominator beside the row's keys,
as if one more key no value came with. Given a row's output O and log-sum-exp L over its keys, the
row with the sink is O * sigmoid(L - s), its log-sum-exp logaddexp(L, s) (sink_merged): the kernel
needs no sink of its own, and where pieces of a row merge by their log-sum-exps (the ring) the sink
joins once, after them. Backward is the kernel's own given that output and log-sum-exp (P = exp(S -
L'), D = rowsum(dO O): the sink's share leaves D as it is), and the sink's gradient is
-sum over rows of exp(s - L') rowsum(dO O) (sink_gradient).
"""
import torch

aten = torch.ops.aten


def _at_q_heads(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """k or v (B, kv heads, L, D) at q's head count, each kv head serving its group of query heads: the
    CPU kernel's backward on torch 2.8 reads k and v at q's heads (a grouped call crashed the process)."""
    return kv.repeat_interleave(q.shape[1] // kv.shape[1], dim=1) if kv.shape[1] != q.shape[1] else kv


def _cpu_forward(q, k, v, causal: bool, scale: float | None, mask: torch.Tensor | None = None):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, _at_q_heads(q, k), _at_q_heads(q, v), 0.0, causal,
                                                                 attn_mask=_additive(mask, q), scale=scale)
    return out, lse, ()


def _cpu_backward(dout, q, k, v, out, lse, aux, causal: bool, scale: float | None, mask: torch.Tensor | None = None):
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, _at_q_heads(q, k), _at_q_heads(q, v), out, lse, 0.0, causal, attn_mask=_additive(mask, q), scale=scale)
    # a group's query heads' gradients summed into their kv head's
    return dq, dk.unflatten(1, (k.shape[1], -1)).sum(2), dv.unflatten(1, (v.shape[1], -1)).sum(2)


def _additive(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """A boolean mask (True: attends) as the CPU kernel takes one: 0 or -inf in q's dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))


def _cuda_forward(q, k, v, causal: bool, scale: float | None, mask: None = None):
    out, lse, *aux = aten._scaled_dot_product_flash_attention(q.contiguous(), k.contiguous(), v.contiguous(), 0.0,
                                                              causal, False, scale=scale)
    return out, lse, tuple(aux[:6])  # cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset: for backward


def _cuda_backward(dout, q, k, v, out, lse, aux, causal: bool, scale: float | None, mask: None = None):
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    return aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(),
        cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)[:3]


def masked_forward(q, k, v, mask, scale: float):
    """Attention of q (B, H, Lq, D) over k, v (B, H, Lk, D) where mask (B or 1, 1, Lq, Lk) holds, in
    fp32 whatever autocast says: the output and its log-sum-exp (-inf, and an output of zeros, where
    a query has no key)."""
    with torch.autocast(q.device.type, enabled=False):
        scores = (q.float() @ k.float().transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        lse = scores.logsumexp(-1)
        probs = (scores - lse.nan_to_num(neginf=0.0).unsqueeze(-1)).exp()  # masked: exp(-inf) = 0
        return probs @ v.float(), lse


def masked_backward(dout, q, k, v, out, lse, mask, scale: float):
    """dq, dk, dv (fp32) of masked_forward's attention, given the final output and log-sum-exp of
    every query (merged over all its keys): each tile's exact share."""
    with torch.autocast(q.device.type, enabled=False):
        scores = (q.float() @ k.float().transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        probs = (scores - lse.unsqueeze(-1)).exp()
        dout = dout.float()
        dprobs = dout @ v.float().transpose(-1, -2)
        dscores = probs * (dprobs - (dout * out.float()).sum(-1, keepdim=True)) * scale
        return dscores @ k.float(), dscores.transpose(-1, -2) @ q.float(), probs.transpose(-1, -2) @ dout


def _written_mask(q, k, causal: bool, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is not None:
        return mask
    return torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(k.shape[-2] - q.shape[-2]) \
        if causal else torch.ones(1, 1, 1, 1, dtype=torch.bool, device=q.device)


def _written_forward(q, k, v, causal: bool, scale: float | None, mask: torch.Tensor | None = None):
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    out, lse = masked_forward(q, k, v, _written_mask(q, k, causal, mask), q.shape[-1] ** -0.5 if scale is None else scale)
    return out.to(q.dtype), lse, ()


def _written_backward(dout, q, k, v, out, lse, aux, causal: bool, scale: float | None, mask: torch.Tensor | None = None):
    groups = q.shape[1] // k.shape[1]
    k_, v_ = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    dq, dk, dv = masked_backward(dout, q, k_, v_, out, lse, _written_mask(q, k, causal, mask),
                                 q.shape[-1] ** -0.5 if scale is None else scale)
    dk, dv = (t.unflatten(1, (-1, groups)).sum(2) for t in (dk, dv))  # back onto each key/value head
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


KERNELS = {"cpu": (_cpu_forward, _cpu_backward), "cuda": (_cuda_forward, _cuda_backward)}
WRITTEN_OUT = (_written_forward, _written_backward)


def fused_lse_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a fused kernel of KERNELS runs here: the CPU's in fp32 or bf16, CUDA's flash in bf16 or
    fp16 from sm80 (A100) on."""
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(device) >= (8, 0))


def lse_kernels(q: torch.Tensor, masked: bool = False) -> tuple:
    """(forward, backward) for q: a fused kernel where one runs (CUDA's takes no mask), else written out."""
    if fused_lse_runs(q.device, q.dtype) and not (masked and q.device.type == "cuda"):
        return KERNELS[q.device.type]
    return WRITTEN_OUT


def sink_merged(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, H, T, D) and lse (B, H, T, fp32) over a row's keys -> with each head's sink (H,) in every
    row's denominator: out * sigmoid(lse - sink) (in out's dtype) and logaddexp(lse, sink)."""
    sink = sinks.detach().float().view(-1, 1)
    return (out.float() * torch.sigmoid(lse - sink).unsqueeze(-1)).to(out.dtype), torch.logaddexp(lse, sink)


def sink_gradient(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The sinks' gradient (H,) from rows whose output with the sink is `out`, merged log-sum-exp `lse`."""
    rowsum = (dout.float() * out.float()).sum(-1)
    return -(torch.exp(sinks.detach().float().view(-1, 1) - lse) * rowsum).sum((0, 2)).to(sinks.dtype)


class SinkAttention(torch.autograd.Function):
    """Attention of q (B, heads, Lq, D) over k, v (B, kv heads, Lk, D) where each row's softmax has its
    head's sink in the denominator: causal (a query's keys up to its own position) or where the mask
    (broadcasting to (B, 1, Lq, Lk), True: attends) holds; scale: the scores' factor (None: 1/sqrt(D))."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, causal: bool, mask: torch.Tensor | None, scale: float | None):
        run, ctx.run_backward = lse_kernels(q, mask is not None)
        out, lse, aux = run(q, k, v, causal, scale, mask)
        out, lse = sink_merged(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks, *([] if mask is None else [mask]))
        ctx.causal, ctx.scale, ctx.aux = causal, scale, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks, *mask = ctx.saved_tensors
        grads = ctx.run_backward(dout, q, k, v, out, lse, ctx.aux, ctx.causal, ctx.scale, *mask)
        return *grads, sink_gradient(dout, out, lse, sinks), None, None, None

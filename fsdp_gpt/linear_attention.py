"""Gated DeltaNet (Yang, Kautz, Hatamizadeh, arXiv:2412.06464), the linear attention of Qwen3-Next and
Qwen3.5, as a token mixer beside attention (model.py's attn_pattern): plain PyTorch, no distributed
code. Context parallelism swaps its core from outside (distributed/linear_context.py).

A layer: x -> in_proj_qkv -> a depthwise causal convolution over the row (conv1d, kernel
linear_conv, no bias) and SiLU -> q and k (linear_key_heads of linear_key_dim, L2-normalised, q also
scaled by 1/sqrt(linear_key_dim)), v (linear_value_heads of linear_value_dim; each key head serves
value_heads / key_heads consecutive value heads) -> the gated delta rule -> each value head's output
normalised and gated (norm(o) * silu(in_proj_z(x))) -> out_proj. Per value head and token t, with
the state S (key_dim x value_dim), the decay g_t = -exp(A_log) softplus(in_proj_a(x)_t + dt_bias)
and the write strength beta_t = sigmoid(in_proj_b(x)_t):

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t

The parameters are named as transformers' Qwen3_5GatedDeltaNet names them (its `linear_attn.` is
our `attn.`): in_proj_qkv (rows q | k | v), in_proj_z, in_proj_b, in_proj_a, conv1d.weight
(channels, 1, kernel) over in_proj_qkv's rows, dt_bias, A_log, norm.weight (value_dim: one norm
shared by the heads) and out_proj, each as its tensor is.

Training computes the rule by chunks of linear_chunk tokens (the WY form of the DeltaNet paper): within
a chunk, every token's pseudo-value u_t (what it writes, the part of v_t the state does not already
predict) comes from one unit-triangular solve, the chunk's outputs from two matmuls; the state steps
once a chunk. Memory and work are linear in the row; a row not a multiple of the chunk is padded at
its end with tokens that neither decay nor write (g = 0, beta = 0), which change no real output and
leave the final state as it was. The rule runs in fp32 whatever autocast says (its cumulative decays
and the solve), as transformers' torch reference does.
"""
import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_gpt.attention import Documents


def in_fp32(device: torch.device):
    """A region where autocast is off (the meta device, where models are counted, has no autocast)."""
    return torch.autocast(device.type, enabled=False) if device.type in ("cpu", "cuda") else contextlib.nullcontext()


def l2_normed(x: torch.Tensor) -> torch.Tensor:
    """x / |x| over its last dimension in fp32, as transformers' (and flash-linear-attention's) l2norm."""
    x = x.float()
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head's output, then times silu(gate): Qwen3.5's RMSNormGated (a plain weight,
    starting at ones), normalised in fp32 and rounded to the input's dtype before the weight."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(width))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


def uniform_taps(p: torch.Tensor) -> None:
    """As torch (and flash-linear-attention's layers) start a convolution: uniform within 1/sqrt(kernel),
    taps of order one (at init_std, q, k and v would start fifty times smaller)."""
    nn.init.uniform_(p, -p.shape[-1] ** -0.5, p.shape[-1] ** -0.5)


# how a linear layer's parameters start where not as GPT.init_weights starts matrices (normal, init_std)
STARTS = {"conv1d.weight": uniform_taps,
          # decay rates exp(A_log) spread over 0.01 .. 16, as transformers starts Qwen3.5's: with a at 0, a
          # head's memory lasts from under a token to about 80
          "A_log": lambda p: p.copy_(torch.empty_like(p).uniform_(0.01, 16).log()),
          "dt_bias": nn.init.ones_}  # Qwen3.5's: a step softplus(a + 1), 1.3 where a is 0


def linear_start(name: str):
    """How a model's parameter of this name starts, if it is one of a linear layer's STARTS; else None."""
    return next((start for suffix, start in STARTS.items() if name.endswith(f"attn.{suffix}")), None)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       chunk: int, state: torch.Tensor | None = None,
                       final: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over rows: q, k (N, T, key heads, dk) L2-normalised, v (N, T, heads, dv),
    g and beta (N, T, heads), in fp32. state: the state before each row (N, heads, dk, W), None: zeros.
    W may exceed dv: its first W - dv columns are probes, columns whose values are zero (context
    parallelism starts them at the identity to learn how a row's piece carries the state before it).
    -> the outputs (N, T, heads, W) and, where `final`, the state after each row (N, heads, dk, W)."""
    N, T, heads, dv = v.shape
    dk, group = q.shape[-1], heads // q.shape[2]
    with in_fp32(q.device):
        # (N, heads, chunks, C, ...): each key head's q and k for its value heads, the rows cut into chunks
        pad = -T % chunk

        def chunked(t: torch.Tensor, repeat: int = 1) -> torch.Tensor:  # (N, T, heads, d) -> (N, heads, chunks, C, d)
            t = t.float().repeat_interleave(repeat, dim=2) if repeat > 1 else t.float()
            return F.pad(t.transpose(1, 2), (0, 0, 0, pad)).unflatten(2, (-1, chunk))
        q, k = chunked(q * dk ** -0.5, group), chunked(k, group)
        v, g, beta = chunked(v), chunked(g.unsqueeze(-1)).squeeze(-1), chunked(beta.unsqueeze(-1))
        decay = g.cumsum(-1)  # the log decay from the chunk's start to each token, itself included
        # exp(decay_i - decay_j): the decay between token j and token i of a chunk, where j <= i
        causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
        between = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
        k_beta = k * beta
        # the pseudo-values u = (I + L)^-1 (beta v - beta exp(decay) k S), L the strictly lower beta_i
        # exp(decay_i - decay_j) k_i . k_j: unit-triangular, so solved exactly, no inverse formed
        lower = (k_beta @ k.mT) * between
        u_written = torch.linalg.solve_triangular(lower, v * beta, upper=False, unitriangular=True)
        u_read = torch.linalg.solve_triangular(lower, k_beta * decay.exp().unsqueeze(-1), upper=False,
                                               unitriangular=True)  # times S: what the state predicts
        scores = (q @ k.mT) * between  # token i's read of token j's write, within the chunk
        q_decayed = q * decay.exp().unsqueeze(-1)  # a token's read of the state the chunk starts from
        k_decayed = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)  # a write, decayed to the chunk's end
        chunk_decay = decay[..., -1].exp()[..., None, None]
        width = dv if state is None else state.shape[-1]
        if width > dv:  # the probes' columns: zero values
            u_written = F.pad(u_written, (width - dv, 0))
        S = None if state is None else state.float()
        outputs = []
        # each chunk's slices taken once (unbind): indexing a chunk in the loop would make backward add a
        # whole tensor of zeros per chunk, work quadratic in the row
        per_chunk = [t.unbind(2) for t in (u_written, u_read, scores, q_decayed, k_decayed, chunk_decay)]
        chunks = q.shape[2]
        for i, (written_u, read_u, score, q_i, k_i, decay_i) in enumerate(zip(*per_chunk)):
            if S is None:  # a zero state: nothing to read or to subtract
                u = written_u
                outputs.append(score @ u)
            else:
                u = written_u - read_u @ S
                outputs.append(q_i @ S + score @ u)
            if final or i < chunks - 1:  # the last chunk's state only where it is wanted
                written = k_i.mT @ u
                S = written if S is None else decay_i * S + written
        out = torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :T].transpose(1, 2)
    return out, (S if final else None)


def delta_rule_rows(layer: "GatedDeltaNet", qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    docs: Documents | None = None) -> torch.Tensor:
    """The layer's core over whole rows: the convolution and the rule, each row a sequence from a zero
    state, or each of its documents one (docs): -> (B, T, value heads, value_dim) in qkv's dtype."""
    if docs is not None:
        return delta_rule_documents(layer, qkv, g, beta, docs)
    out, _ = chunked_delta_rule(*layer.heads(layer.convolved(qkv)), g, beta, layer.chunk)
    return out.to(qkv.dtype)


@torch.compiler.disable  # host-side bookkeeping of the documents (made once a forward): eager in compiled blocks
def delta_rule_documents(layer: "GatedDeltaNet", qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         docs: Documents) -> torch.Tensor:
    """doc_mask: each document computed as a sequence of its own, its convolution and state starting at
    zero. The documents of all rows are gathered into groups of like length (Documents.buckets, as
    attention's are), right-padded with copies of their last token, which no real token reads."""
    buckets = docs.buckets(qkv.device)
    flat = [t.flatten(0, 1) for t in (qkv, g, beta)]  # (B * T, ...)
    results = [chunked_delta_rule(*layer.heads(layer.convolved(flat[0][gather])), flat[1][gather], flat[2][gather],
                                  layer.chunk)[0].flatten(0, 1) for gather in buckets.gathers]
    return buckets.regroup(results, qkv.shape[0]).transpose(1, 2).to(qkv.dtype)


class GatedDeltaNet(nn.Module):
    """The token mixer of a linear layer (attn_pattern's `linear`), where attention sits in a full one."""
    plain_core = staticmethod(delta_rule_rows)  # over whole rows in one process

    def __init__(self, cfg, layer: int):
        super().__init__()
        # replaceable from outside (context parallelism runs the rule over a whole row split across ranks)
        self.core = self.plain_core
        self.key_heads, self.value_heads = cfg.linear_key_heads, cfg.linear_value_heads
        self.key_dim, self.value_dim, self.chunk = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_chunk
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.widths = [keys, keys, values]  # in_proj_qkv's rows: q, k, v
        self.in_proj_qkv = nn.Linear(cfg.n_embd, sum(self.widths), bias=False)
        self.in_proj_z = nn.Linear(cfg.n_embd, values, bias=False)  # the output gate
        self.in_proj_b = nn.Linear(cfg.n_embd, self.value_heads, bias=False)  # beta, a head's write strength
        self.in_proj_a = nn.Linear(cfg.n_embd, self.value_heads, bias=False)  # a head's decay, with dt_bias
        self.conv1d = nn.Conv1d(sum(self.widths), sum(self.widths), cfg.linear_conv, groups=sum(self.widths),
                                bias=False)
        # each head's decay rate exp(A_log), and the bias of its step softplus(a + dt_bias) (GPT.init_weights)
        self.A_log, self.dt_bias = nn.Parameter(torch.empty(self.value_heads)), nn.Parameter(torch.empty(self.value_heads))
        self.norm = GatedRMSNorm(self.value_dim, cfg.norm_eps)
        self.out_proj = nn.Linear(values, cfg.n_embd, bias=False)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope=None, idx=None, docs: Documents | None = None) -> torch.Tensor:
        """x (B, T, n_embd) -> (B, T, n_embd). rope and idx (attention's positions and value embeddings)
        are not its: it knows order from the recurrence alone."""
        B, T, _ = x.shape
        qkv = self.in_proj_qkv(x)
        beta = self.in_proj_b(x).float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        out = self.core(self, qkv, g, beta, docs)  # (B, T, value heads, value_dim) in qkv's dtype
        out = self.norm(out, self.in_proj_z(x).view(B, T, self.value_heads, self.value_dim))
        return self.resid_dropout(self.out_proj(out.flatten(2)))

    def flops_per_row(self, T: int) -> int:
        """Training FLOPs of the rule and the convolution on a row of T tokens, as FlopCounterMode counts
        them (the projections are nn.Linear's, which GPT.flops_per_token counts): per value head and chunk
        of C, forward k_beta k^T, q k^T (2 C^2 dk each) and scores u (2 C^2 dv); the state's read, the
        subtraction and the write (2 C dk dv each) in every chunk but where the state is zero (the first)
        or unused (the last's write: no final state is wanted); backward twice each, and the gradients of
        the two triangular systems (a matmul of 2 C^2 (dk + dv)); the solves themselves are no matmul the
        counter sees. The convolution: 2 x kernel FLOPs a channel and token, three times (the counter
        takes a grouped convolution's backward for a dense one's: tests/test_linear_attention.py)."""
        C, dk, dv = self.chunk, self.key_dim, self.value_dim
        chunks = -(-T // C)
        forward = chunks * 2 * C * C * (2 * dk + dv) + (chunks - 1) * 3 * 2 * C * dk * dv
        rule = self.value_heads * (3 * forward + chunks * 2 * C * C * (dk + dv))
        return rule + 3 * 2 * self.conv1d.weight.numel() * T

    def convolved(self, qkv: torch.Tensor, before: torch.Tensor | None = None) -> torch.Tensor:
        """SiLU of the depthwise causal convolution: qkv (N, T, channels) -> like it. before (N, kernel - 1,
        channels): the inputs just before the rows (None: zeros, the rows start a sequence)."""
        x = qkv.transpose(1, 2)
        x = F.pad(x, (self.conv1d.kernel_size[0] - 1, 0)) if before is None else torch.cat([before.transpose(1, 2), x], -1)
        return F.silu(F.conv1d(x, self.conv1d.weight, groups=x.shape[1])).transpose(1, 2)

    def heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output (N, T, channels) -> q, k (N, T, key heads, key_dim) L2-normalised and
        v (N, T, value heads, value_dim), in fp32."""
        q, k, v = mixed.split(self.widths, dim=-1)
        q, k = (l2_normed(t.unflatten(-1, (self.key_heads, self.key_dim))) for t in (q, k))
        return q, k, v.unflatten(-1, (self.value_heads, self.value_dim)).float()

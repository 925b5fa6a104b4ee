"""A decoder in plain PyTorch: no distributed code lives here.

One block and one model build every family (families/): the entry names the attention (multi-head,
or DeepSeek's latent one: latent_attention.py), the norm, the positions (learned, as GPT-2's, or
rotary: rope.py), the MLP
(tanh GELU, SwiGLU or GeGLU by default), the tying, the initialisation, and a block's structure
where a family differs from most: which linears have biases, where the norms sit around each
sublayer, q and k normalised per head or over the whole projection, which layers rotate q and k,
scaled embeddings (Gemma 3); each is read in one place below. The
options are in GPTConfig, grouped-query attention, sliding windows, mixtures of experts, linear
layers (Gated DeltaNet in place of attention, linear_attention.py: attn_pattern) and the speedrun
recipe's among them (a ReLU^2 MLP, logit soft-capping, zero-initialised projections, value
embeddings).
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fsdp_gpt.attention import Documents, causal_attention, sdpa_takes_gqa
from fsdp_gpt.compat import autocast_dtype
from fsdp_gpt.linear_attention import GatedDeltaNet, GatedRMSNorm, linear_start
from fsdp_gpt.latent_attention import LatentAttention
from fsdp_gpt.loss import chunked_cross_entropy, head_loss_chunk, per_position_cross_entropy
from fsdp_gpt.model_keys import MLPS, ModelKeys
from fsdp_gpt.moe import MoE
from fsdp_gpt.rope import apply_rotary, rotaries


@dataclass
class GPTConfig(ModelKeys):
    """The model's keys (model_keys.py: their types, defaults and meanings), every null default
    settled by the family as the model is described (ModelKeys.settled)."""

    def __post_init__(self):
        for name, value in self.settled().items():
            setattr(self, name, value)

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head RoPE rotates, the first ones: partial_rotary_factor of head_dim, as
        transformers rounds it (down), or latent attention's qk_rope_head_dim (head_widths)."""
        return self.head_widths[2]

    @property
    def qkv_widths(self) -> list[int]:
        """The rows of q, k and v in attention's one matmul: n_head query heads (each with its output gate's
        rows after it, in a family whose attention is gated), n_kv_head key and value heads."""
        return [self.n_head * self.head_dim * (2 if self.family.attn_gate else 1)] + [self.n_kv_head * self.head_dim] * 2

    @property
    def head_widths(self) -> tuple[int, int, int]:
        """A head's (q and k's width, v's, the part RoPE turns), as the family's attention lays it out."""
        return HEAD_WIDTHS[self.family.attention](self)


class OffsetRMSNorm(nn.Module):
    """RMSNorm whose scale is 1 + weight, computed in fp32 and rounded to the input's dtype after
    the scale (Gemma's): its weight starts at zero."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.zeros(width))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


# the family's norm, at a width (the model's, or a head's for qk_norm); each initialises itself
# (reset_parameters: LayerNorm and RMSNorm to a scale of ones, the offset form's weight to zeros)
NORMS = {"layernorm": lambda cfg, width: nn.LayerNorm(width, eps=cfg.norm_eps, bias=cfg.bias),
         "rmsnorm": lambda cfg, width: nn.RMSNorm(width, eps=cfg.norm_eps),
         "rmsnorm_offset": lambda cfg, width: OffsetRMSNorm(width, cfg.norm_eps)}
NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, OffsetRMSNorm, GatedRMSNorm)  # what NORMS builds, and a linear layer's


def norm(cfg: GPTConfig, width: int) -> nn.Module:
    return NORMS[cfg.family.norm](cfg, width)


# where a block's norms sit around each sublayer (the family's `norms`): (before it, on its output before the
# residual add): GPT-2's and Llama's before, OLMo 2's after, Gemma 3's both (four norms a block)
NORM_PLACES = {"before": (True, False), "after": (False, True), "both": (True, True)}
# what one qk norm spans (the family's `qk_norm_scope`): (q's width, k's), each head's (Qwen3, Gemma 3) or the
# whole projection's, every head at once (OLMo 2)
QK_NORM_WIDTHS = {"head": lambda cfg: (cfg.head_dim, cfg.head_dim),
                  "projection": lambda cfg: (cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim)}


def has_bias(cfg: GPTConfig, linear: str) -> bool:
    """Whether a block's linear (attn.c_attn, ..., families.ALL_BIASES) has a bias: the bias key on, and the
    family's entry listing it (GPT-2 all of them, Qwen2 q, k and v's, Llama none)."""
    return cfg.bias and linear in cfg.family.biases


# how a token's position reaches the model: (x, ropes) from the token embeddings x at `positions`,
# ropes indexed by whether a block is local
POSITIONS = {"learned": lambda model, x, positions: (x + model.wpe(positions), None),  # GPT-2's
             "rope": lambda model, x, positions: (x, rotaries(model.config, positions))}  # q and k rotated in attention


class CausalSelfAttention(nn.Module):
    plain_core = staticmethod(causal_attention)  # over whole rows in one process

    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        # replaceable from outside (context parallelism runs the core over a whole row split across ranks)
        self.core = self.plain_core
        self.n_head, self.n_kv_head, self.head_dim, self.qkv_widths = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.qkv_widths
        self.window = cfg.window_of(layer)  # None: full causal attention
        self.gated = cfg.family.attn_gate  # the output times a sigmoid gate of its own rows of c_attn (Qwen3.5's)
        self.scale = cfg.attn_scale_dim ** -0.5 if cfg.attn_scale_dim else None  # None: 1/sqrt(head_dim)
        # q, k, v in one matmul
        self.c_attn = nn.Linear(cfg.n_embd, sum(cfg.qkv_widths), bias=has_bias(cfg, "attn.c_attn"))
        self.c_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=has_bias(cfg, "attn.c_proj"))
        self.qk_norm_scope = cfg.family.qk_norm_scope if cfg.qk_norm else None  # None: q and k as they are
        if cfg.qk_norm:  # Qwen3, Gemma 3, OLMo 2: q and k normalised, before the rotation
            self.ln_q, self.ln_k = (norm(cfg, width) for width in QK_NORM_WIDTHS[self.qk_norm_scope](cfg))
        # gpt-oss: a learned logit per head in every row's softmax denominator (attention_kernels.py)
        self.sinks = nn.Parameter(torch.empty(cfg.n_head)) if cfg.family.sinks else None
        if layer < cfg.value_embeds:  # modded-nanogpt's value embeddings: v mixed with a token embedding
            self.value_embed = nn.Embedding(cfg.vocab_size, cfg.n_kv_head * cfg.head_dim)
            self.value_mix = nn.Parameter(torch.empty(2))  # the weights of v and of the embedding
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                idx: torch.Tensor | None = None, docs: Documents | None = None) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.c_attn(x)
        q, k, v = qkv.split(self.qkv_widths, dim=2)
        if self.gated:  # each head's query rows, then its gate's (Qwen3.5's q_proj)
            q, gate = (t.reshape(B, T, -1) for t in q.view(B, T, self.n_head, 2 * self.head_dim).chunk(2, dim=-1))
        if hasattr(self, "value_embed"):
            v = self.value_mix[0] * v + self.value_mix[1] * self.value_embed(idx)
        q, k = self.qk_normed(q, k, "projection")  # OLMo 2's: the whole of each, before the heads split
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k, v = (t.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2) for t in (k, v))
        q, k = self.qk_normed(q, k, "head")  # Qwen3's and Gemma 3's: each head's
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        # in c_attn's dtype, all three: under autocast the value embedding (no autocast op) and, on CUDA, the qk
        # norms (fp32 ops there) come out in fp32, and flash's varlen call and the GQA test take one dtype
        q, k, v = (t.to(qkv.dtype) for t in (q, k, v))
        grouped = self.n_kv_head != self.n_head
        if grouped and not sdpa_takes_gqa(q):  # a key/value head per query head: memory-efficient kernels run
            k, v = (t.repeat_interleave(self.n_head // self.n_kv_head, dim=1) for t in (k, v))
            grouped = False
        y = self.core(q, k, v, self.dropout if self.training else 0.0, grouped, docs, self.window, self.scale, self.sinks)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim)
        if self.gated:
            y = y * torch.sigmoid(gate)
        return self.resid_dropout(self.c_proj(y))

    def qk_normed(self, q: torch.Tensor, k: torch.Tensor, scope: str) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k normalised where `scope` is the family's qk_norm_scope, else as they are."""
        return (self.ln_q(q), self.ln_k(k)) if self.qk_norm_scope == scope else (q, k)


# the attention of a block, by the family's `attention`: multi-head (grouped-query) or multi-head latent (DeepSeek's)
ATTENTIONS = {"mha": CausalSelfAttention, "latent": LatentAttention}
# a head's widths by the family's attention: (q and k's, v's, the part RoPE turns)
HEAD_WIDTHS = {"mha": lambda cfg: (cfg.head_dim, cfg.head_dim, int(cfg.head_dim * cfg.partial_rotary_factor)),
               "latent": lambda cfg: (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim)}


def swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def geglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # gpt-oss's: the sigmoid's gain, and the clamp of gate (above) and up


def clamped_swiglu(x: torch.Tensor) -> torch.Tensor:
    """gpt-oss's: (up + 1) * gate * sigmoid(1.702 gate), gate clamped at 7 from above, up to [-7, 7]
    (transformers' GptOssExperts, in its order of operations)."""
    gate, up = x.chunk(2, dim=-1)
    gate, up = gate.clamp(max=SWIGLU_LIMIT), up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))


# the MLP's nonlinearity, applied to c_fc's output (a gated one's, model_keys.MLPS, holds the gate then
# the up projection: twice ffn_hidden wide)
ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x, approximate="tanh"),  # tanh GELU is GPT-2's "gelu_new": exports alike
    "swiglu": swiglu,
    "geglu": geglu,  # Gemma's: tanh GELU of the gate
    "clamped_swiglu": clamped_swiglu,  # gpt-oss's experts'
    "relu2": lambda x: F.relu(x).square(),  # modded-nanogpt's, from Primer (arXiv:2109.08668)
}


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, hidden: int | None = None):
        super().__init__()
        self.activation = ACTIVATIONS[cfg.mlp]
        hidden = hidden or cfg.ffn_hidden
        self.c_fc = nn.Linear(cfg.n_embd, (2 if MLPS[cfg.mlp] else 1) * hidden, bias=has_bias(cfg, "mlp.c_fc"))
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=has_bias(cfg, "mlp.c_proj"))
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.activation(self.c_fc(x))))


# the projections onto the residual stream, which init_weights scales by 1/sqrt(2 n_layer) (zero_init_proj: zero)
RESIDUAL_PROJECTIONS = ("c_proj.weight", "experts.c_proj", "attn.out_proj.weight")
# a block's token mixer, as attn_pattern names it: attention, or Gated DeltaNet's linear attention
MIXERS = {"full": lambda cfg, layer: ATTENTIONS[cfg.family.attention](cfg, layer), "linear": GatedDeltaNet}


class DecoderBlock(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int = 0):
        super().__init__()
        before, after = NORM_PLACES[cfg.family.norms]  # where its norms sit; nn.Identity where none does

        def block_norm(here: bool) -> nn.Module:
            return norm(cfg, cfg.n_embd) if here else nn.Identity()
        self.ln_1 = block_norm(before)
        self.attn = MIXERS[cfg.mixer_of(layer)](cfg, layer)  # attention, or a linear layer (attn_pattern)
        self.ln_2 = block_norm(before)
        if cfg.moe_experts and layer >= cfg.moe_dense_layers:
            shared = MLP(cfg, cfg.moe_shared * cfg.moe_hidden) if cfg.moe_shared else None
            self.mlp = MoE(cfg, ACTIVATIONS[cfg.mlp], shared, cfg.family.shared_expert_gate,
                           has_bias(cfg, "mlp.router"), has_bias(cfg, "mlp.experts"))
        else:
            self.mlp = MLP(cfg)
        self.ln_attn_out, self.ln_mlp_out = block_norm(after), block_norm(after)
        self.local = cfg.window_of(layer) is not None  # which RoPE table the block takes
        self.rotates = cfg.rotates(layer)  # whether it takes one at all (SmolLM3's NoPE layers do not)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                idx: torch.Tensor | None = None, docs: Documents | None = None) -> torch.Tensor:
        """idx: the input tokens, for the value embeddings of the first value_embeds blocks; docs:
        where the rows' documents lie, attention stopping at their edges (None: rows are single sequences)."""
        x = x + self.ln_attn_out(self.attn(self.ln_1(x), rope, idx, docs))
        return x + self.ln_mlp_out(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        if cfg.family.positions == "learned":  # an embedding per position (POSITIONS)
            self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(DecoderBlock(cfg, layer) for layer in range(cfg.n_layer))
        self.ln_f = norm(cfg, cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.tie_weights()
        # recompute each block's activations in backward instead of storing them
        self.activation_checkpointing = False
        # where a forward's documents lie, from its tokens that open one (replaceable from outside:
        # a rank holding a slice of each row learns the whole rows' from its context group)
        self.documents = Documents.of_rows
        # the LM head and cross-entropy over one chunk of rows (replaceable: compile swaps in a fused one)
        self.head_loss_chunk = head_loss_chunk
        # the device type whose budget sizes the loss's chunks (loss.CHUNK_ELEMENTS): the tensors' unless set
        # from outside (a dry run computes a GPU's step on the CPU)
        self.chunks_for = None
        if self.wte.weight.device.type != "meta":
            self.init_weights()

    def tie_weights(self) -> None:
        """One matrix embeds tokens and scores them (GPT-2; tie_embeddings). Moving a module off
        the meta device (to_empty) makes each module a new parameter, so this is redone after it."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's initialisation at the family's init_std; residual projections scaled by
        1/sqrt(2 * n_layer), or zero (zero_init_proj: every block starts as the identity, as in
        modded-nanogpt). Each norm initialises itself, by what it is (NORMS); a linear layer's
        convolution, decay rates and step bias start as linear_attention.linear_start says."""
        std = self.config.family.init_std
        norms = [m for m in self.modules() if isinstance(m, NORM_TYPES)]
        for module in norms:
            module.reset_parameters()
        of_norms = {id(p) for module in norms for p in module.parameters()}
        for name, p in self.named_parameters():
            if id(p) in of_norms:
                continue
            if name.endswith(RESIDUAL_PROJECTIONS):
                nn.init.normal_(p, mean=0.0, std=0.0 if self.config.zero_init_proj else std / math.sqrt(2 * self.config.n_layer))
            elif start := linear_start(name):  # a linear layer's convolution, decay rates and step bias
                start(p)
            elif p.dim() >= 2 and not name.endswith("_bias"):  # a mixture's experts' biases: 2-D, zeros as any bias
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("value_mix"):
                nn.init.constant_(p, 0.5)  # half v, half the embedding (modded-nanogpt's start)
            else:
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                opens: torch.Tensor | None = None, reduction: str = "mean"):
        """idx, targets: (B, T) token ids. positions (T,): where each column sits in its row (None:
        0 .. T-1; under context parallelism a rank holds a slice of each row, or two). opens (B, T):
        True at the tokens that open a document (the separator between documents), best a host
        array (the loader's; a tensor is read back from its device): attention does not cross into
        another document (None: each row is one sequence). Positions stay the row's: RoPE's
        attention depends on distances alone, so a document attends the same anywhere in a row. Returns (logits (B, T, vocab), None) without
        targets; with them (None, the mean loss), or with reduction "none" (None, each position's loss
        (B, T) in fp32): no logits tensor is made."""
        B, T = idx.shape
        assert T <= self.config.block_size, f"sequence of {T} exceeds block_size {self.config.block_size}"
        if positions is None:
            positions = torch.arange(T, device=idx.device)
        x = self.wte(idx)
        if self.config.family.embed_scale:  # Gemma's sqrt(n_embd) in fp32, whatever dtype the embeddings come in
            # (FSDP2 gathers them in bf16): transformers' value for an fp32 folder, as export_hf.py writes
            x = x * float(torch.tensor(math.sqrt(self.config.n_embd), dtype=torch.float32))
        x, ropes = POSITIONS[self.config.family.positions](self, x, positions)
        x = self.drop(x)
        if compute := autocast_dtype(x.device):
            # the residual stream in autocast's dtype, as FSDP2's bf16 parameters give it: one process
            # computes as its sharded twin does, and every norm, add and cast moves half the bytes
            # (GPT-2 124M on an H100: 3.5% faster, docs/performance.md)
            x = x.to(compute)
        docs = None if opens is None else self.documents(opens)
        for block in self.blocks:
            rope = ropes[block.local] if ropes and block.rotates else None
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, rope, idx, docs, use_reentrant=False)
            else:
                x = block(x, rope, idx, docs)
        h = self.ln_f(x)
        if targets is None:
            return self.logits(h), None
        # the head and cross-entropy chunk by chunk: no (B, T, vocab) logits (loss.py)
        if reduction == "none":  # evaluation: eager (a compiled chunk would compile again without gradients)
            return None, per_position_cross_entropy(h, self.lm_head.weight, targets, self.config.logit_softcap)
        loss = chunked_cross_entropy(h, self.lm_head.weight, targets, self.config.logit_softcap, self.head_loss_chunk,
                                     self.chunks_for)
        if self.config.moe_aux_loss and self.training:
            balancing = self.config.moe_aux_loss * torch.stack([m.aux_loss for m in self.moe_layers()]).mean()
            # the value stays the language-modelling loss (what is logged and compared with dense
            # runs): x - x.detach() is exactly 0, and it carries the balancing term's gradient
            loss = loss + (balancing - balancing.detach())
        return None, loss

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, vocab) from the final norm's output: for evaluation and sampling."""
        logits = self.lm_head(h)
        if self.config.logit_softcap:  # Gemma 2's soft cap: large logits can't run away
            # in fp32, as the speedruns cap: in bf16 its gradient is off by ~2e-3 relative
            cap = self.config.logit_softcap
            logits = cap * torch.tanh(logits.float() / cap)
        return logits

    def moe_layers(self) -> list[MoE]:
        return [block.mlp for block in self.blocks if isinstance(block.mlp, MoE)]

    def num_params(self, exclude_position_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # tied weights counted once
        return n - self.wpe.weight.numel() if exclude_position_embedding and hasattr(self, "wpe") else n

    def idle_expert_params(self) -> int:
        """The routed experts' weights a token does not use: all of them but its top-k (their biases too), in
        every MoE layer."""
        return sum(m.expert_params(biases=True) * (m.n_experts - m.top_k) for m in self.moe_layers())

    def flops_per_token(self) -> float:
        """Training FLOPs per token: forward + backward = 3x the forward's matmuls.

        Forward: 2 FLOPs per weight of every Linear (LM head included) and of each token's top-k
        experts, plus the attention products QK^T and AV, 2 * T * heads * (q and k's head width + v's)
        per layer at full context (2 * 2 * T * n_embd where heads x head_dim is n_embd): T keys a query,
        the convention of PaLM's MFU and nanoGPT's (twice a causal layer's real work);
        a local layer counts its window instead of T (about its real work), so a windowed model's MFU
        reads low against a full one's at the same speed. A linear layer (Gated DeltaNet) counts its rule's
        and convolution's, linear in T (GatedDeltaNet.flops_per_row).
        """
        cfg = self.config
        matmul_weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        matmul_weights += sum(m.top_k * m.expert_params() for m in self.moe_layers())
        keys = sum(min(cfg.window_of(layer) or cfg.block_size, cfg.block_size) for layer in range(cfg.n_layer)
                   if cfg.mixer_of(layer) == "full")
        qk, v, _ = cfg.head_widths
        attention = 2 * keys * cfg.n_head * (qk + v)  # GQA or not; a local layer's queries see its window
        linear = sum(b.attn.flops_per_row(cfg.block_size) for b in self.blocks if isinstance(b.attn, GatedDeltaNet))
        return 3 * (2 * matmul_weights + attention) + linear / cfg.block_size

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

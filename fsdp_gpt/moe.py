"""A mixture-of-experts MLP in plain PyTorch (Qwen3-MoE, OLMoE, DeepSeek-V3, gpt-oss): a router picks
each token's top-k experts, every token reaches all of them (dropless token choice: no capacity,
nothing dropped), and the experts' weights are stacked so that one grouped matmul serves them all.
Shared experts, where configured, see every token; the router and the experts have biases where the
family's do (gpt-oss). No distributed code lives here: what runs the experts on the tokens routed to
them (`run_experts`) is replaceable from outside, as attention's core is.
"""
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from fsdp_gpt.compat import autocast_dtype, grouped_mm_on_cpu


def per_expert_dims(name: str, shape) -> int:
    """The dimensions of one expert's part of a parameter named `name` (model.GPT's names) where it is a
    mixture's stacked experts' (dim 0 the expert: c_fc a matrix an expert, c_fc_bias a vector), else the
    parameter's own: what the optimizers treat as a matrix (2) or a vector (1)."""
    return len(shape) - (".experts." in name)


def grouped_mm_runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch._grouped_mm computes x's groups against w's experts here: on CUDA in bf16 from
    sm90 (H100) on; on CPU from torch 2.13 (fp32 and bf16; torch 2.8 has no CPU kernel). It wants each
    matrix's rows 16-byte aligned (widths x itemsize multiples of 16); torch.compile traces it, and fake
    tensors (a dry run's) take its shape, in bf16 only (its shape function refuses fp32 in 2.13). Elsewhere:
    a matmul per expert."""
    if not hasattr(torch, "_grouped_mm") or any(n * x.element_size() % 16 for n in w.shape[1:]):
        return False
    if (torch.compiler.is_compiling() or is_fake(x)) and x.dtype != torch.bfloat16:
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return x.device.type == "cpu" and grouped_mm_on_cpu()


def expert_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, in) grouped by expert, counts[e] rows for expert e; w (experts, out, in) -> (rows, out):
    each group times its expert's matrix, in one grouped matmul where one runs, plus its expert's bias
    (experts, out) where one is given."""
    # torch._grouped_mm is no autocast op: under autocast both go to its dtype (x may come from a norm
    # in fp32; the stacked weights are never cast for us), else fp32 matmuls per expert ran on the GPU
    dtype = autocast_dtype(x.device) or x.dtype
    x, w = x.to(dtype), w.to(dtype)
    if grouped_mm_runs(x, w):
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=counts.cumsum(0).to(torch.int32))
    else:
        y = matmul_per_expert(x, w, counts)
    if bias is None:
        return y
    # each row its expert's bias (output_size: the rows' count, known on the host: no sync)
    return y + bias.to(dtype).repeat_interleave(counts, dim=0, output_size=x.shape[0])


# Where no grouped matmul runs: a matmul per expert, whose split sizes the host must read. An operator
# of its own, opaque to torch.compile: its output's shape is its input's, so a compiled block keeps
# one graph instead of breaking (and recompiling at every new routing) around the host's split.
@torch.library.custom_op("fsdp_gpt::matmul_per_expert", mutates_args=())
def matmul_per_expert(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(rows, in), (experts, out, in) -> (rows, out)."""
    return torch.cat([rows @ w_e.T for rows, w_e in zip(x.split(counts.tolist()), w)])


@torch.library.custom_op("fsdp_gpt::expert_weight_grad", mutates_args=())
def expert_weight_grad(grad: torch.Tensor, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(rows, out), (rows, in) -> (experts, out, in): each expert's rows' grad.T @ x."""
    sizes = counts.tolist()
    return torch.stack([g.T @ rows for g, rows in zip(grad.split(sizes), x.split(sizes))])


@matmul_per_expert.register_fake
def _(x, w, counts):
    return x.new_empty(x.shape[0], w.shape[1])


@expert_weight_grad.register_fake
def _(grad, x, counts):
    return grad.new_empty(counts.shape[0], grad.shape[1], x.shape[1])


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _matmul_per_expert_backward(ctx, grad):
    x, w, counts = ctx.saved_tensors
    return matmul_per_expert(grad, w.transpose(1, 2).contiguous(), counts), expert_weight_grad(grad, x, counts), None


matmul_per_expert.register_autograd(_matmul_per_expert_backward, setup_context=_save_inputs)


class GroupedExperts(nn.Module):
    """`experts` gated MLPs (SwiGLU, gpt-oss's clamped SwiGLU) of hidden width `hidden`, their weights
    stacked along dim 0: c_fc (experts, 2 hidden, width) holds each expert's gate rows then its up rows,
    c_proj (experts, width, hidden); with biases, c_fc_bias (experts, 2 hidden) and c_proj_bias
    (experts, width), a vector per expert. FSDP shards dim 0, so a rank holds whole experts wherever
    the count allows."""

    def __init__(self, experts: int, width: int, hidden: int, activation, bias: bool = False):
        super().__init__()
        self.c_fc = nn.Parameter(torch.empty(experts, 2 * hidden, width))
        self.c_proj = nn.Parameter(torch.empty(experts, width, hidden))
        if bias:
            self.c_fc_bias = nn.Parameter(torch.empty(experts, 2 * hidden))
            self.c_proj_bias = nn.Parameter(torch.empty(experts, width))
        self.activation = activation

    def weights(self) -> dict[str, torch.Tensor]:
        """The experts this module computes, by name (expert parallelism: a rank's own, swapped in from outside)."""
        return dict(self.named_parameters())

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (rows, width) grouped by expert (counts[e] rows each) -> (rows, width)."""
        w = self.weights()
        hidden = self.activation(expert_matmul(x, w["c_fc"], counts, w.get("c_fc_bias")))
        return expert_matmul(hidden, w["c_proj"], counts, w.get("c_proj_bias"))


def run_local(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Every expert on this process: the grouped rows straight through (expert parallelism replaces this)."""
    return experts(x, counts)


# what ranks a group of experts for a token, from its experts' choice scores (..., groups, experts a group), by
# the family's moe_group_score: the sum of its best two (DeepSeek V3's), or its best one (V2's)
GROUP_SCORES = {"top2": lambda scores: scores.topk(2, dim=-1).values.sum(-1),
                "best": lambda scores: scores.amax(-1)}


class MoE(nn.Module):
    """The MLP of a DecoderBlock as a mixture: routed experts, optionally shared experts beside them
    (their output gated by a sigmoid of x where shared_gate is set: Qwen3.5-MoE's).

    moe_groups: DeepSeek's grouped choice, a token's experts chosen within its moe_top_groups best
    groups of consecutive experts. moe_scale: the chosen experts' weights times it (routed_scaling_factor).
    expert_bias: DeepSeek-V3's auxiliary-loss-free balancing, a per-expert bias added to the scores
    for the choice of experts only (the weights stay the scores'); a parameter without gradient that
    the training loop moves (optim/expert_balance.py), so checkpoints keep and reshard it as any other.
    While training, each forward leaves its routing's figures for that loop: the token count of each
    expert, the load-balancing loss (aux_loss, with its gradient) and one forward counted."""

    def __init__(self, cfg, activation, shared: nn.Module | None = None, shared_gate: bool = False,
                 router_bias: bool = False, expert_biases: bool = False):
        super().__init__()
        self.n_experts, self.top_k, self.score, self.norm_top_k = cfg.moe_experts, cfg.moe_top_k, cfg.moe_score, cfg.moe_norm_top_k
        self.groups, self.top_groups, self.scale = cfg.moe_groups, cfg.moe_top_groups, cfg.moe_scale
        self.group_score = GROUP_SCORES[cfg.family.moe_group_score]
        self.router = nn.Linear(cfg.n_embd, cfg.moe_experts, bias=router_bias)
        self.experts = GroupedExperts(cfg.moe_experts, cfg.n_embd, cfg.moe_hidden, activation, expert_biases)
        self.shared = shared
        # Qwen3.5-MoE's: the shared experts' output times sigmoid(shared_gate(x)), a weight a token
        self.shared_gate = nn.Linear(cfg.n_embd, 1, bias=False) if shared is not None and shared_gate else None
        self.expert_bias = nn.Parameter(torch.empty(cfg.moe_experts), requires_grad=False)
        self.run_experts = run_local  # replaceable from outside
        self.aux_loss, self.pending = None, None

    def expert_params(self, biases: bool = False) -> int:
        """One routed expert's matrices' weights (what a token's FLOPs count), with its biases where asked."""
        return sum(p.numel() for name, p in self.experts.named_parameters()
                   if biases or not name.endswith("_bias")) // self.n_experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, width) -> the chosen experts (N, k), their weights (N, k) and every expert's
        score (N, experts). In fp32: a bf16 router flips near-ties between experts."""
        scores = self.router(x).float()
        scores = scores.softmax(-1) if self.score == "softmax" else scores.sigmoid()
        choice = scores + self.expert_bias.float()
        if self.groups > 1:
            choice = self.within_best_groups(choice)
        chosen = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.norm_top_k:
            weights = weights / weights.sum(-1, keepdim=True)
        return chosen, weights * self.scale, scores

    def within_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """The choice scores (N, experts) with every expert outside each token's moe_top_groups best
        groups at -inf: top-k takes none of them."""
        grouped = choice.unflatten(-1, (self.groups, -1))
        best = self.group_score(grouped).topk(self.top_groups, dim=-1).indices
        kept = torch.zeros(grouped.shape[:-1], dtype=torch.bool, device=choice.device).scatter_(-1, best, True)
        return grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        x = x.reshape(B * T, C)
        chosen, weights, scores = self.route(x)
        experts = scores.shape[-1]
        # each token once per chosen expert, grouped by expert: a stable sort keeps token order inside a group
        flat = chosen.flatten()  # (N k)
        order = flat.argsort(stable=True)
        # tokens per expert, on the device (bincount's output size is data-dependent: on CUDA it reads
        # the ids' range back to the host, and torch.compile breaks the graph around it)
        counts = torch.zeros(experts, dtype=flat.dtype, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
        rows = x.unsqueeze(1).expand(-1, self.top_k, -1).reshape(-1, C)[order]
        out = self.run_experts(self.experts, rows, counts)
        # back to token order by the inverse permutation, then a weighted sum over each token's k
        # results: no index_add_ over repeated indices, whose order (and so its sum) is not deterministic
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        y = (out[inverse].view(B * T, self.top_k, C) * weights.unsqueeze(-1).to(out.dtype)).sum(1)
        if self.shared is not None:
            shared = self.shared(x)
            y = y + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * shared)
        if self.training:
            self._record(counts, scores)
        return y.view(B, T, C)

    def _record(self, counts: torch.Tensor, scores: torch.Tensor) -> None:
        """The load-balancing loss of this forward (Qwen3's, Switch Transformer's with top-k: experts x
        the sum over experts of their share of tokens x their mean score, top_k at perfect balance), and
        the figures the step's balancing sums. Activation checkpointing runs a forward twice: every
        count doubles alike, so the shares the loop takes from them hold."""
        tokens = scores.shape[0]
        probs = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        self.aux_loss = scores.shape[-1] * (counts.float() / tokens * probs.mean(0)).sum()
        figures = torch.cat([counts.float(), self.aux_loss.detach().reshape(1), counts.new_ones(1, dtype=torch.float)])
        self.pending = figures if self.pending is None else self.pending + figures

    def take_pending(self, device: torch.device) -> torch.Tensor:
        """The counts (experts), aux loss sum and forwards summed since the last take; then zeros on
        `device`, the forwards' (a sum that always exists: a compiled block would otherwise compile
        the first forward of each step apart, where there is none yet)."""
        taken = self.pending if self.pending is not None else torch.zeros(self.n_experts + 2, device=device)
        self.pending = torch.zeros(self.n_experts + 2, device=device)
        return taken

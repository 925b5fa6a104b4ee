"""After each optimizer step, the mixture-of-experts layers' routing summed over the step: every
expert's share of the tokens routed in it, over every rank's micro-batches (one all-reduce, on every
rank, every step), and DeepSeek-V3's auxiliary-loss-free balancing from those shares: each expert's
selection bias moves by moe_bias_rate towards the mean load (up when under it, down when over).
The shares, not counts: a forward that activation checkpointing runs twice counts twice, in every
figure of its layer alike. What the log shows comes from here too.
"""
import torch
import torch.distributed as dist

from fsdp_gpt.distributed.shards import full_tensor, local_slice
from fsdp_gpt.model import GPT
from fsdp_gpt.moe import MoE


class ExpertBalance:
    # the TensorBoard tags scalars() returns, {tag: meaning}: docs/logging.md's table is made of these
    # (fsdp_gpt/doc_tables.py) and the tests refuse a tag a run writes undeclared
    TAGS = {"moe/layer{i}/busiest": "a MoE layer's busiest expert's tokens over the mean load (1.0: balanced)",
            "moe/layer{i}/idle": "the share of a MoE layer's experts that got no token",
            "moe/layer{i}/bias_range": "the spread of a MoE layer's selection biases (moe_bias_rate)",
            "moe/layer{i}/aux_loss": "a MoE layer's load-balancing loss (what moe_aux_loss weighs)",
            "moe/{busiest,idle}": "the worst layer's busiest and idle: the console line's"}

    def __init__(self, gpt: GPT, bias_rate: float, device: torch.device):
        self.layers = {i: block.mlp for i, block in enumerate(gpt.blocks) if isinstance(block.mlp, MoE)}
        self.bias_rate, self.device = bias_rate, device
        for moe in self.layers.values():
            moe.take_pending(device)  # each layer's sums start at zero on the forwards' device
        self.shares = None  # (layers, experts): each expert's share of the last step's routed tokens
        self.aux = None  # (layers,): the last step's mean load-balancing loss per layer

    def step(self) -> None:
        """Every rank, after the optimizer step: the step's shares, and the bias moved by them."""
        if not self.layers:
            return
        figures = torch.stack([moe.take_pending(self.device) for moe in self.layers.values()])  # (layers, experts + 2)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(figures)
        counts, aux_sum, forwards = figures[:, :-2], figures[:, -2], figures[:, -1]
        self.shares = counts / counts.sum(-1, keepdim=True).clamp(min=1)
        self.aux = aux_sum / forwards.clamp(min=1)
        if self.bias_rate:
            experts = counts.shape[-1]
            with torch.no_grad():
                for moe, load in zip(self.layers.values(), self.shares):
                    # the same update on every rank (the shares are global): each moves its own rows
                    local, offset = local_slice(moe.expert_bias)
                    nudge = self.bias_rate * torch.sign(1 / experts - load[offset:offset + len(local)])
                    local.add_(nudge.to(local.device, local.dtype))

    def scalars(self) -> dict[str, float]:
        """moe/layer{i}/... of the last step, and the worst layer's busiest and idle for the console
        line. Every rank calls it (the bias of a sharded model is gathered)."""
        if not self.layers or self.shares is None:
            return {}
        experts = self.shares.shape[-1]
        biases = torch.stack([full_tensor(moe.expert_bias).to(self.shares.device) for moe in self.layers.values()])
        figures = {"busiest": self.shares.max(-1).values * experts, "idle": (self.shares == 0).float().mean(-1),
                   "bias_range": biases.max(-1).values - biases.min(-1).values, "aux_loss": self.aux}
        names, rows = list(figures), torch.stack(list(figures.values()), dim=-1).tolist()
        scalars = {f"moe/layer{i}/{name}": value for i, row in zip(self.layers, rows) for name, value in zip(names, row)}
        return scalars | {"moe/busiest": max(row[0] for row in rows), "moe/idle": max(row[1] for row in rows)}

    def state(self) -> dict | None:
        """What a checkpoint keeps beside the weights (the biases are the model's): the last step's
        figures, which the next log line shows."""
        return None if self.shares is None else {"load": self.shares.tolist(), "aux": self.aux.tolist()}

    def load(self, state: dict | None) -> None:
        if state:
            self.shares, self.aux = (torch.tensor(state[k], device=self.device) for k in ("load", "aux"))

"""Run by test_long_runs.py: the real trainer, with a non-finite value injected on one rank at chosen
steps. NONFINITE_STEPS="3,4" names the steps, NONFINITE_RANK the rank, NONFINITE_INTO where:
"data" (that rank's loss turns NaN, as a corrupt batch would make it) or "gradient" (one element
of that rank's gradient shard turns inf, before the norm is taken)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_gpt import model  # noqa: E402
import train_fsdp  # noqa: E402
from fsdp_gpt.config_parse import parse_args  # noqa: E402
from fsdp_gpt.distributed.launch import run_entry_point  # noqa: E402

STEPS = {int(s) for s in os.environ["NONFINITE_STEPS"].split(",")}
HERE = int(os.environ.get("RANK", 0)) == int(os.environ["NONFINITE_RANK"])
step_now = [0]
real_lr_at, real_forward, real_clip = train_fsdp.lr_at, model.GPT.forward, train_fsdp.clip_gradients


def lr_at_marking_the_step(cfg, step):
    step_now[0] = step
    return real_lr_at(cfg, step)


def forward_with_a_nan_loss(self, idx, targets=None, **kwargs):
    logits, loss = real_forward(self, idx, targets, **kwargs)
    if loss is not None and self.training and step_now[0] in STEPS:
        loss = loss * float("nan")
    return logits, loss


def clip_after_an_inf(model, max_norm):
    if step_now[0] in STEPS:
        grad = next(p.grad for p in model.parameters() if p.grad is not None)
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        local.view(-1)[0] = float("inf")
    return real_clip(model, max_norm)


train_fsdp.lr_at = lr_at_marking_the_step
if HERE and os.environ["NONFINITE_INTO"] == "data":
    model.GPT.forward = forward_with_a_nan_loss
if HERE and os.environ["NONFINITE_INTO"] == "gradient":
    train_fsdp.clip_gradients = clip_after_an_inf
run_entry_point(lambda: train_fsdp.train(parse_args(sys.argv[1:])))

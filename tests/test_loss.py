"""The LM head's loss without a logits tensor (loss.py): equal to the whole logits' cross-entropy in
the loss and every gradient, across layouts, ranks and dtypes; and what it saves in memory."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

import fsdp_gpt.loss as loss_module
from conftest import DEMO, ROOT, launch, overrides
from loss_probe import whole_logits_loss
from fsdp_gpt.model import GPT, GPTConfig

SHAPES = {
    "gpt2, tied head": dict(),
    "llama, untied head, one key/value head": dict(arch="llama", tie_embeddings=False, n_kv_head=1),
    "soft cap": dict(arch="llama", tie_embeddings=True, logit_softcap=3.0, mlp="relu2"),
    "experts with the balancing loss": dict(arch="llama", tie_embeddings=True, moe_experts=4, moe_aux_loss=0.01),
}


def loss_and_gradients(model: GPT, compute_loss) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = compute_loss()
    loss.backward()
    return loss.detach().double(), {name: p.grad.double() for name, p in model.named_parameters() if p.grad is not None}


def largest(a: dict, b: dict) -> float:
    """The largest difference of any gradient, relative to that gradient's largest entry."""
    assert sorted(a) == sorted(b)
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max()).item() for n in b)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES)
def test_chunked_loss_is_the_whole_logits_cross_entropy_in_fp32(shape, monkeypatch):
    monkeypatch.setitem(loss_module.CHUNK_ELEMENTS, "cpu", 300 * 12)  # 6 chunks of 12 rows
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=32, **shape))
    x, y = torch.randint(0, 300, (2, 3, 24)).unbind()
    assert loss_module.chunk_count(x.numel(), 300, "cpu") == 6
    loss, grads = loss_and_gradients(model, lambda: model(x, y)[1])
    ref_loss, ref_grads = loss_and_gradients(model, lambda: whole_logits_loss(model, model, x, y))
    assert abs(loss - ref_loss) / ref_loss < 1e-6
    assert largest(grads, ref_grads) < 1e-6
    with torch.no_grad():  # evaluation's per-position losses alike
        per_position = model.eval()(x, y, reduction="none")[1]
        expected = F.cross_entropy(model(x)[0].float().flatten(0, 1), y.flatten(), reduction="none").view_as(y)
    assert per_position.shape == y.shape and torch.allclose(per_position, expected, rtol=1e-6, atol=1e-6)


def test_chunked_loss_in_bf16_is_no_further_from_fp64_than_the_whole_logits():
    """Under bf16 autocast both round (the head's matmuls); the chunked loss's loss and gradients
    lie no further from an fp64 computation than the whole logits' do, up to a bf16 rounding."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=64, arch="llama",
                          tie_embeddings=False, logit_softcap=10.0))
    x, y = torch.randint(0, 512, (2, 4, 64)).unbind()
    exact_loss, exact = loss_and_gradients(model.double(), lambda: whole_logits_loss(model, model, x, y))
    model.float()
    errors = {}
    for name, compute_loss in (("chunked", lambda: model(x, y)[1]),
                               ("whole", lambda: whole_logits_loss(model, model, x, y))):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, grads = loss_and_gradients(model, compute_loss)
        errors[name] = (abs(loss - exact_loss).item() / exact_loss.item(), largest(grads, exact))
    assert errors["chunked"][0] <= errors["whole"][0] + 2 ** -8, errors
    assert errors["chunked"][1] <= errors["whole"][1] + 2 ** -8, errors
    assert 0 < errors["whole"][1] < 0.05, errors  # bf16 did round: the comparison means something


PROBE = dict(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=32, micro_batch=2, train_batch=4,
             dtype="fp32", tokenizer="bytes", data_source=None, checkpoint_dir="ckpt", tensorboard_dir="tb")


@pytest.mark.slow
@pytest.mark.parametrize("nproc, settings", [
    (1, dict(arch="llama", tie_embeddings=False, logit_softcap=3.0, force_fsdp=True, compile=True)),
    (2, dict(cp_size=2)),
    (2, dict(arch="llama", moe_experts=4, moe_aux_loss=0.01)),
], ids=["1 rank FSDP2 compiled, untied, soft cap", "2 ranks cp_size 2", "2 ranks, experts"])
def test_chunked_loss_equals_the_whole_logits_as_the_trainer_builds_the_model(nproc, settings, tmp_path):
    result = launch([os.path.join(ROOT, "tests", "loss_probe.py"), DEMO] + overrides(**(PROBE | settings)),
                    tmp_path, nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report.pop("same gradients") is True and report.pop("chunks") > 1 and len(report) > 10, report
    assert max(report.values()) < 1e-6, report

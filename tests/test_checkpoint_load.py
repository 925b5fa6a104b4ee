"""A full checkpoint is plain PyTorch: model.GPT loads it with no torch.distributed at all."""
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import RUN, TINY, evaluated, run_trainer, scalars
from fsdp_gpt.model import GPT, GPTConfig

pytestmark = pytest.mark.slow


def test_full_checkpoint_loads_into_plain_gpt_and_gives_logged_val_loss(two_rank_runs, corpus):
    run_dir = two_rank_runs["full"]  # 2 ranks, FULL_SHARD
    ckpt = torch.load(os.path.join(run_dir, "ckpt", "fsdp_cpt6.pth"), weights_only=True)
    assert not torch.distributed.is_initialized()
    model = GPT(GPTConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    assert ckpt["step"] == 6
    # the optimizer state of every parameter, not one rank's share
    assert len(ckpt["optimizer"]["state"]) == len(list(model.parameters()))
    for name, p in model.named_parameters():
        assert ckpt["optimizer"]["state"][name]["exp_avg"].shape == p.shape

    # val/loss as documented: the first eval_iters * train_batch consecutive windows of val.bin
    T = TINY["block_size"]
    val = np.memmap(os.path.join(corpus["data_path"], "val.bin"), dtype=np.uint16, mode="r")
    windows = np.stack([val[i * T:i * T + T + 1] for i in range(TINY["eval_iters"] * RUN["train_batch"])])
    x, y = (torch.from_numpy(windows.astype(np.int64))[:, s] for s in (slice(0, -1), slice(1, None)))
    model.eval()
    with torch.no_grad():
        logits, _ = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    logged = scalars(os.path.join(run_dir, "tb"), "val/loss")[6]
    assert loss == pytest.approx(logged, rel=1e-5)
    assert logged < scalars(os.path.join(run_dir, "tb"), "val/loss")[0]


def test_evaluate_gives_a_bf16_runs_logged_val_loss(corpus, tmp_path):
    """evaluate.py computes in the run's dtype. Unwrapped (and under DDP) the trainer's forwards run
    under the same autocast: the same figure to print precision, and not the fp32 one. Under FSDP
    autocast runs too (for the vectors FSDP2 leaves whole), and the matrices and embeddings come
    gathered in bf16: the embeddings are added after rounding, where autocast adds fp32 ones and
    rounds the sum. Within 1e-4 (6e-6 measured; 3e-4 when FSDP2 cast the norms' weights too)."""
    for nproc in (1, 2):
        run_dir = tmp_path / f"ranks{nproc}"
        run_dir.mkdir()
        run_trainer(str(run_dir), nproc=nproc, dtype="bf16", max_iters=4, eval_iters=4, **corpus)
        logged = scalars(str(run_dir / "tb"), "val/loss")[4]
        checkpoint = run_dir / "ckpt" / "fsdp_cpt4.pth"
        if nproc == 1:
            assert evaluated(checkpoint) == pytest.approx(logged, rel=1e-6)
            assert evaluated(checkpoint, "--dtype", "fp32") != pytest.approx(logged, rel=1e-6)
        else:
            assert evaluated(checkpoint) == pytest.approx(logged, rel=1e-4)

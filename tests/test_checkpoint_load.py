"""A full checkpoint is plain PyTorch: model.GPT loads it with no torch.distributed at all."""
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import TINY, run_trainer, scalars
from model import GPT, GPTConfig

pytestmark = pytest.mark.slow


def test_full_checkpoint_loads_into_plain_gpt_and_gives_logged_val_loss(corpus, tmp_path):
    run_trainer(str(tmp_path), nproc=2, max_iters=4, **corpus)
    ckpt = torch.load(tmp_path / "ckpt" / "fsdp_cpt4.pth", weights_only=True)
    assert not torch.distributed.is_initialized()
    model = GPT(GPTConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    assert ckpt["step"] == 4
    # the optimizer state of every parameter, not one rank's share
    assert len(ckpt["optimizer"]["state"]) == len(list(model.parameters()))
    for name, p in model.named_parameters():
        assert ckpt["optimizer"]["state"][name]["exp_avg"].shape == p.shape

    # val/loss as documented: the first eval_iters * train_batch consecutive windows of val.bin
    T = TINY["block_size"]
    val = np.memmap(os.path.join(corpus["data_path"], "val.bin"), dtype=np.uint16, mode="r")
    windows = np.stack([val[i * T:i * T + T + 1] for i in range(TINY["eval_iters"] * TINY["train_batch"])])
    x, y = (torch.from_numpy(windows.astype(np.int64))[:, s] for s in (slice(0, -1), slice(1, None)))
    model.eval()
    with torch.no_grad():
        logits, _ = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    logged = scalars(str(tmp_path / "tb"), "val/loss")[4]
    assert loss == pytest.approx(logged, rel=1e-5)
    assert logged < scalars(str(tmp_path / "tb"), "val/loss")[0]

"""The LM head and the cross-entropy together, a chunk of rows at a time (no distributed code).

A training forward never holds the [B, T, vocab] logits: each chunk of rows computes its logits,
its share of the loss (fp32) and, at once, its gradients with respect to the hidden states and the
head's weight; then the chunk's logits are freed. Backward only scales what the forward kept (the
hidden states' gradient, the size of the hidden states, and the weight's, accumulated in fp32). At
GPT-2's vocabulary the logits of 16 x 1,024 tokens are 1.6 GB in bf16, 3.3 GB in fp32, and as much
again for the log-softmax and the gradient: here a chunk's (2^28 elements on a GPU, 2^25 on a CPU).

The FLOPs are the plain head's (one matmul forward, two backward), none recomputed. The chunk's
function is plain PyTorch that torch.compile can fuse (the soft cap, log-sum-exp and gradient in one
pass over the chunk's logits): parallelize.py swaps in the compiled one.
"""
import torch

# elements of a chunk's logits. Compiled, a chunk holds its logits and their gradient in the compute dtype
# (eager: a few fp32 copies too); every chunk adds its fp32 weight gradient into the sum, a pass
# over (vocab, C): fewer, larger chunks on a GPU
CHUNK_ELEMENTS = {"cuda": 1 << 28, "cpu": 1 << 25}


def chunk_count(rows: int, vocab: int, device_type: str) -> int:
    """Chunks whose logits fit the device's budget: of equal rows where a count up to twice the least
    divides them (one compiled shape), else the least (a shorter last chunk: a row count with no such
    divisor, a prime one, never falls to a row a chunk)."""
    least = -(-rows * vocab // CHUNK_ELEMENTS.get(device_type, CHUNK_ELEMENTS["cpu"]))
    return next((chunks for chunks in range(least, 2 * least + 1) if rows % chunks == 0), least)


def row_chunks(h: torch.Tensor, targets: torch.Tensor, vocab: int,
               device_type: str | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """h (..., C) and targets (...) as rows, cut into chunk_count's chunks for device_type's budget (None:
    h's device): (h's, targets')."""
    chunks = chunk_count(targets.numel(), vocab, device_type or h.device.type)
    return h.flatten(0, -2).chunk(chunks), targets.flatten().chunk(chunks)


def head_loss_chunk(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, softcap: float | None,
                    grads: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """h (rows, C), weight (vocab, C), targets (rows,) -> each row's loss (rows,) in fp32, and with
    grads the gradients of their sum with respect to h (rows, C) and weight (vocab, C), written out
    as cross-entropy's backward computes them (softmax - one-hot)."""
    logits = h @ weight.t()  # (rows, vocab) in the compute dtype (autocast's or the parameters')
    z = logits.float()
    if softcap:  # in fp32, as the speedruns cap: in bf16 its gradient is off by ~2e-3 relative
        capped = torch.tanh(z / softcap)
        z = softcap * capped
    lse = torch.logsumexp(z, dim=-1)
    losses = lse - z.gather(-1, targets[:, None]).squeeze(-1)
    if not grads:
        return losses, None, None
    # softmax - one-hot, the one-hot as a comparison: all pointwise, so compile makes one pass that
    # reads the chunk's logits and writes their gradient (a scatter would write an fp32 copy first)
    one_hot = targets[:, None] == torch.arange(z.shape[-1], device=z.device)
    dz = torch.exp(z - lse[:, None]) - one_hot.to(z.dtype)
    if softcap:
        dz = dz * (1 - capped * capped)
    dlogits = dz.to(logits.dtype)  # where the plain head's backward casts too (logits.float()'s backward)
    return losses, dlogits @ weight, dlogits.t() @ h


class ChunkedHeadLoss(torch.autograd.Function):
    """The mean cross-entropy of h @ weight.T against targets, chunk by chunk (module docstring)."""

    @staticmethod
    def forward(ctx, h, weight, targets, softcap, chunk_fn, chunks_for):
        # in the compute dtype: autocast's (cast once here, not once a chunk), else the parameters'
        device = h.device.type
        autocast = device != "meta" and torch.is_autocast_enabled(device)  # (meta: the FLOP counter's)
        dtype = torch.get_autocast_dtype(device) if autocast else weight.dtype
        h_chunks, target_chunks = row_chunks(h.to(dtype), targets, weight.shape[0], chunks_for)
        cast_weight, rows = weight.to(dtype), targets.numel()
        grads = any(ctx.needs_input_grad[:2])
        loss = torch.zeros((), device=h.device, dtype=torch.float32)
        grad_h = torch.empty(h.shape, device=h.device, dtype=dtype) if grads else None
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if grads else None
        # each chunk's gradient lands in its rows of grad_h
        slots = grad_h.view(rows, -1).chunk(len(h_chunks)) if grads else [None] * len(h_chunks)
        for h_c, t_c, slot in zip(h_chunks, target_chunks, slots):
            loss_c, grad_h_c, grad_weight_c = chunk_fn(h_c, cast_weight, t_c, softcap, grads)
            loss += loss_c.sum()
            if grads:
                slot.copy_(grad_h_c)
                grad_weight += grad_weight_c
        ctx.rows = rows
        ctx.dtypes = (h.dtype, weight.dtype)
        ctx.save_for_backward(grad_h, grad_weight)
        return loss / rows

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_weight = ctx.saved_tensors
        h_dtype, weight_dtype = ctx.dtypes
        scale = grad_loss / ctx.rows  # the forward's gradients are of the summed loss: no fp16 underflow in them
        return (grad_h.float().mul_(scale).to(h_dtype), (grad_weight * scale).to(weight_dtype),
                None, None, None, None)


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, softcap: float | None = None,
                          chunk_fn=head_loss_chunk, chunks_for: str | None = None) -> torch.Tensor:
    """F.cross_entropy(softcap(h @ weight.T).float(), targets), mean over every position, without
    the logits tensor: h (..., C), targets (...); chunks_for: the device type whose budget sizes the chunks
    (None: h's)."""
    return ChunkedHeadLoss.apply(h, weight, targets, softcap, chunk_fn, chunks_for)


def per_position_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               softcap: float | None = None) -> torch.Tensor:
    """Each position's loss (...) in fp32, chunk by chunk: for evaluation (val loss, multiple choice)."""
    return torch.cat([head_loss_chunk(h_c, weight, t_c, softcap, False)[0]
                      for h_c, t_c in zip(*row_chunks(h, targets, weight.shape[0]))]).view_as(targets)

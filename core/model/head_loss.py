"""The LM head's loss, a block of rows at a time, and the logit soft-cap it may apply.

`LinearCrossEntropy` is eager training's loss (gpt.py's docstring says when it runs); `head_scores`
is evaluation's and task scoring's per-token loss. Both cap the logits as `softcap` does when the
model has `logit_softcap` (modded-nanogpt's, from Gemma 2: cap · tanh(logits / cap)), so every
path scores the logits the model is trained on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data.chat_rows import IGNORE  # a target the loss skips: a chat run's prompt and padding


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap · tanh(logits / cap); the logits unchanged at cap 0 (off)."""
    return cap * torch.tanh(logits / cap) if cap else logits


def head_scores(h: torch.Tensor, W: torch.Tensor, flat: torch.Tensor, cap: float,
                argmax: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row float32 cross-entropy of `h @ W.T` (soft-capped at `cap`) against `flat`, and with
    `argmax` whether each target was the greedy choice; a block of rows at a time, without gradients."""
    rows = LinearCrossEntropy.rows_per_block(W.shape[0], h.is_cuda)
    losses = torch.empty(flat.shape, dtype=torch.float32, device=h.device)
    hits = torch.empty(flat.shape, dtype=torch.bool, device=h.device) if argmax else None
    for start in range(0, len(flat), rows):
        logits = softcap(F.linear(h[start:start + rows], W).float(), cap)
        ts = flat[start:start + rows, None]
        losses[start:start + rows] = torch.logsumexp(logits, dim=-1) - logits.gather(1, ts).squeeze(1)
        if hits is not None:
            hits[start:start + rows] = logits.argmax(dim=-1) == ts.squeeze(1)
        del logits  # before the next block's matmul, or two blocks are alive at once
    return losses, hits


def _fp16_autocast(device: str) -> bool:
    """fp16 keeps the plain loss: LinearCrossEntropy computes the logits' gradient in the forward,
    before the GradScaler's factor, and (softmax − one-hot) / tokens in fp16 underflows to zero
    for most of the vocabulary. The plain form's gradient arrives already scaled."""
    return torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.float16


class LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of `h @ W.T` against `targets`, a block of rows at a time, with the
    gradients of `h` and `W` computed on the way (softmax minus the one-hot target, times the
    inputs). Eager cross-entropy writes the float32 logits, their log-probabilities, and the
    gradient of each; here one block of logits at a time exists, and backward only scales. The
    matmuls run in the ambient autocast dtype, as F.linear's would, the rest in float32.
    Targets equal to IGNORE count for nothing: the mean is over the others, as F.cross_entropy's
    ignore_index makes it (a row with none counts 0, not NaN). With a soft-cap `cap`, the loss is
    of cap · tanh(z / cap) and the logits' gradient is multiplied by its derivative, 1 − tanh²."""

    # Logits per block: 16 MB of float32 on a CPU (cache-sized); 256 MB on a GPU, where each block
    # costs a few kernel launches (32k tokens of a 32k vocabulary: 16 blocks, not 256).
    BLOCK_ELEMENTS = 1 << 22
    GPU_BLOCK_ELEMENTS = 1 << 26

    @staticmethod
    def rows_per_block(vocab_size: int, cuda: bool) -> int:
        block = LinearCrossEntropy.GPU_BLOCK_ELEMENTS if cuda else LinearCrossEntropy.BLOCK_ELEMENTS
        return max(1, block // vocab_size)

    @staticmethod
    def forward(ctx, h: torch.Tensor, W: torch.Tensor, targets: torch.Tensor, cap: float = 0.0) -> torch.Tensor:
        kept = targets != IGNORE
        # Counted on the device: no host sync. Where nothing is ignored this is n, as it was.
        n = kept.sum().clamp(min=1).to(torch.float32)
        targets = targets.clamp(min=0)  # an ignored target's row is zeroed below; gather needs an index
        rows = LinearCrossEntropy.rows_per_block(W.shape[0], h.is_cuda)
        grad_h = torch.empty_like(h)
        grad_W = torch.zeros(W.shape, dtype=torch.float32, device=W.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        device = h.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
        h_mm, W_mm = h.to(dtype), W.to(dtype)  # cast once, as autocast would for F.linear
        for start in range(0, h.shape[0], rows):
            hs, ts, ks = h_mm[start:start + rows], targets[start:start + rows], kept[start:start + rows]
            logits = F.linear(hs, W_mm).float()
            if cap:
                tanh = logits.div_(cap).tanh_()
                logits = tanh * cap
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, ts[:, None]).squeeze(1)).masked_fill_(~ks, 0.0).sum()
            grad = logits.sub_(lse[:, None]).exp_()  # softmax, in the logits' memory
            grad[torch.arange(len(ts), device=grad.device), ts] -= 1.0
            if cap:
                grad.mul_(1.0 - tanh.square_())
                del tanh
            grad = grad.div_(n).masked_fill_(~ks[:, None], 0.0).to(dtype)
            grad_h[start:start + rows] = grad @ W_mm
            grad_W += grad.T @ hs
        ctx.save_for_backward(grad_h, grad_W.to(W.dtype))
        return total / n

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_W = ctx.saved_tensors
        return grad_h * grad_loss, grad_W * grad_loss, None, None

"""Helpers the model's tests share (they import torch; tests/helpers.py does not)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def assert_blockwise_loss_is_plain(model: torch.nn.Module, x: torch.Tensor, vocab: int, *, rtol: float = 1e-5,
                                   atol: float = 1e-7) -> None:
    """Training's block-wise loss of `model` on the rows `x` (LinearCrossEntropy, BLOCK_ELEMENTS set
    small by the caller) equals the plain cross-entropy of its logits, in value and in every gradient."""
    blockwise = model(x[:, :-1], x[:, 1:])
    blockwise.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    plain = F.cross_entropy(model(x[:, :-1]).view(-1, vocab), x[:, 1:].reshape(-1))
    plain.backward()
    assert torch.allclose(blockwise, plain, rtol=1e-6)
    for n, p in model.named_parameters():
        assert torch.allclose(grads[n], p.grad, rtol=rtol, atol=atol), n

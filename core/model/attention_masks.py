"""Sliding-window causal attention: each query sees its `window` most recent positions, itself included.

The layers' windows come from the config (`Config.layer_windows`: modded-nanogpt's long and short
windows). On CUDA the windowed layers run FlexAttention with a block mask, which skips the blocks
of keys the window leaves out; elsewhere (a CPU, and a prompt's prefill when decoding, whose
length changes from prompt to prompt where FlexAttention compiles for each length)
`scaled_dot_product_attention` takes the same mask written out as a (T, T) boolean matrix, cheap
at the context lengths a CPU trains on and at a prompt's. Both come from `in_window`, so they agree
(tests/test_model_options.py checks it on CPU, where FlexAttention also runs, unfused).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def in_window(q_idx: torch.Tensor, kv_idx: torch.Tensor, window: int) -> torch.Tensor:
    """Whether the query at `q_idx` may attend to the key at `kv_idx`: causal, at most window − 1 back."""
    return (q_idx >= kv_idx) & (q_idx - kv_idx < window)


def window_mask(T: int, window: int, device=None) -> torch.Tensor:
    """The (T, T) boolean mask of `in_window`, True where attention may look."""
    i = torch.arange(T, device=device)
    return in_window(i[:, None], i[None, :], window)


@functools.lru_cache(maxsize=16)
def flex_block_mask(T: int, window: int, device: str):
    """FlexAttention's BlockMask for `in_window` at length T: built once per (length, window, device)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return in_window(q_idx, kv_idx, window)
    return create_block_mask(mask_mod, None, None, T, T, device=device)


@functools.cache
def _compiled_flex():
    """flex_attention compiled once: uncompiled, it runs an unfused reference that materialises scores."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                       flex: bool = True) -> torch.Tensor:
    """Attention of (B, H, T, D) queries over (B, H_kv, T, D) keys and values within `window`;
    FlexAttention on CUDA unless `flex` is False (a prompt's prefill, whose length changes)."""
    T = q.shape[2]
    if q.is_cuda and flex:
        dtype = v.dtype  # QK-norm leaves q and k in float32 under autocast; FlexAttention wants one dtype
        return _compiled_flex()(q.to(dtype), k.to(dtype), v, block_mask=flex_block_mask(T, window, str(q.device)),
                                enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(T, window, q.device), enable_gqa=True)

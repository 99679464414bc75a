"""Batches as a pure function of (seed, global micro-batch index).

Global micro-batch index: g = step·(world·accum) + rank·accum + micro. Because a batch depends on
nothing else, resume needs no loader state and is exact, and 2 ranks × accumulation 1 see
exactly the data of 1 rank × accumulation 2. Each row is a random window of the token stream
(with replacement, as nanoGPT samples): no epoch bookkeeping, and documents mix freely.
"""

from __future__ import annotations

import numpy as np


def global_index(step: int, rank: int, micro: int, world: int, accum: int) -> int:
    return step * (world * accum) + rank * accum + micro


def window_starts(seed: int, g: int, n_tokens: int, batch_size: int, seq_len: int) -> np.ndarray:
    # SeedSequence mixes the pair properly: (seed, g) and (seed, g+1) give unrelated streams.
    rng = np.random.default_rng([seed, g])
    return rng.integers(0, n_tokens - seq_len - 1, size=batch_size, endpoint=True)


def get_batch(tokens: np.ndarray, seed: int, g: int, batch_size: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), each (batch_size, seq_len) int64, targets shifted by one token."""
    return rows_at(tokens, window_starts(seed, g, len(tokens), batch_size, seq_len), seq_len)


def eval_windows(n_tokens: int, n_batches: int, batch_size: int, seq_len: int) -> np.ndarray:
    """Window starts for evaluation: a fixed spread over the held-out tokens, the same every time,
    so validation losses are comparable from one evaluation to the next."""
    n = n_batches * batch_size
    last = n_tokens - seq_len - 1
    return np.linspace(0, last, num=n).astype(np.int64).reshape(n_batches, batch_size)


def rows_at(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    rows = np.stack([np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts])
    return rows[:, :-1], rows[:, 1:]

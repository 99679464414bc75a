"""Batches as a pure function of (seed, global micro-batch index).

Global micro-batch index: g = step·(world·accum) + rank·accum + micro; under a batch schedule the
step's first index is the batches of every step before it (core/step_schedules.py's first_batch),
a pure function of the step too. Because a batch depends on nothing else, resume needs no loader
state and is exact, and 2 ranks × accumulation 1 see exactly the data of 1 rank × accumulation 2. Each row is a random window of the token stream
(with replacement, as nanoGPT samples): no epoch bookkeeping, and documents mix freely. A
mixture's row first draws its part by weight, then its window in that part.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from .aligned_rows import AlignedTokens, aligned_batch


def global_index(step: int, rank: int, micro: int, world: int, accum: int) -> int:
    return step * (world * accum) + rank * accum + micro


def window_starts(seed: int, g: int, n_tokens: int, batch_size: int, seq_len: int) -> np.ndarray:
    # SeedSequence mixes the pair properly: (seed, g) and (seed, g+1) give unrelated streams.
    rng = np.random.default_rng([seed, g])
    return rng.integers(0, n_tokens - seq_len - 1, size=batch_size, endpoint=True)


class Mixture:
    """A mixture's training parts (token streams) and the share of rows each gets."""

    def __init__(self, parts: list, weights: list[float]):
        self.parts = parts
        self.p = np.asarray(weights, dtype=np.float64) / sum(weights)

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)


def get_batch(tokens, seed: int, g: int, batch_size: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), each (batch_size, seq_len) int64, targets shifted by one token."""
    if hasattr(tokens, "batch"):  # conversations' rows (chat_rows.ChatRows): whole rows, masked targets
        return tokens.batch(seed, g, batch_size)
    if isinstance(tokens, AlignedTokens):  # data.bos_aligned
        return aligned_batch(tokens, seed, g, batch_size, seq_len)
    if isinstance(tokens, Mixture):
        return mixture_batch(tokens, seed, g, batch_size, seq_len)
    return rows_at(tokens, window_starts(seed, g, len(tokens), batch_size, seq_len), seq_len)


def mixture_batch(mix: Mixture, seed: int, g: int, batch_size: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, g])
    which = rng.choice(len(mix.parts), size=batch_size, p=mix.p)
    rows = []
    for part in which:
        tokens = mix.parts[part]
        start = rng.integers(0, len(tokens) - seq_len - 1, endpoint=True)
        rows.append(np.asarray(tokens[start:start + seq_len + 1], dtype=np.int64))
    rows = np.stack(rows)
    return rows[:, :-1], rows[:, 1:]


def eval_windows(n_tokens: int, n_batches: int, batch_size: int, seq_len: int) -> np.ndarray:
    """Window starts for evaluation: a fixed spread over the held-out tokens, the same every time,
    so validation losses are comparable from one evaluation to the next."""
    n = n_batches * batch_size
    last = n_tokens - seq_len - 1
    return np.linspace(0, last, num=n).astype(np.int64).reshape(n_batches, batch_size)


def rows_at(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    rows = np.stack([np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts])
    return rows[:, :-1], rows[:, 1:]


class DataUnit(NamedTuple):
    """How a run draws its sequences: each step takes `per_step` batches of `rows` sequences,
    batch g = step × per_step + j (batches.global_index's numbering over the step's micro-batches).
    Fixed when the run starts and kept in its checkpoints: a resume that splits the step otherwise
    (other processes, another micro-batch) still trains on the same sequences in the same order."""
    rows: int
    per_step: int


def step_rows(draw: Callable[[int], tuple[np.ndarray, np.ndarray]], unit: DataUnit, step: int, first: int,
              count: int, start: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Sequences `first` to `first + count` of step `step`'s (0-based), as (inputs, targets);
    `draw(g)` is batch g. A micro-batch of the run's own size is one whole batch, drawn as always.
    `start`: the step's first batch where a batch schedule varies the step (step_schedules),
    else step × unit.per_step."""
    start = step * unit.per_step if start is None else start
    xs, ys = [], []
    for j in range(first // unit.rows, (first + count - 1) // unit.rows + 1):
        x, y = draw(start + j)
        lo, hi = max(first - j * unit.rows, 0), min(first + count - j * unit.rows, unit.rows)
        xs.append(x[lo:hi])
        ys.append(y[lo:hi])
    return (xs[0], ys[0]) if len(xs) == 1 else (np.concatenate(xs), np.concatenate(ys))

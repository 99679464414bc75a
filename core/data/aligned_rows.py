"""BOS-aligned training rows (`data.bos_aligned`): every row starts at a document's beginning.

The token cache puts the tokenizer's end-of-text token between documents (and modded-nanogpt's
shards one before each), so a row that starts at one of them starts with what the model sees
before a document's first token, and no row opens mid-document: modded-nanogpt's later records
draw their rows so. A row is still a window of seq_len + 1 tokens (it runs on into the documents
after, as a window does), and still a pure function of (seed, global micro-batch index g): its
start is drawn among the separators at or before the last window's start, with the generator
batches.window_starts uses, so a resume is exact and any split of a step into processes and
micro-batches sees the same rows. Validation is not aligned: its windows are fixed (batches.
eval_windows), so losses compare with unaligned runs'.
"""

from __future__ import annotations

import numpy as np

from ..config import Config, ConfigError


class AlignedTokens:
    """A token stream and the positions of its document separators (found once, on first use)."""

    def __init__(self, tokens, bos_id: int):
        self.stream, self.bos_id = tokens, bos_id
        self._starts: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.stream)

    def starts(self) -> np.ndarray:
        if self._starts is None:
            arrays = getattr(self.stream, "arrays", None) or [self.stream]
            offsets = np.cumsum([0] + [len(a) for a in arrays])
            # One shard at a time: a whole stream compared at once would need a bool per token.
            self._starts = np.concatenate([np.flatnonzero(np.asarray(a[0:len(a)]) == self.bos_id) + off
                                           for a, off in zip(arrays, offsets)]).astype(np.int64)
        return self._starts


def aligned(data, cfg: Config):
    """`data` with its training stream aligned when data.bos_aligned asks; a ConfigError where it
    cannot be (no end-of-text token, a mixture, conversations)."""
    if not cfg.data.bos_aligned:
        return data
    if data.eos_id is None:
        raise ConfigError(f"data.bos_aligned: tokenizer {cfg.tokenizer.kind} has no end-of-text token, so nothing "
                          "marks where documents begin", keys=("data.bos_aligned", "tokenizer.kind"))
    if not hasattr(data.train, "__getitem__"):
        raise ConfigError("data.bos_aligned: rows of a mixture ([[data.sources]]) are not aligned yet; set it to "
                          "false", keys=("data.bos_aligned", "data.sources"))
    data.train = AlignedTokens(data.train, data.eos_id)
    return data


def aligned_starts(tokens: AlignedTokens, seed: int, g: int, batch_size: int, seq_len: int) -> np.ndarray:
    """Batch g's row starts: separators drawn uniformly (with replacement) among those from which
    a whole window of seq_len + 1 tokens fits."""
    starts = tokens.starts()
    usable = int(np.searchsorted(starts, len(tokens) - seq_len - 1, side="right"))
    if usable == 0:
        raise ConfigError(f"data.bos_aligned: no document separator (token {tokens.bos_id}) in the training tokens "
                          f"with seq_len + 1 = {seq_len + 1} tokens after it", keys=("data.bos_aligned",))
    rng = np.random.default_rng([seed, g])
    return starts[rng.integers(0, usable, size=batch_size)]


def aligned_batch(tokens: AlignedTokens, seed: int, g: int, batch_size: int, seq_len: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) as batches.get_batch gives them, from aligned starts."""
    rows = np.stack([np.asarray(tokens.stream[s:s + seq_len + 1], dtype=np.int64)
                     for s in aligned_starts(tokens, seed, g, batch_size, seq_len)])
    return rows[:, :-1], rows[:, 1:]

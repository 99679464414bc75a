"""Which documents a run uses, and on which side: pure functions of each document's id.

Three independent hashes of the id decide, so the answer is the same on every machine, rank,
worker count and run, and no decision needs the rest of the corpus in memory:
* kept: `data.max_bytes` keeps each document with probability max_bytes / (the source's text);
* validation: a `data.val_fraction` share of the kept documents;
* the tokenizer's sample: a share of the kept training documents, enough for
  `tokenizer.train_bytes` with a margin.
A text file is one document or a few large ones, so near-copies inside it never straddle the split.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

SAMPLE_MARGIN = 4  # the tokenizer's sample draws this many times its budget's share, and stops at the budget


def fraction(salt: str, doc_id: str) -> float:
    """A uniform number in [0, 1) from the id: blake2b, the same everywhere."""
    digest = hashlib.blake2b(doc_id.encode(), digest_size=8, person=salt.encode()[:16]).digest()
    return int.from_bytes(digest, "little") / 2**64


@dataclass(frozen=True)
class Selection:
    keep: float  # share of documents kept (1: all)
    val_fraction: float
    forced_val: str = ""  # one document sent to validation when the hash sent none there

    def kept(self, doc_id: str) -> bool:
        return self.keep >= 1 or fraction("keep", doc_id) < self.keep

    def is_val(self, doc_id: str) -> bool:
        return doc_id == self.forced_val or fraction("val", doc_id) < self.val_fraction


def keep_share(max_bytes: int, text_bytes: int) -> float:
    return 1.0 if not max_bytes or max_bytes >= text_bytes else max_bytes / text_bytes


def in_tokenizer_sample(doc_id: str, share: float) -> bool:
    return share >= 1 or fraction("bpe", doc_id) < share


def sample_share(train_bytes: int, kept_train_bytes: float) -> float:
    return 1.0 if not train_bytes else min(1.0, SAMPLE_MARGIN * train_bytes / max(1.0, kept_train_bytes))

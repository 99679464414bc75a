"""Helpers the conversation tests share: a small BPE trained as a cache build trains one, and
conversation records. Plain functions (tests/test_layout.py: no test file imports another)."""

from __future__ import annotations

import json
from pathlib import Path

from lmcockpit.core.config import TokenizerConfig
from lmcockpit.core.data import sources, tokenizer

TWO_TURNS = [
    {"role": "user", "content": "Add 2 and 3."},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "Now double it."},
    {"role": "assistant", "content": "10"},
]


def trained_bpe(folder: Path, vocab_size: int = 600):
    """A byte-level BPE trained by lmcockpit's own train_bpe on the stdlib's json package, saved as
    the transformers folder a cache holds; returns the raw `tokenizers.Tokenizer`."""
    texts = [p.read_text(errors="replace") for p in sorted((sources.stdlib_root() / "json").glob("*.py"))]
    tok = tokenizer.train_bpe(texts, TokenizerConfig(vocab_size=vocab_size, train_bytes=0))
    tokenizer.save_hf_tokenizer(tok, folder, tokenizer.EOS)
    return tok


def conversation(*turns: str, system: str = "") -> dict:
    """{"messages": ...} of alternating user and assistant turns, a system message first if given."""
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return {"messages": messages}


def write_conversations(path: Path, records: list, compress: str = "") -> Path:
    """JSON lines of `records` (dicts dumped, strings written as they are), gzip-compressed with
    compress="gzip"."""
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records).encode()
    if compress == "gzip":
        import gzip

        text = gzip.compress(text, mtime=0)
    path.write_bytes(text)
    return path

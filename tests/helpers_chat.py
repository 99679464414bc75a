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


def bpe_without_turn_tokens(folder: Path, vocab_size: int = 400):
    """A byte-level BPE as lmcockpit trained them before the turn tokens were reserved (only
    <|endoftext|>, id 0), saved as a transformers folder: a base model whose tokenizer must grow."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [p.read_text(errors="replace") for p in sorted((sources.stdlib_root() / "json").glob("*.py"))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[tokenizer.EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer.save_hf_tokenizer(tok, folder, tokenizer.EOS)
    return tok


def arithmetic_conversations(path: Path, n: int = 300) -> Path:
    """`n` short two-turn conversations, each fitting a row of 65 tokens many times over."""
    return write_conversations(path, [conversation(f"Add {i} and {i + 1}.", f"def add(): return {2 * i + 1}")
                                      for i in range(n)])

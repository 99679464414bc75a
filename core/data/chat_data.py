"""A fine-tuning run's data (data.format = "chat"): its tokenizer and its conversations' rows.

The tokenizer is the base run's (the weights were trained on its ids), with the chat template's
turn tokens added where it lacks them (tokenizer.add_chat_tokens: after its last id, so every id the
base had keeps its meaning), saved in the run folder's tokenizer/ as any run's is. A resumed
fine-tuning run reads its own, which holds them already. The rows are chat_rows' cache for that
tokenizer (built once under its key's lock, by the first process of each machine).

`ChatTrainData` is what the trainer reads of a run's data (cache.TokenData's fields), with the two
sides as chat_rows.ChatRows: batches.get_batch and the validation draw rows from them, targets
IGNORE where the loss is not taken. Torch: never.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..config import Config, ConfigError
from . import tokenizer as tokenizers
from .chat_rows import ChatRows, prepare_chat


@dataclass
class ChatTrainData:
    dir: Path  # the chat-KEY cache folder
    train: ChatRows
    val: ChatRows
    vocab_size: int  # the model's embedding rows (tokenizer.vocab_size, grown where the turn tokens were added)
    token_bytes: np.ndarray
    eos_id: int | None  # the start of a conversation, as of a pretraining document
    reused: bool
    tokenizer_dir: Path  # the run folder's


def grown_vocab(tokenizer_json: Path, rows: int) -> tuple[int, int]:
    """(embedding rows a model needs to read `tokenizer_json` with the turn tokens, how many of those
    tokens it lacks): a model of `rows` rows grows only where the added ids pass its last row."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    had = tok.get_vocab_size()
    size, _ = tokenizers.add_chat_tokens(tok)
    return max(rows, size), size - had


def run_tokenizer(source: Path, run_tokenizer_dir: Path) -> Path:
    """The run folder's tokenizer.json: `source` (a tokenizer.json, in its folder) copied there, the
    turn tokens added where it lacks them. One there already (a resumed run's) is kept as it is."""
    from tokenizers import Tokenizer

    own = run_tokenizer_dir / "tokenizer.json"
    if own.is_file():
        return own
    tok = Tokenizer.from_file(str(source))
    had = tok.get_vocab_size()
    tokenizers.add_chat_tokens(tok)
    if tok.get_vocab_size() == had:  # holds them already: the very files, so the rows' cache key is the same
        shutil.copytree(source.parent, run_tokenizer_dir, dirs_exist_ok=True)
    else:
        tokenizers.save_hf_tokenizer(tok, run_tokenizer_dir, tokenizers.eos_token(tok, source.parent))
    return own


def prepare(cfg: Config, tokenizer_json: Path, log: Callable[[str], None]) -> ChatTrainData:
    """The rows of cfg's conversations by the run's tokenizer (`tokenizer_json`, the run folder's)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    if tok.get_vocab_size() > cfg.tokenizer.vocab_size:
        raise ConfigError(f"{tokenizer_json}: {tok.get_vocab_size():,} tokens, more than the model's "
                          f"tokenizer.vocab_size = {cfg.tokenizer.vocab_size:,} rows", keys=("tokenizer.vocab_size",))
    data = prepare_chat(cfg, tokenizer_json, log)
    return ChatTrainData(data.dir, data.train, data.val, cfg.tokenizer.vocab_size,
                         tokenizers.token_byte_lengths(tok, cfg.tokenizer.vocab_size),
                         tokenizers.eos_id(tok, tokenizer_json.parent), data.reused, tokenizer_json.parent)

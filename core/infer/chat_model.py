"""Whether a run or checkpoint is a chat model, in one place: what the chat pane and `lmcockpit chat` ask.

A chat model is one whose run fine-tuned it on conversations (its config's `data.format = "chat"`,
which every checkpoint's copy of the config keeps) and whose tokenizer holds the chat template's
turn tokens. Both, since either alone misleads: every BPE lmcockpit trains reserves the turn tokens,
so a base model has them but was never taught to answer; and a config alone says nothing of a
tokenizer that could not be found. A base model keeps completion mode.
Torch: never.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..config import ConfigError
from ..data.chat_template import TURN_TOKENS
from ..run.checkpoint_folder import checkpoint_config, find_checkpoint, tokenizer_file

CHAT_FORMAT = "chat"  # data.format of a run that trains on conversations


def trained_to_chat(cfg) -> bool:
    """Whether a run's config (a config.Config) trains on conversations: a live run's pane asks
    this of the config its engine started with (its tokenizer then holds the turn tokens: the
    fine-tuning run adds them where they lack)."""
    return getattr(cfg.data, "format", "text") == CHAT_FORMAT


def is_chat_model(run_or_checkpoint: str | Path) -> bool:
    """Whether the checkpoint a path names (a run folder's latest, or a checkpoint folder) is a chat
    model. False for anything that is no readable checkpoint: chat then says why, as it does today."""
    try:
        ckpt = find_checkpoint(str(run_or_checkpoint))
        cfg = checkpoint_config(ckpt)
        tokenizer = tokenizer_file(ckpt, cfg)
    except ConfigError:
        return False
    return trained_to_chat(cfg) and holds_turn_tokens(tokenizer)


def holds_turn_tokens(tokenizer_json: Path) -> bool:
    """Whether a tokenizer.json holds every turn token as a token of its own (its added tokens)."""
    try:
        added = json.loads(tokenizer_json.read_text(encoding="utf-8")).get("added_tokens") or []
        names = {t.get("content") for t in added if isinstance(t, dict)}
    except (OSError, ValueError, AttributeError, RecursionError):
        return False
    return set(TURN_TOKENS) <= names

"""The tokenizer: a byte-level BPE trained with `tokenizers`, saved as a transformers fast tokenizer.

Every BPE it trains reserves the chat template's special tokens (chat_template.RESERVED: the
end-of-text, then the four turn tokens, ids 0-4), whatever it is trained for, so that a model
pretrained on it can be fine-tuned to chat without growing; a tokenizer made before, or a
pretrained one, gains those it lacks by `add_chat_tokens`.

Encoding during training uses `tokenizers.Tokenizer` directly (it imports in milliseconds);
`transformers` is imported only to save the folder in the ecosystem's own format, once per cache.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable

import numpy as np

from ..config import ConfigError, TokenizerConfig
from . import pretrained
from .chat_template import END_OF_TEXT, RESERVED, TURN_TOKENS

EOS = END_OF_TEXT
# End-of-text by the names tokenizer families give it, for a folder whose tokenizer_config.json does
# not name one: ours, GPT-2 and Qwen; Llama 2 and Mistral; Llama 3; Gemma.
EOS_NAMES = (EOS, "</s>", "<|end_of_text|>", "<eos>")
BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")
METASPACE = "\u2581"  # SentencePiece's visible space


def train_bpe(texts: Iterable[str], cfg: TokenizerConfig):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        special_tokens=list(RESERVED),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # it draws with \r on stderr, which lands in train.log as noise
    )
    tok.train_from_iterator(_budgeted(texts, cfg.train_bytes), trainer=trainer)
    return tok


def add_chat_tokens(tok) -> tuple[int, dict[str, int]]:
    """The turn tokens `tok` lacks added to it as special tokens, after its last id: (its vocabulary's
    new size, each turn token's id). Ids it had keep their meaning; a model reading it needs
    embedding rows up to the new size (those past its own, new rows)."""
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(name, special=True, normalized=False)
                            for name in TURN_TOKENS if tok.token_to_id(name) is None])
    return tok.get_vocab_size(), {name: tok.token_to_id(name) for name in TURN_TOKENS}


def _budgeted(texts: Iterable[str], budget: int) -> Iterable[str]:
    used = 0
    for t in texts:
        if budget and used >= budget:
            return
        yield t
        used += len(t)


def load_tokenizer(kind: str, trained_dir: Path | None):
    """The raw `tokenizers.Tokenizer` of a cache folder or of a pretrained one (a local folder, or
    a Hub repo's fetched before: pretrained.fetch)."""
    from tokenizers import Tokenizer

    folder = trained_dir if kind == "bpe" else pretrained.folder(kind)
    path = folder / "tokenizer.json" if folder is not None else None
    if path is None or not path.is_file():
        where = f"{path} does not exist" if path is not None else "it is not fetched from the Hub yet"
        raise ConfigError(f"tokenizer.kind = {kind!r}: expected \"bpe\", a local folder holding tokenizer.json "
                          f"or hf:OWNER/NAME; {where}")
    return Tokenizer.from_file(str(path))


def save_hf_tokenizer(tok, folder: Path, eos: str | None) -> None:
    """Save as a transformers `PreTrainedTokenizerFast` folder (AutoTokenizer loads it offline)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos)
    hf.save_pretrained(str(folder))


def eos_token(tok, folder: Path | None) -> str | None:
    """The end-of-text token: the one `folder`'s tokenizer_config.json names, else a known name the
    vocabulary holds, else None (documents then run together and sampling stops only at its length)."""
    for name in (_configured_eos(folder), *EOS_NAMES):
        if name and tok.token_to_id(name) is not None:
            return name
    return None


def eos_id(tok, folder: Path | None) -> int | None:
    name = eos_token(tok, folder)
    return None if name is None else tok.token_to_id(name)


def _configured_eos(folder: Path | None) -> str | None:
    """The eos_token tokenizer_config.json names, else special_tokens_map.json (where older
    transformers folders keep it)."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name if folder is not None else None
        if path is None or not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError, RecursionError):
            continue  # an unreadable file names nothing; the known names still apply
        if isinstance(value, dict):  # transformers writes AddedToken as {"content": ..., ...}
            value = value.get("content")
        if isinstance(value, str):
            return value
    return None


def token_byte_lengths(tok, vocab_size: int) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for specials and unused ids), for bits per byte.

    In byte-level BPE every character of a token's string stands for exactly one byte. In
    SentencePiece-style vocabularies "▁" stands for a space and a byte-fallback token `<0xNN>` for
    one byte; the rest is the token's own UTF-8. (Metaspace's space before a document's first word
    counts one byte the text does not have: one per document, not per token.)
    """
    byte_level = _is_byte_level(tok)
    lengths = np.zeros(vocab_size, dtype=np.int64)
    specials = {t.content for t in tok.get_added_tokens_decoder().values()}
    for token, idx in tok.get_vocab().items():
        if idx >= vocab_size or token in specials:
            continue
        if byte_level:
            lengths[idx] = len(token)
        elif BYTE_FALLBACK.fullmatch(token):
            lengths[idx] = 1
        else:
            lengths[idx] = len(token.replace(METASPACE, " ").encode())
    return lengths


def _is_byte_level(tok) -> bool:
    spec = json.loads(tok.to_str())
    return "ByteLevel" in json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])

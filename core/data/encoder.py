"""Documents to token ids at corpus scale: by tiktoken where it gives the tokenizer's ids, else `tokenizers`.

It uses tiktoken where it gives the tokenizer's very ids, else
`tokenizers`, and a hashed share of documents checked against `tokenizers` as the cache is built.

The BPE is trained and saved with `tokenizers` (sampling, chat and export read that), but a
byte-level BPE encodes a corpus 3.6× faster on one core in tiktoken (bench/RESULTS.md), as nanochat
encodes with its own BPE. The two agree by construction when the BPE has tiktoken's shape: GPT-2's
split pattern (ByteLevel's regex), no normaliser, one merge per token, and merges ranked in the
order of their tokens' ids (what `tokenizers`' BpeTrainer writes), and added tokens only special
ones (a corpus's are text). Then ranks are ids. Anything else (a SentencePiece vocabulary, another
pre-tokenizer, a normaliser, an added token that is not special) is encoded by `tokenizers`.

Agreement by construction is still checked on real text: build.py compares a share of every
piece's documents, and a piece where the two differ is encoded again by `tokenizers` alone.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

# ByteLevel's regex, as tiktoken writes GPT-2's.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class Disagreement(Exception):
    """tiktoken and tokenizers gave different ids for a document."""

    def __init__(self, doc_id: str):
        super().__init__(doc_id)
        self.doc_id = doc_id


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character a byte-level vocabulary writes → the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def tiktoken_shape(spec: dict) -> str | None:
    """Why a tokenizer.json cannot be encoded by tiktoken with the same ids; None when it can."""
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or model.get("dropout") or \
            model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") or model.get("ignore_merges"):
        return "not a plain BPE model"
    if spec.get("normalizer") is not None:
        return "it has a normaliser"
    if pre.get("type") != "ByteLevel" or pre.get("add_prefix_space") or not pre.get("use_regex", True):
        return "its pre-tokenizer is not GPT-2's byte-level split"
    # tokenizers finds an added token that is not special in the text before the BPE (CodeGen's and
    # phi-2's runs of spaces); tiktoken's encode_ordinary never would.
    if any(not t.get("special", False) for t in spec.get("added_tokens") or []):
        return "it has added tokens that are not special"
    vocab, last = model.get("vocab") or {}, -1
    made: set[str] = set()
    for merge in model.get("merges") or []:
        a, b = merge if isinstance(merge, list) else merge.split(" ", 1)
        token = a + b
        if token in made or vocab.get(token, -1) <= last:
            return "its merges are not ranked like its ids"
        made.add(token)
        last = vocab[token]
    return None


def tiktoken_encoding(spec: dict):
    """The BPE of a tokenizer.json as a tiktoken Encoding (ranks = ids), or None (see tiktoken_shape)."""
    if tiktoken_shape(spec) is not None:
        return None
    import tiktoken

    alphabet = byte_level_alphabet()
    specials = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    try:
        ranks = {bytes(alphabet[ch] for ch in token): i for token, i in spec["model"]["vocab"].items()
                 if token not in specials}
    except KeyError:  # a character outside the byte-level alphabet: not a byte-level vocabulary
        return None
    if any(bytes([b]) not in ranks for b in range(256)):  # tiktoken starts every word from single bytes
        return None
    return tiktoken.Encoding("lmcockpit-bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


class Encoder:
    """One tokenizer.json, loaded once per process: ids for a batch of documents, each followed by
    the end-of-text id; `fast` uses tiktoken where the BPE allows it."""

    def __init__(self, tokenizer_json: str, eos: int | None, fast: bool = True):
        from tokenizers import Tokenizer

        self.path, self.eos = tokenizer_json, eos
        self.reference = Tokenizer.from_file(tokenizer_json)
        # A corpus's "<|endoftext|>" is text: documents end where the build puts the end-of-text
        # id, never inside one (and tiktoken's encode_ordinary reads it the same way).
        self.reference.encode_special_tokens = True
        self.tiktoken = tiktoken_encoding(json.loads(Path(tokenizer_json).read_text())) if fast else None

    def reference_only(self) -> Encoder:
        """The same tokenizer encoding by tokenizers alone, without loading it again (each load
        keeps some native memory: build.py loads one per process)."""
        slow = copy.copy(self)
        slow.tiktoken = None
        return slow

    @property
    def name(self) -> str:
        return "tiktoken" if self.tiktoken is not None else "tokenizers"

    def reference_ids(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.reference.encode_batch_fast(texts, add_special_tokens=False)]  # no offsets

    def encode(self, texts: list[str], checked: dict[int, str] | None = None) -> np.ndarray:
        """The documents' ids one after another, an end-of-text after each. `checked`: index → id of
        the documents to compare with `tokenizers` (a Disagreement names the first that differs)."""
        if self.tiktoken is None:
            lists = self.reference_ids(texts)
        else:
            lists = [self.tiktoken.encode_ordinary(t) for t in texts]
            if checked:
                order = sorted(checked)
                for i, ids in zip(order, self.reference_ids([texts[i] for i in order])):
                    if ids != lists[i]:
                        raise Disagreement(checked[i])
        flat: list[int] = []
        for ids in lists:
            flat.extend(ids)
            if self.eos is not None:
                flat.append(self.eos)
        return np.asarray(flat, dtype=np.int64)

"""Corpus encoding by tiktoken: the tokenizer's very ids, refused for a BPE of another shape, and a
piece where the two disagree encoded again by tokenizers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from lmcockpit.core.config import TokenizerConfig
from lmcockpit.core.data import encoder, sources, split, tokenizer
from lmcockpit.core.data.prepare import prepare

from .helpers import records, tiny_config, write_jsonl

TEXTS = [
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Ünïcödé façade — naïve café, 東京の夜, Ελληνικά, emoji 🐍🔥 and tabs\t\tand   spaces  \n\n",
    "It's what they'll say: don't, won't, I'd, we've, you're. 12345 67.89e-3 0xFF",
    "   leading and trailing whitespace   ", "", "\n", "a" * 5000, "<|endoftext|> is plain text here",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A byte-level BPE of 1,000 tokens trained as a cache build trains one, saved as a folder."""
    stdlib = sources.stdlib_root()
    texts = [p.read_text(errors="replace") for p in sorted((stdlib / "json").glob("*.py"))] + TEXTS
    folder = tmp_path_factory.mktemp("bpe") / "tokenizer"
    tok = tokenizer.train_bpe(texts, TokenizerConfig(vocab_size=1000, train_bytes=0))
    tokenizer.save_hf_tokenizer(tok, folder, tokenizer.EOS)
    return folder


def varied_texts(n: int, seed: int = 0) -> list[str]:
    """Documents the BPE never saw: its own tokens glued at random, and random Unicode."""
    rng = random.Random(seed)
    pieces = [t for t in TEXTS if t] + ["self", " return", "ing", "é", "🐍", "\r\n", "  ", "'s", "９"]
    out = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))) for _ in range(n)]
    out += ["".join(chr(rng.choice([rng.randint(32, 126), rng.randint(160, 0x2FFF), rng.randint(0x4E00, 0x9FFF)]))
                    for _ in range(rng.randint(1, 200))) for _ in range(n)]
    return out


def test_tiktoken_gives_the_ids_tokenizers_gives_for_a_trained_bpe(trained):
    fast = encoder.Encoder(str(trained / "tokenizer.json"), eos=0)
    slow = encoder.Encoder(str(trained / "tokenizer.json"), eos=0, fast=False)
    assert (fast.name, slow.name) == ("tiktoken", "tokenizers")
    texts = TEXTS + varied_texts(300)
    assert np.array_equal(fast.encode(texts), slow.encode(texts))
    # Each document's ids, then the end-of-text: literal "<|endoftext|>" in a text is text, not the token.
    for enc in (fast, slow):
        one = enc.encode([TEXTS[-1]])
        assert one[-1] == 0 and 0 not in one[:-1].tolist()


def test_a_bpe_tiktoken_cannot_reproduce_is_encoded_by_tokenizers(trained, tmp_path):
    spec = json.loads((trained / "tokenizer.json").read_text())
    assert encoder.tiktoken_shape(spec) is None
    normalised = {**spec, "normalizer": {"type": "NFC"}}
    assert encoder.tiktoken_shape(normalised) == "it has a normaliser"
    prefixed = {**spec, "pre_tokenizer": {**spec["pre_tokenizer"], "add_prefix_space": True}}
    assert "pre-tokenizer" in encoder.tiktoken_shape(prefixed)
    merges = spec["model"]["merges"]
    shuffled = {**spec, "model": {**spec["model"], "merges": [merges[1], merges[0], *merges[2:]]}}
    assert encoder.tiktoken_shape(shuffled) == "its merges are not ranked like its ids"
    (tmp_path / "tokenizer.json").write_text(json.dumps(normalised))
    assert encoder.Encoder(str(tmp_path / "tokenizer.json"), eos=None).name == "tokenizers"


def odd_merges_tokenizer(folder: Path) -> Path:
    """A byte-level BPE of GPT-2's shape whose merges tiktoken reads otherwise: "ab" then "bc", then
    "abc" made from "a" + "bc". tokenizers gives "ab", "c" for "abc" (no merge joins "ab" and "c");
    tiktoken joins any pair whose bytes are a token, so it goes on to "abc"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tokenizer.EOS: 0, **{ch: i + 1 for i, ch in enumerate(alphabet)}}
    merges = [("a", "b"), ("b", "c"), ("a", "bc")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([tokenizer.EOS])
    tokenizer.save_hf_tokenizer(tok, folder, tokenizer.EOS)
    return folder


@pytest.mark.slow
def test_a_piece_where_tiktoken_disagrees_is_encoded_by_tokenizers(tmp_path):
    folder = odd_merges_tokenizer(tmp_path / "odd")
    slow = encoder.Encoder(str(folder / "tokenizer.json"), eos=0, fast=False)
    fast = encoder.Encoder(str(folder / "tokenizer.json"), eos=0)
    assert fast.name == "tiktoken" and fast.encode(["abc"]).tolist() != slow.encode(["abc"]).tolist()
    texts = [f"abc {t}" for t in records(400)]
    source = write_jsonl(tmp_path / "c.jsonl", texts)
    log: list[str] = []
    cfg = tiny_config(f"data.source=\"{source}\"", f"data.cache_dir=\"{tmp_path / 'cache'}\"", "data.max_bytes=0",
                      "data.val_fraction=0.05", f"tokenizer.kind=\"{folder}\"", "tokenizer.vocab_size=300",
                      "data.shard_bytes=20_000")
    data = prepare(cfg, log.append, lambda *a: None)
    summaries = [json.loads(p.read_text()) for p in sorted((data.dir / "pieces").glob("*.json"))]
    assert len(summaries) > 2 and all(s["disagreed"] and s["encoder"] == "tokenizers" for s in summaries)
    assert any("tiktoken's ids differed from tokenizers'" in line for line in log), log
    # Every token is tokenizers': the train documents, read back in order, encoded by it alone.
    train = [t for t in texts if not split.Selection(1.0, 0.05).is_val(f"c.jsonl@{offset(texts, t)}")]
    assert np.asarray(data.train[0:len(data.train)]).tolist() == slow.encode(train).tolist()


def offset(texts: list[str], text: str) -> int:
    """A JSON line's document id is its byte offset in the file write_jsonl wrote."""
    at = 0
    for i, t in enumerate(texts):
        if t == text:
            return at
        at += len((json.dumps({"text": t, "id": i}) + "\n").encode())
    raise ValueError(text)


def test_a_bpe_with_added_tokens_that_are_not_special_is_encoded_by_tokenizers(trained, tmp_path):
    """CodeGen and phi-2 add runs of spaces as tokens that are not special: tokenizers finds them
    in the text before the BPE runs, tiktoken (which took every added token for a special one)
    would split those spaces by its merges instead."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(trained / "tokenizer.json"))
    tok.add_tokens(["    ", "\t\t"])
    tok.save(str(tmp_path / "tokenizer.json"))
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    assert encoder.tiktoken_shape(spec) == "it has added tokens that are not special"
    enc = encoder.Encoder(str(tmp_path / "tokenizer.json"), eos=0)
    assert enc.name == "tokenizers"
    texts = TEXTS + ["def f():\n    return 1\n", "x\t\ty    z"] + varied_texts(100)
    expected = [i for ids in enc.reference_ids(texts) for i in (*ids, 0)]
    assert enc.encode(texts).tolist() == expected
    assert tok.token_to_id("    ") in expected  # the added token is used

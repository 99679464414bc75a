"""A mixture, [[data.sources]]: one tokenizer for every part, each row of a batch drawn from a
part by its weight, validation over every part, and each part's budget in the run header."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer

from lmcockpit.core import protocol as P
from lmcockpit.core.config import ConfigError
from lmcockpit.core.data import batches, budget, store
from lmcockpit.core.data.prepare import prepare

from .helpers import drive_engine, tiny_config


def corpus(path, word: str, n: int):
    rng = random.Random(word)
    path.write_text("".join(json.dumps({"text": " ".join([word] * rng.randint(40, 80)) + f" {i}"}) + "\n"
                            for i in range(n)))
    return path


def mixture(tmp_path, *extra: str):
    apples = corpus(tmp_path / "apples.jsonl", "apple", 400)
    zebras = corpus(tmp_path / "zebras.jsonl", "zebra", 400)
    sources = f'[{{source="{apples}", weight=3}}, {{source="{zebras}", weight=1}}]'
    return tiny_config(f"data.sources={sources}", "data.max_bytes=0", "data.val_fraction=0.1",
                       "tokenizer.vocab_size=300", f"data.cache_dir=\"{tmp_path / 'cache'}\"", *extra)


@pytest.mark.slow
def test_a_mixture_draws_each_part_by_its_weight(tmp_path):
    cfg = mixture(tmp_path)
    logs: list[str] = []
    data = prepare(cfg, logs.append, lambda *a: None)
    tok = Tokenizer.from_file(str(data.tokenizer_dir / "tokenizer.json"))
    # one tokenizer, trained on both parts, made once and shared by both caches
    assert sum("trained the mixture's byte-level BPE" in line for line in logs) == 1
    assert sum("tokenising with the mixture's tokenizer" in line for line in logs) == 2
    assert len(tok.encode("apple zebra").ids) == 2

    rows = {"apple": 0, "zebra": 0}
    for g in range(60):
        x, _ = batches.get_batch(data.train, 1337, g, 8, 32)
        for row in x:
            text = tok.decode(row.tolist())
            [word] = [w for w in rows if w in text]  # a row comes from one part
            rows[word] += 1
    assert abs(rows["apple"] / 480 - 0.75) < 0.08, rows  # 3 : 1, within about four sigma
    # the same (seed, g), the same batch: resume stays exact
    assert (batches.get_batch(data.train, 1337, 7, 8, 32)[0] == batches.get_batch(data.train, 1337, 7, 8, 32)[0]).all()
    val = tok.decode(data.val[0:len(data.val)].tolist())
    assert "apple" in val and "zebra" in val  # validation spans every part

    again = prepare(cfg, lambda line: None, lambda *a: None)
    assert again.reused


@pytest.mark.slow
def test_a_mixture_run_says_each_part_s_budget(tmp_path):
    cfg = mixture(tmp_path, "training.max_steps=2000")
    _, events = drive_engine(cfg, tmp_path / "run", set_up_then=[P.Abort(save=False)])
    lines = [e.text for e in events if isinstance(e, P.LogLine)]
    budget = lines.index(next(line for line in lines if line.startswith("token budget: ")))
    apples, apples_warning, zebras, zebras_warning = lines[budget + 1:budget + 5]
    assert "apples.jsonl: 75% of the tokens, 768k of its" in apples and apples.endswith(" epochs")
    assert "zebras.jsonl: 25% of the tokens, 256k of its" in zebras
    # 22k train tokens a part: both repeat past 4 epochs, the heavier one three times as often
    assert "apples.jsonl: warning: " in apples_warning and "zebras.jsonl: warning: " in zebras_warning
    # each warning names what to change for its own part
    assert "(data.sources[0].source, or a lower data.sources[0].weight)" in apples_warning
    assert "(data.sources[1].source, or a lower data.sources[1].weight)" in zebras_warning
    epochs = [float(line.split(", ")[-1].split()[0]) for line in (apples, zebras)]
    assert 2.5 < epochs[0] / epochs[1] < 3.5


@pytest.mark.slow
def test_each_part_s_budget_is_estimated_then_counted_from_its_cache(tmp_path):
    cfg = mixture(tmp_path, "training.max_steps=2000")
    before = budget.parts(cfg)
    assert [(p.source.rsplit("/", 1)[-1], p.share) for p in before] == [("apples.jsonl", 0.75), ("zebras.jsonl", 0.25)]
    assert [p.budget.run_tokens for p in before] == [768_000, 256_000]  # the weights' shares of 2000 steps
    assert not any(p.budget.exact or p.cache for p in before)
    assert all("of its about " in p.line() and p.line().endswith(" epochs") for p in before)

    data = prepare(cfg, lambda line: None, lambda *a: None)
    after = budget.parts(cfg)
    # exact: each part's own cache, made with the mixture's shared tokenizer, found as prepare finds it
    assert [p.budget.source_tokens for p in after] == [len(s) for s in data.train.parts]
    assert all(p.budget.exact for p in after)
    for part in after:
        assert store.read_meta(tmp_path / "cache" / part.cache)["source"].endswith(part.source.rsplit("/", 1)[-1])
    assert all(0.5 < b.budget.source_tokens / a.budget.source_tokens < 2 for b, a in zip(before, after))
    # the run header says the same, part for part; the launch screen's one line is the worst part's
    lines = budget.header(cfg, data.train)
    assert lines[1:] == [line for p in after for line in (f"  {p.source}: {p.line()}",
                                                          *([f"  {p.source}: {p.warning()}"]
                                                            if p.warning() else []))]
    whole = budget.estimate(cfg)
    assert whole.exact and whole.epochs == pytest.approx(max(p.budget.epochs for p in after), rel=1e-4)


def test_a_missing_part_is_named_by_its_index(tmp_path):
    apples = corpus(tmp_path / "apples.jsonl", "apple", 50)
    cfg = tiny_config(f'data.sources=[{{source="{apples}"}}, {{source="{tmp_path / "gone"}"}}]')
    with pytest.raises(ConfigError, match=r"^data.sources\[1\].source = '.*gone': no such file or folder"):
        prepare(cfg, lambda line: None, lambda *a: None)


@pytest.mark.parametrize("override, message", [
    ('data.sources=[{source="a", weight=0}]', r"data.sources\[0\].weight = 0.0 must be positive"),
    ('data.sources=[{sorce="a"}]', r"unknown key data.sources\[0\].sorce \(did you mean data.sources\[0\].source\?\)"),
    ('data.sources=[{weight=2.0}]', r"data.sources\[0\].source is missing"),
    ('data.sources=["a"]', r"data.sources must be a list of tables"),
])
def test_bad_mixtures_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(override)
    with pytest.raises(ConfigError, match="with \\[\\[data.sources\\]\\] each part names its own"):
        tiny_config('data.sources=[{source="a"}]', 'data.source="b"')


@pytest.mark.slow
def test_a_mixture_s_bpe_learns_from_all_of_each_part_when_train_bytes_is_0(tmp_path):
    """tokenizer.train_bytes = 0 means all of the text, for a mixture's parts as for a single source
    (it was a budget of one byte a part: a BPE of no merges, logged as a full vocabulary)."""
    from lmcockpit.core.data import build, sources
    from lmcockpit.core.data.prepare import mixture_tokenizer

    cfg = mixture(tmp_path, "tokenizer.train_bytes=0")
    parts = cfg.data_parts()
    listed = [sources.list_source(part.data) for part in parts]
    logs, said = [], []
    path = mixture_tokenizer(cfg, parts, listed, logs.append, lambda *a: said.append(a))
    every_byte = sum(int(build.plan(part.data, s).kept_bytes) for part, s in zip(parts, listed))
    assert said[0] == ("training tokenizer", 0, every_byte, "bytes")
    tok = Tokenizer.from_file(str(path))
    assert len(tok.encode("apple zebra").ids) == 2  # each part's word learned whole
    [line] = [line for line in logs if "trained the mixture's byte-level BPE" in line]
    assert f"BPE of {tok.get_vocab_size()} tokens on {every_byte / 1e6:.1f} MB from 2 sources" in line

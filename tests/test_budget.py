"""The token budget: what a run's steps make of its source, said before and when it trains."""

from __future__ import annotations

import re

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.data import budget
from lmcockpit.core.data.prepare import prepare

from .helpers import cli, drive_engine, tiny_config


@pytest.mark.slow
def test_the_estimate_before_a_cache_and_the_exact_count_after(tmp_path):
    cfg = tiny_config(f"data.cache_dir=\"{tmp_path}\"", "data.max_bytes=300_000", "training.max_steps=100")
    before = budget.estimate(cfg)
    assert not before.exact and before.run_tokens == 100 * cfg.tokens_per_step
    data = prepare(cfg, lambda line: None, lambda *a: None)
    after = budget.estimate(cfg)
    assert after.exact and after.source_tokens == len(data.train)
    assert 0.5 < before.source_tokens / after.source_tokens < 2  # bytes per token guessed, not known
    assert after.epochs == 100 * cfg.tokens_per_step / len(data.train)
    assert "token budget: 51.2k tokens" in after.line() and f"{after.epochs:.2g} epochs" in after.line()


def test_many_compressed_shards_are_estimated_from_a_spread_sample_of_them(tmp_path):
    """The launch screen estimates its source's tokens at every change of preset or setting: it
    reads at most budget.SAMPLED compressed files, not thousands. A damaged shard outside the
    sample is left for the build to name; the estimate holds within a few percent."""
    import gzip
    import json

    import pytest

    from lmcockpit.core.config import ConfigError, DataConfig
    from lmcockpit.core.data import readers, sources

    from .helpers import records

    for i in range(40):
        text = "".join(json.dumps({"text": t}) + "\n" for t in records(30 + 5 * i, seed=i))
        (tmp_path / f"shard-{i:02d}.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    listed = sources.list_source(DataConfig(source=str(tmp_path)))
    exact = sum(readers.text_bytes(f, "text") for f in listed.files)
    assert 0.97 < budget.estimated_text(listed, "text") / exact < 1.03
    read = readers.text_bytes.cache_info().misses
    budget.estimated_text(listed, "text")  # the launch screen's next keypress: nothing decompressed again
    assert readers.text_bytes.cache_info().misses == read
    few = sources.Source(listed.desc, listed.files[:budget.SAMPLED], False)
    assert budget.estimated_text(few, "text") == sum(readers.text_bytes(f, "text") for f in few.files)

    damaged = listed.files[1].path
    damaged.write_bytes(damaged.read_bytes()[:-200])
    relisted = sources.list_source(DataConfig(source=str(tmp_path)))  # its new size: not the estimate kept
    with pytest.raises(ConfigError, match="damaged or truncated gzip"):
        readers.text_bytes(relisted.files[1], "text")
    assert 0.97 < budget.estimated_text(relisted, "text") / exact < 1.03


def test_a_file_that_cannot_be_read_is_said_not_raised(tmp_path):
    """A compressed shard that cannot be read when its text is estimated (no permission; here,
    moved away after the launch screen listed its source, a listing it keeps for the session) is
    that part's problem, named as a missing source is, not an error out of the count."""
    import gzip
    import json

    from .helpers import records

    for i in range(3):
        text = "".join(json.dumps({"text": t}) + "\n" for t in records(40, seed=i))
        (tmp_path / f"shard-{i}.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    cfg = tiny_config(f'data.source="{tmp_path}"')
    budget._listing(str(tmp_path))  # listed, and kept
    (tmp_path / "shard-1.jsonl.gz").unlink()
    [part] = budget.parts(cfg)
    assert part.budget.epochs is None
    assert part.problem == f"{tmp_path / 'shard-1.jsonl.gz'}: cannot be read (No such file or directory)"
    assert part.problem in part.short()


def test_many_epochs_warn_and_say_what_to_do():
    few = budget.Budget(run_tokens=4_000_000, source_tokens=1_000_000, exact=True, n_params=10**6)
    many = budget.Budget(run_tokens=4_100_000, source_tokens=1_000_000, exact=True, n_params=10**6)
    assert few.warning() is None
    assert "4 epochs over the same 1M tokens" in many.warning() and "data.max_bytes" in many.warning()
    assert budget.Budget(100, None, False, 10).warning() is None  # a Hub source not fetched: unknown


@pytest.mark.slow
def test_a_run_says_its_budget_and_warns_when_it_repeats_its_source(tmp_path):
    cfg = tiny_config("data.max_bytes=40_000", "training.max_steps=500")
    _, events = drive_engine(cfg, tmp_path / "run", set_up_then=[P.Abort(save=False)])
    lines = [e.text for e in events if isinstance(e, P.LogLine)]
    [line] = [line for line in lines if line.startswith("token budget: ")]
    assert "256k tokens" in line and " epochs" in line
    assert any(line.startswith("warning: ") and "epochs over the same" in line for line in lines), lines


@pytest.mark.slow
def test_presets_say_the_epochs_of_each(tmp_path):
    out = cli("presets").stdout
    assert "Epochs of its source each preset's steps make" in out
    assert re.search(r"\bcpu 0\.[12]\d?\b", out) and "3090 –" in out  # the stdlib; FineWeb-Edu, not fetched yet


def test_many_epochs_are_written_as_people_write_them():
    """.2g wrote 123 epochs as 1.2e+02, and an estimate of 70 (one figure) as 7e+01."""
    counted = budget.Budget(run_tokens=123_000_000, source_tokens=1_000_000, exact=True, n_params=10**6)
    estimated = budget.Budget(run_tokens=70_400_000, source_tokens=1_000_000, exact=False, n_params=10**5)
    assert "1M train tokens, 120 epochs" in counted.line() and "(120 per parameter;" in counted.line()
    assert " · 120 epochs of its source · 120/param" in counted.short()
    assert " · ≈70 epochs of its source · 700/param" in estimated.short()
    assert "e+" not in counted.line() + estimated.line() + counted.short() + estimated.short()

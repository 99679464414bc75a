"""What a run's step budget makes of its source: tokens held, epochs made of them, tokens per parameter.

How many tokens the source holds, how many epochs
the run will make of them, and tokens per parameter (compute-optimal is about 20, after
Chinchilla). Said in every run's header, in `lmcockpit presets` and on the launch screen, with a
warning past MANY_EPOCHS, where the model learns its corpus by heart rather than the language.

A mixture's parts each get the same: the share of the run's tokens its weight gives it, its own
train tokens, the epochs those make (`parts`); where one line must do, its most repeated part
speaks for it. `lmcockpit data info PRESET` shows every part.

Exact once a cache exists (its train tokens); before that an estimate from the text's size. A Hub
source is read from what was fetched before, never the network. No numpy: the front-end reads it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from ..config import Config, ConfigError, DataConfig, SourcePart
from ..hardware.memory_estimate import param_counts
from . import sources, split, token_shards
from ..step_schedules import run_tokens
from .readers import sized_by_reading, text_bytes
from .store import find_cache, mixture_tokenizer_folder, read_meta

COMPUTE_OPTIMAL = 20  # tokens per parameter
MANY_EPOCHS = 4
BYTES_PER_TOKEN = 4.0  # before a cache exists (a BPE of 8k on Python code gives 3.5; larger ones on prose, more)


@dataclass(frozen=True)
class Budget:
    run_tokens: int  # what the run's steps take: max_steps × tokens per step
    source_tokens: int | None  # the source's train tokens; None: not known before it is fetched
    exact: bool
    n_params: int

    @property
    def epochs(self) -> float | None:
        return None if not self.source_tokens else self.run_tokens / self.source_tokens

    @property
    def tokens_per_param(self) -> float:
        return self.run_tokens / max(1, self.n_params)

    def head(self) -> str:
        """What the run's steps take, said alone where its parts follow (a mixture's)."""
        return (f"token budget: {_count(self.run_tokens)} tokens ({_figures(self.tokens_per_param)} per parameter; "
                f"compute-optimal is about {COMPUTE_OPTIMAL})")

    def line(self) -> str:
        about = "" if self.exact else "about "
        held = ("its source is not fetched yet" if self.source_tokens is None else
                f"the source holds {about}{_count(self.source_tokens)} train tokens, "
                f"{about}{_figures(self.epochs)} epochs")
        return f"{self.head()}; {held}"

    def short(self, each: list[Part] | None = None) -> str:
        """One line for a narrow place (the launch screen's settings border); with a mixture's
        parts (`each`), the epochs of every part in their order."""
        # An estimate is worth one figure: the launch screen shows the same on nearby Pythons.
        if each is not None and len(each) > 1:
            epochs = "epochs by part: " + ", ".join(p.budget.epoch_figure() for p in each)
        elif self.epochs is None:
            epochs = "source not fetched yet"
        else:
            epochs = f"{self.epoch_figure()} epochs of its source"
        return f"{_count(self.run_tokens)} tokens · {epochs} · {_figures(self.tokens_per_param)}/param"

    def epoch_figure(self) -> str:
        """The epochs in a few characters: two figures when counted, one (≈) when estimated."""
        if self.epochs is None:
            return "–"  # not known: a Hub source not fetched yet, a source that cannot be read
        return _figures(self.epochs) if self.exact else "≈" + _figures(self.epochs, 1)

    def warning(self, more_text: str = "data.source, a larger data.max_bytes") -> str | None:
        if self.epochs is None or self.epochs <= MANY_EPOCHS:
            return None
        return (f"warning: {self.epochs:.0f} epochs over the same {_count(self.source_tokens)} tokens: past "
                f"{MANY_EPOCHS} the model memorises its corpus. Give it more text ({more_text}) or fewer steps "
                "(training.max_steps)")


@dataclass(frozen=True)
class Part:
    """One part of a run's data (a single source is one part) and what the run makes of it."""
    source: str  # as the config names it
    share: float  # of the run's training tokens: its weight over the sum of the weights
    budget: Budget  # run_tokens: what the run draws from this part; source_tokens: its train tokens
    cache: str | None = None  # the key of the complete token cache it would train on, if there is one
    problem: str | None = None  # why its tokens are unknown (not fetched yet, no such file, ...)
    key: str = "data.source"  # the config key that names it: data.source, or data.sources[i]

    def warning(self) -> str | None:
        if self.key == "data.source":
            return self.budget.warning()
        return self.budget.warning(f"{self.key}.source, or a lower {self.key}.weight")

    def line(self) -> str:
        """Its share and what that makes of its tokens: "75% of the tokens, 768k of its 22.1k train
        tokens, 35 epochs"."""
        b, about = self.budget, "" if self.budget.exact else "about "
        taken = f"{self.share:.0%} of the tokens, {_count(b.run_tokens)}"
        if b.epochs is None:
            return f"{taken}: {self.problem or 'its train tokens are unknown'}"
        return f"{taken} of its {about}{_count(b.source_tokens)} train tokens, {about}{_figures(b.epochs)} epochs"

    def short(self) -> str:
        """In a table's cell, what matters first: "25%: 0.43 epochs of 90.2k tokens" (≈ where estimated)."""
        b = self.budget
        if b.epochs is None:
            return f"{self.share:.0%}: {self.problem or 'train tokens unknown'}"
        about = "" if b.exact else "≈"
        return f"{self.share:.0%}: {b.epoch_figure()} epochs of {about}{_count(b.source_tokens)} tokens"


def _figures(x: float, n: int = 2) -> str:
    """`x` to `n` significant figures, as people write them: 120 epochs, not 1.2e+02."""
    return f"{float(f'{x:.{n}g}'):g}"


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


@functools.lru_cache(maxsize=8)
def _listing(source: str) -> sources.Source:
    """A source's files, listed once per front-end process: the launch screen asks again at every
    preset it passes, and the standard library's 1,700 files take a third of a second. A Hub
    source is listed from what was fetched before: nothing here goes to the network."""
    return sources.list_source(DataConfig(source=source), fetch=False)


def parts(cfg: Config, train_tokens: list[int] | None = None) -> list[Part]:
    """Each part of the run's data (a single source is one part): its share of the run's tokens,
    its train tokens and the epochs the run makes of them. `train_tokens`: each part's, counted
    (a run's open caches); without them, each part's cache's count where it exists, else an
    estimate from its text's size."""
    run, n = run_tokens(cfg), param_counts(cfg).total
    specs = cfg.data.sources or [SourcePart(cfg.data.source, cfg.data.text_field)]
    total = sum(spec.weight for spec in specs)
    held = [_Held(t, True) for t in train_tokens] if train_tokens is not None else _held(cfg)
    return [Part(spec.source, spec.weight / total, Budget(int(run * spec.weight / total), h.tokens, h.exact, n),
                 h.cache, h.problem, f"data.sources[{i}]" if cfg.data.sources else "data.source")
            for i, (spec, h) in enumerate(zip(specs, held))]


def whole(cfg: Config, each: list[Part]) -> Budget:
    """The run's budget in one: a single source's own; a mixture's most repeated part speaks for
    it (its train tokens as if the whole run drew from it at its rate); unknown if any part is."""
    run, n = run_tokens(cfg), param_counts(cfg).total
    if any(p.budget.epochs is None for p in each):
        return Budget(run, None, False, n)
    worst = max(each, key=lambda p: p.budget.epochs)
    return Budget(run, int(worst.budget.source_tokens / worst.share), all(p.budget.exact for p in each), n)


def header(cfg: Config, train) -> list[str]:
    """The run header's lines about its data: the budget, then for a mixture each part's share, its
    tokens and the epochs its weight makes of them; a warning for what repeats past MANY_EPOCHS."""
    streams = getattr(train, "parts", None)  # a batches.Mixture's train streams, one per [[data.sources]]
    # conversations' rows (chat_rows.ChatRows) count their positions: a row is not a token
    each = parts(cfg, [len(s) for s in streams] if streams is not None else [getattr(train, "tokens", len(train))])
    budget = whole(cfg, each)
    if streams is None:
        return [budget.line(), *filter(None, [budget.warning()])]
    lines = [budget.head()]
    for part in each:
        lines.append(f"  {part.source}: {part.line()}")
        if part.warning():
            lines.append(f"  {part.source}: {part.warning()}")
    return lines


def estimate(cfg: Config) -> Budget:
    """Before training: the cache's train tokens if it exists, else an estimate from the text's
    size. A Hub source not fetched yet is left unknown (nothing goes to the network here)."""
    return whole(cfg, parts(cfg))


@dataclass(frozen=True)
class _Held:
    """What a part holds, as far as it is known before training."""
    tokens: int | None
    exact: bool
    cache: str | None = None
    problem: str | None = None


def _held(cfg: Config) -> list[_Held]:
    if cfg.data.format == "tokens":
        return [_shards_held(cfg)]
    configs = cfg.data_parts()
    listed: list[sources.Source | str] = [_listed(c.data.source) for c in configs]
    caches = _caches(cfg, configs, listed)
    out = []
    for part, source, cache in zip(configs, listed, caches):
        if isinstance(source, str):
            out.append(_Held(None, False, problem=source))
        elif cache is not None:
            out.append(_Held(read_meta(cache)["train_tokens"], True, cache.name))
        else:
            try:
                out.append(_Held(_estimated_tokens(part, source), False))
            except ConfigError as e:  # a damaged file, a missing column: said, as a missing source is
                out.append(_Held(None, False, problem=str(e)))
            except OSError as e:  # unreadable, or gone since it was listed (the listing is kept)
                out.append(_Held(None, False, problem=f"{e.filename or source.desc}: cannot be read "
                                                      f"({e.strerror or e})"))
    return out


def _shards_held(cfg: Config) -> _Held:
    """data.format = "tokens": what the shards' headers say, of those there (fetched before)."""
    try:
        files = token_shards.train_files(cfg, run_tokens(cfg), fetch=False)
        return _Held(sum(token_shards.shard_tokens(f) for f in files), True)
    except ConfigError as e:
        return _Held(None, False, problem=str(e).split(": ", 1)[-1])


def _listed(source: str) -> sources.Source | str:
    """The source listed, or what stops it being read (the error without its `data.source = ...:`)."""
    try:
        return _listing(source)
    except ConfigError as e:
        return str(e).split(": ", 1)[-1]
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"


def _caches(cfg: Config, configs: list[Config], listed: list) -> list[Path | None]:
    """Each part's complete cache, found as prepare finds it. A mixture's parts are tokenised with
    the BPE they share (unless the tokenizer is pretrained): before it exists, none of theirs does."""
    tokenizer_file = None
    if cfg.data.sources and cfg.tokenizer.kind == "bpe":
        if not all(isinstance(s, sources.Source) for s in listed):
            return [None] * len(listed)  # the shared BPE's key covers every part's files
        tokenizer_file = mixture_tokenizer_folder(cfg, listed) / "tokenizer.json"
        if not tokenizer_file.is_file():
            return [None] * len(listed)
    return [find_cache(part, source, tokenizer_file) if isinstance(source, sources.Source) else None
            for part, source in zip(configs, listed)]


def _estimated_tokens(cfg: Config, source: sources.Source) -> int:
    """Train tokens from the text's size: what max_bytes keeps, less validation, at BYTES_PER_TOKEN."""
    text = estimated_text(source, cfg.data.text_field)
    kept = text * split.keep_share(cfg.data.max_bytes, text) * (1 - cfg.data.val_fraction)
    return int(kept / BYTES_PER_TOKEN)


SAMPLED = 16  # read files (compressed, Parquet) whose text is read for an estimate; the rest at their ratio


def estimated_text(source: sources.Source, text_field: str) -> int:
    """The source's text before it is prepared: a plain file's size, and for the files whose text
    must be read to be known (compressed: decompressed in part; Parquet: its footer) the text of
    at most SAMPLED of them, spread over the source, per byte of file, times all of theirs. Every
    one of them read took most of a minute for a few thousand shards, on the launch screen's every
    change of preset or setting; a build reads them all (build.text_sizes)."""
    read = [f for f in source.files if sized_by_reading(f)]
    plain = sum(f.size for f in source.files if not sized_by_reading(f))
    if len(read) <= SAMPLED:
        return plain + sum(text_bytes(f, text_field) for f in read)
    sample = [read[i * len(read) // SAMPLED] for i in range(SAMPLED)]
    per_byte = sum(text_bytes(f, text_field) for f in sample) / max(1, sum(f.size for f in sample))
    return plain + int(per_byte * sum(f.size for f in read))

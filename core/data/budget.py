"""What a run's step budget makes of its source: how many tokens the source holds, how many epochs
the run will make of them, and tokens per parameter (compute-optimal is about 20, after
Chinchilla). Said in every run's header, in `lmcockpit presets` and on the launch screen, with a
warning past MANY_EPOCHS, where the model learns its corpus by heart rather than the language.

Exact once the cache exists (its train tokens); before that an estimate from the text's size.
No numpy: the front-end reads it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from ..config import Config, ConfigError, DataConfig
from ..hardware.fit import param_counts
from . import sources, split
from .readers import text_bytes
from .store import cache_key, cache_root, read_meta

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

    def line(self) -> str:
        about = "" if self.exact else "about "
        held = ("its source is not fetched yet" if self.source_tokens is None else
                f"the source holds {about}{_count(self.source_tokens)} train tokens, "
                f"{about}{self.epochs:.2g} epochs")
        return (f"token budget: {_count(self.run_tokens)} tokens ({self.tokens_per_param:.2g} per parameter; "
                f"compute-optimal is about {COMPUTE_OPTIMAL}); {held}")

    def short(self) -> str:
        """One line for a narrow place (the launch screen's settings border)."""
        # An estimate is worth one figure: the launch screen shows the same on nearby Pythons.
        epochs = "source not fetched yet" if self.epochs is None else (
            f"{self.epochs:.2g} epochs of its source" if self.exact else f"≈{self.epochs:.1g} epochs of its source")
        return f"{_count(self.run_tokens)} tokens · {epochs} · {self.tokens_per_param:.2g}/param"

    def warning(self) -> str | None:
        if self.epochs is None or self.epochs <= MANY_EPOCHS:
            return None
        return (f"warning: {self.epochs:.0f} epochs over the same {_count(self.source_tokens)} tokens: past "
                f"{MANY_EPOCHS} the model memorises its corpus. Give it more text (data.source, a larger "
                "data.max_bytes) or fewer steps (training.max_steps)")


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


@functools.lru_cache(maxsize=8)
def _listing(source: str) -> sources.Source:
    """A source's files, listed once per front-end process: the launch screen asks again at every
    preset it passes, and the standard library's 1,700 files take a third of a second."""
    return sources.list_source(DataConfig(source=source))


def of_run(cfg: Config, train_tokens: int) -> Budget:
    """A prepared run's budget: its cache's train tokens are known."""
    return Budget(cfg.training.max_steps * cfg.tokens_per_step, train_tokens, True, param_counts(cfg).total)


def header(cfg: Config, train) -> list[str]:
    """The run header's lines about its data: the budget, then for a mixture each part's share, its
    tokens and the epochs its weight makes of them; a warning for what repeats past MANY_EPOCHS."""
    whole = of_run(cfg, len(train))
    parts = getattr(train, "parts", None)  # a batches.Mixture's train streams, one per [[data.sources]]
    if parts is None:
        return [whole.line(), *filter(None, [whole.warning()])]
    lines, total = [whole.line().split("; the source holds")[0]], sum(p.weight for p in cfg.data.sources)
    for spec, stream in zip(cfg.data.sources, parts):
        part = Budget(int(whole.run_tokens * spec.weight / total), len(stream), True, whole.n_params)
        lines.append(f"  {spec.source}: {spec.weight / total:.0%} of the tokens, {_count(part.run_tokens)} of its "
                     f"{_count(len(stream))} train tokens, {part.epochs:.2g} epochs")
        if part.warning():
            lines.append(f"  {spec.source}: {part.warning()}")
    return lines


def estimate(cfg: Config) -> Budget:
    """Before training: the cache's train tokens if it exists, else an estimate from the text's
    size. A Hub source not fetched yet is left unknown (nothing goes to the network here)."""
    run, n = cfg.training.max_steps * cfg.tokens_per_step, param_counts(cfg).total
    if cfg.data.sources:  # a mixture: its most repeated part speaks for it
        total = sum(p.weight for p in cfg.data.sources)
        parts = [(estimate(dataclasses.replace(cfg, data=dataclasses.replace(
            cfg.data, source=p.source, text_field=p.text_field, sources=[]))), p.weight / total)
            for p in cfg.data.sources]
        if any(b.source_tokens is None for b, _ in parts):
            return Budget(run, None, False, n)
        worst = max(share / b.source_tokens for b, share in parts)
        return Budget(run, int(1 / worst), all(b.exact for b, _ in parts), n)
    if cfg.data.source.startswith("hf:"):
        return Budget(run, None, False, n)
    try:
        source = _listing(cfg.data.source)
    except (ConfigError, OSError):
        return Budget(run, None, False, n)
    meta = read_meta(cache_root(cfg) / cache_key(cfg, source))
    if meta is not None:
        return Budget(run, meta["train_tokens"], True, n)
    text = sum(text_bytes(f, cfg.data.text_field) for f in source.files)
    kept = text * split.keep_share(cfg.data.max_bytes, text) * (1 - cfg.data.val_fraction)
    return Budget(run, int(kept / BYTES_PER_TOKEN), False, n)

"""`lmcockpit data`: token caches ahead of training, and what a preset's run makes of its data.

* `data prepare PRESET [--set K=V ...]` prepares the preset's token cache now, with a progress bar
  on a terminal (plain lines when piped) and a summary; Ctrl-C or a kill keeps what is finished,
  and the same command resumes. Training prepares on its own when no cache exists.
* `data info` lists the caches: key, source, vocabulary, tokens, size, age, complete or partial.
  `data info PRESET [--set K=V ...]` first says what a run of the preset makes of its data: the
  token budget, then each source (a mixture's every part): its share of the tokens, its train
  tokens (counted once its cache exists, else estimated), the epochs, and its cache.
* `data rm KEY` removes one (a unique prefix of its key will do).

Listing, the run's data and removing import no numpy or tokenizers, and never go to the network
(a Hub source not fetched yet says so); `prepare` does, once it runs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from rich.console import Console

from ...core.config import Config, load_config
from ...core.data import store
from ...core.data.sources import NOT_FETCHED
from .. import completers
from . import command_parser
from ..formatting import fmt_count, fmt_duration
from ..usage import Parser, UsageError, new_console


def build_parser() -> argparse.ArgumentParser:
    p = command_parser(__name__, description=__doc__.split("\n\n")[0].replace("`", "").rstrip("."))
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=Parser)
    prep = sub.add_parser("prepare", help="prepare a preset's token cache now (resumes a killed one)",
                          description="Prepare a preset's token cache ahead of training.")
    prep.add_argument("preset", metavar="PRESET", help="a preset TOML path or a shipped preset name"
                      ).completer = completers.presets
    info = sub.add_parser(
        "info", help="list the token caches; with a preset, first what its run makes of each source",
        description="List the token caches. With a PRESET, first the data a run of it trains on: the token "
                    "budget, then each source (each part of a mixture): its share of the tokens, its train tokens "
                    "(counted once its cache exists, else estimated: 'about'), the epochs the run makes of them, "
                    "and its cache. Nothing is fetched or prepared.")
    info.add_argument("preset", metavar="PRESET", nargs="?", help="a preset TOML path or a shipped preset name"
                      ).completer = completers.presets
    for parser in (prep, info):
        parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                            help="override a config key, VALUE in TOML syntax (repeatable): --set data.workers=8"
                            ).completer = completers.config_keys
    rm = sub.add_parser("rm", help="remove a token cache", description="Remove a token cache.")
    rm.add_argument("key", metavar="KEY", help="the cache's key, as `lmcockpit data info` lists it (a unique "
                                              "prefix will do)")
    for parser in (info, rm):
        parser.add_argument("--cache-dir", metavar="DIR", help="where the caches are (default: "
                            "$XDG_CACHE_HOME/lmcockpit, as training uses; with a PRESET, its data.cache_dir)"
                            ).completer = completers.directories
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.action == "prepare":
        return prepare(load_config(args.preset, args.overrides)[0], again(args.preset, args.overrides))
    if args.action == "info" and args.preset is not None:
        return run_info(args.preset, args.overrides, args.cache_dir)
    if args.action == "info" and args.overrides:
        raise UsageError("--set changes a preset's settings: name the PRESET first "
                         "(lmcockpit data info cpu --set training.max_steps=5000)")
    root = store.cache_root(Config()) if args.cache_dir is None else Path(args.cache_dir).expanduser()
    return info(root) if args.action == "info" else rm(root, args.key)


def plain_console() -> Console:
    """Where this command prints: what it says names the user's files, folders, sources and
    settings, and a cache's source is whatever its meta.json holds, so none of it is read as Rich
    markup (a folder `corpus[/x]` is no closing tag) or emoji codes (`:fire:`)."""
    return new_console(markup=False)


class Progress:
    """The build's progress: a bar on a terminal, a line per stage and every tenth when piped."""

    def __init__(self, console: Console):
        self.console, self.stage, self.tenth, self.t0 = console, "", -1, time.monotonic()
        self.bar = None
        if console.is_terminal:
            from rich.progress import (BarColumn, DownloadColumn, Progress as Bar, ProgressColumn, TaskProgressColumn,
                                       TextColumn, TimeRemainingColumn, TransferSpeedColumn)
            from rich.text import Text

            class InBytes(ProgressColumn):
                """`column` for a stage counted in bytes; for one counted in files, `other`'s text."""

                def __init__(self, column, other=lambda task: ""):
                    super().__init__()
                    self.column, self.other = column, other

                def render(self, task):
                    return self.column.render(task) if task.fields["unit"] == "bytes" else Text(self.other(task))

            counted = InBytes(DownloadColumn(), lambda t: f"{t.completed:,.0f}/{t.total:,.0f} {t.fields['unit']}")
            self.bar = Bar(TextColumn("{task.description}", markup=False), BarColumn(), TaskProgressColumn(), counted,
                           InBytes(TransferSpeedColumn()), TimeRemainingColumn(), console=console, transient=True)
            self.bar.start()
            self.task = None

    def __call__(self, stage: str, done: int, total: int, unit: str) -> None:
        if self.bar is not None:
            if stage != self.stage:
                if self.task is not None:
                    self.bar.remove_task(self.task)
                self.task = self.bar.add_task(stage, total=total, unit=unit)
            self.bar.update(self.task, completed=done, total=total)
        else:
            tenth = int(10 * done / max(1, total))
            if stage != self.stage or tenth > self.tenth:
                mb = done / 1e6
                rate = mb / max(1e-9, time.monotonic() - self.t0)
                amount = f" ({mb:.1f} MB, {rate:.1f} MB/s)" if unit == "bytes" else ""
                self.console.print(f"{stage}: {done / max(1, total):.0%} of {fmt_count(total)} {unit}{amount}")
                self.tenth = tenth
        if stage != self.stage:
            self.stage, self.t0 = stage, time.monotonic()

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def prepare(cfg: Config, again: str) -> int:
    """`again`: the arguments that run it once more, said when it is interrupted."""
    from ...core.data.prepare import prepare as build

    if cfg.data.format == "chat":  # packed by the run's tokenizer, which is its base model's: known only with --from
        raise UsageError('data.format = "chat": a fine-tuning run packs its conversations itself, by its base '
                         "model's tokenizer (lmcockpit --run PRESET --from RUN_OR_CHECKPOINT)")
    console = plain_console()
    progress = Progress(console)
    t0 = time.monotonic()
    data = None
    try:
        data = build(cfg, console.print, progress)
    except KeyboardInterrupt:
        pass
    finally:
        progress.stop()  # before any message: the bar is cleared, not left under it
    if data is None:
        console.print(f"interrupted: what is finished is kept; `lmcockpit data prepare {again}` resumes")
        return 130
    console.print(f"token cache {data.dir.name}: {fmt_count(len(data.train))} train and {fmt_count(len(data.val))} "
                  f"val tokens, ready in {fmt_duration(time.monotonic() - t0)} ({data.dir})")
    return 0


def again(preset: str, overrides: list[str]) -> str:
    """The arguments naming this preset and its overrides, as a command line takes them."""
    return shlex.join([preset, *(a for o in overrides for a in ("--set", o))])


def run_info(preset: str, overrides: list[str], cache_dir: str | None) -> int:
    """What a run of the preset makes of its data, part by part; then the caches where it looks."""
    from ...core.data import budget

    if cache_dir is not None:  # as --set data.cache_dir would: the run's caches and the listing agree
        overrides = [*overrides, "data.cache_dir=" + json.dumps(str(Path(cache_dir).expanduser()))]
    cfg = load_config(preset, overrides)[0]
    console = plain_console()
    parts = budget.parts(cfg)
    console.print(f"the data a run of {again(preset, overrides)} trains on:")
    console.print(budget.whole(cfg, parts).head())
    for i, part in enumerate(parts):
        for line in part_lines(cfg, i, part):
            console.print(line)
    if cfg.data.format == "tokens":
        console.print()
        for line in shards_lines(cfg, again(preset, overrides)):
            console.print(line)
        return 0
    missing = [p for p in parts if p.cache is None]
    if missing and all(p.problem in (None, NOT_FETCHED) for p in missing):  # else prepare stops at the problem said
        does = "fetches and prepares" if any(p.problem for p in missing) else "prepares"
        console.print(f"`lmcockpit data prepare {again(preset, overrides)}` {does} what is missing (so does training)")
    console.print()
    return info(store.cache_root(cfg))


def shards_lines(cfg: Config, named: str) -> list[str]:
    """data.format = "tokens": no cache to list; which shards a run reads, or fetches first."""
    from ...core.data import token_shards

    lines = [f"no token cache: data.format = \"tokens\" trains on the shards as they are, and validates on "
             f"{'the first ' + format(cfg.data.val_tokens, ',') + ' tokens of ' if cfg.data.val_tokens else ''}"
             f"data.val_source = {json.dumps(cfg.data.val_source)}"]
    planned = token_shards.planned_fetch(cfg)
    for key, files in token_shards.found_here(cfg):
        if isinstance(files, str):
            lines.append(f"{key}: {files}")
        else:
            lines.append(f"{key}: {len(files)} shard{'s' if len(files) > 1 else ''} here, "
                         f"{sum(f.stat().st_size for f in files) / 1e9:.2f} GB: {files[0].parent}")
    if planned:
        lines.append(f"a run fetches, where they are not here, {len(planned)} shards of "
                     f"{token_shards.SPEEDRUN_DATASET}, {sum(b for _, b in planned) / 1e9:.2f} GB: "
                     f"{', '.join(name for name, _ in planned[:3])}{', ...' if len(planned) > 4 else ''}"
                     f"{', ' + planned[-1][0] if len(planned) > 3 else ''} "
                     f"(`lmcockpit data prepare {named}` fetches them now)")
    return lines


def part_lines(cfg: Config, i: int, part) -> list[str]:
    """A part (a single source is one) by the key that names it, what the run makes of it, its cache."""
    if cfg.data.sources:
        named = f"data.sources[{i}]: {json.dumps(part.source)}, weight {cfg.data.sources[i].weight:g}"
    else:
        named = f"data.source = {json.dumps(part.source)}"
    cache = "no token cache yet" if part.cache is None else f"token cache {part.cache} (complete)"
    lines = [named, f"  {part.line()}", *([] if cfg.data.format == "tokens" else [f"  {cache}"])]
    if warning := part.warning():
        lines.append(f"  {warning}")
    return lines


def info(root) -> int:
    """A line per cache and its source on the next, indented: readable at 80 columns, greppable."""
    console = plain_console()
    caches = store.list_caches(root)
    if not caches:
        console.print(f"no token caches under {root}")
        return 0
    console.print(f"token caches under {root}, newest first:")
    for c in caches:
        tokens = ("" if c.train_tokens is None else
                  f"  {fmt_count(c.train_tokens)} train / {fmt_count(c.val_tokens or 0)} val tokens")
        vocab = f"  vocab {c.vocab_size}" if c.vocab_size else ""
        link = f"  (a link to {c.link})" if c.link else ""
        console.print(f"{c.key}  {c.state}{tokens}{vocab}{link}")
        console.print(f"    {c.size / 1e6:.1f} MB, {store.age(c.modified)} old: {c.source}")
    return 0


def rm(root, key: str) -> int:
    removed = store.remove(root, key)
    console = plain_console()
    if removed.link:
        console.print(f"removed the link {removed.folder} to {removed.link}; the token cache there "
                      f"({removed.size / 1e6:.1f} MB, {removed.source}) was left as it is")
    else:
        console.print(f"removed token cache {removed.key} ({removed.size / 1e6:.1f} MB, {removed.source})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

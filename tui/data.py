"""`lmcockpit data`: token caches ahead of training.

* `data prepare PRESET [--set K=V ...]` prepares the preset's token cache now, with a progress bar
  on a terminal (plain lines when piped) and a summary; Ctrl-C or a kill keeps what is finished,
  and the same command resumes. Training prepares on its own when no cache exists.
* `data info` lists the caches: key, source, vocabulary, tokens, size, age, complete or partial.
* `data rm KEY` removes one (a unique prefix of its key will do).

Listing and removing import no numpy or tokenizers; `prepare` does, once it runs.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from rich.console import Console

from lmcockpit.core.config import Config, ConfigError, load_config
from lmcockpit.core.data import store
from lmcockpit.tui import completers
from lmcockpit.tui.runview import fmt_count, fmt_duration
from lmcockpit.tui.usage import Parser, UsageError, error


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="lmcockpit data", description=__doc__.split("\n\n")[0].strip("`. "))
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=Parser)
    prep = sub.add_parser("prepare", help="prepare a preset's token cache now (resumes a killed one)",
                          description="Prepare a preset's token cache ahead of training.")
    prep.add_argument("preset", metavar="PRESET", help="a preset TOML path or a shipped preset name"
                      ).completer = completers.presets
    prep.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config key, VALUE in TOML syntax (repeatable): --set data.workers=8"
                      ).completer = completers.config_keys
    info = sub.add_parser("info", help="list the token caches", description="List the token caches.")
    rm = sub.add_parser("rm", help="remove a token cache", description="Remove a token cache.")
    rm.add_argument("key", metavar="KEY", help="the cache's key, as `lmcockpit data info` lists it (a unique "
                                              "prefix will do)")
    for parser in (info, rm):
        parser.add_argument("--cache-dir", metavar="DIR", help="where the caches are (default: "
                            "$XDG_CACHE_HOME/lmcockpit, as training uses)").completer = completers.directories
    return p


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.action == "prepare":
            again = shlex.join([args.preset, *(a for o in args.overrides for a in ("--set", o))])
            return prepare(load_config(args.preset, args.overrides)[0], again)
        root = store.cache_root(Config()) if args.cache_dir is None else Path(args.cache_dir).expanduser()
        return info(root) if args.action == "info" else rm(root, args.key)
    except (UsageError, ConfigError) as e:
        return error(str(e))


class Progress:
    """The build's progress: a bar on a terminal, a line per stage and every tenth when piped."""

    def __init__(self, console: Console):
        self.console, self.stage, self.tenth, self.t0 = console, "", -1, time.monotonic()
        self.bar = None
        if console.is_terminal:
            from rich.progress import (BarColumn, DownloadColumn, Progress as Bar, TaskProgressColumn, TextColumn,
                                       TimeRemainingColumn, TransferSpeedColumn)

            self.bar = Bar(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), DownloadColumn(),
                           TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=True)
            self.bar.start()
            self.task = None

    def __call__(self, stage: str, done: int, total: int, unit: str) -> None:
        if self.bar is not None:
            if stage != self.stage:
                if self.task is not None:
                    self.bar.remove_task(self.task)
                self.task = self.bar.add_task(stage, total=total)
            self.bar.update(self.task, completed=done, total=total)
        else:
            tenth = int(10 * done / max(1, total))
            if stage != self.stage or tenth > self.tenth:
                mb = done / 1e6
                rate = mb / max(1e-9, time.monotonic() - self.t0)
                self.console.print(f"{stage}: {done / max(1, total):.0%} of {fmt_count(total)} {unit} "
                                   f"({mb:.1f} MB, {rate:.1f} MB/s)")
                self.tenth = tenth
        if stage != self.stage:
            self.stage, self.t0 = stage, time.monotonic()

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def prepare(cfg: Config, again: str) -> int:
    """`again`: the arguments that run it once more, said when it is interrupted."""
    from lmcockpit.core.data.prepare import prepare as build

    console = Console(highlight=False, soft_wrap=True)
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


def info(root) -> int:
    """A line per cache and its source on the next, indented: readable at 80 columns, greppable."""
    console = Console(highlight=False, soft_wrap=True)
    caches = store.list_caches(root)
    if not caches:
        console.print(f"no token caches under {root}")
        return 0
    console.print(f"token caches under {root}, newest first:")
    for c in caches:
        tokens = ("" if c.train_tokens is None else
                  f"  {fmt_count(c.train_tokens)} train / {fmt_count(c.val_tokens or 0)} val tokens")
        vocab = f"  vocab {c.vocab_size}" if c.vocab_size else ""
        console.print(f"{c.key}  {c.state}{tokens}{vocab}")
        console.print(f"    {c.size / 1e6:.1f} MB, {store.age(c.modified)} old: {c.source}")
    return 0


def rm(root, key: str) -> int:
    removed = store.remove(root, key)
    Console(highlight=False).print(f"removed token cache {removed.key} ({removed.size / 1e6:.1f} MB, {removed.source})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

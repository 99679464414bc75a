"""Every `lmcockpit COMMAND`, in one list, and their modules, one each.

The modules: `attach`, `ps`, `compare`, `serve` (a package: the command, its `webserver` and each
browser tab's `session`), `data`, `chat`, `export`, `eval`, `presets`, `doctor`, `help` and `completion`.
The bare command's own forms (the cockpit, `--run`, `--detach`) are tui/cli.py's.

`lmcockpit --help`, `lmcockpit help COMMAND`, shell completion, the dispatch in `cli.py` and the
tests (README table included) all read `COMMANDS`, so a command cannot exist without being listed
everywhere a user looks. Adding one is one `Command(...)` line here plus its module, which has
`build_parser() -> argparse.ArgumentParser` (its own `--help`, and what completion completes) and
`main(argv) -> int` (exit codes 0 done, 1 failed, 2 usage or input error, 130 interrupted), and
its row in the README's Commands table (tests/test_commands.py fails until it has one). Its parser
comes from `command_parser`, which names it `lmcockpit NAME` from this list; a `UsageError` or
`ConfigError` it raises becomes the one `error:` line and exit 2, and Ctrl-C exit 130, here in
`Command.main` for every command: a command catches only what it answers otherwise.

Modules are named, not imported: a command's imports cost nothing until it runs, and this
module stays below every command module (none of them is imported back from here).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
from dataclasses import dataclass
from types import ModuleType

from ...core.config import ConfigError
from ..usage import Parser, UsageError, error


@dataclass(frozen=True)
class Command:
    name: str  # what follows `lmcockpit`
    module: str  # where its build_parser() and main(argv) live
    group: str  # one of GROUPS: the heading `--help` lists it under
    summary: str  # its line in `--help` and in zsh's and fish's completion menus; fits 60 columns

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    def parser(self) -> argparse.ArgumentParser:
        return self.load().build_parser()

    def main(self, argv: list[str]) -> int:
        try:
            return self.load().main(argv)
        except (UsageError, ConfigError) as e:
            return error(str(e))
        except KeyboardInterrupt:
            return 130


# The headings of `lmcockpit --help`, in order. "train" also holds the training forms of the bare
# command (the cockpit, `--run`), which are cli.py's own parser rather than commands.
GROUPS = ("train", "data", "models", "machine", "help")

COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("attach", f"{__name__}.attach", "train", "the dashboard of a run training in the background"),
    Command("ps", f"{__name__}.ps", "train", "the runs training in the background, and dead ones"),
    Command("compare", f"{__name__}.compare", "train", "runs side by side: differing settings, losses, a chart"),
    Command("serve", f"{__name__}.serve", "train", "the cockpit in a web browser, through an SSH tunnel"),
    Command("data", f"{__name__}.data", "data", "token caches: prepare, info (a preset's data too), rm"),
    Command("chat", f"{__name__}.chat", "models", "sample from a trained model, at a prompt or once"),
    Command("export", f"{__name__}.export", "models", "write a checkpoint as a Hugging Face model folder"),
    Command("eval", f"{__name__}.eval", "models", "score a checkpoint on downstream tasks"),
    Command("presets", f"{__name__}.presets", "machine", "the shipped presets: size, memory, whether each fits"),
    Command("doctor", f"{__name__}.doctor", "machine", "check torch, CUDA, GPUs and the compiler here"),
    Command("help", f"{__name__}.help", "help", "this overview, or a command's own: lmcockpit help chat"),
    Command("completion", f"{__name__}.completion", "help", "print the tab completion script for bash, zsh, fish"),
)}


def command_parser(module: str, **kwargs) -> Parser:
    """The parser of the command whose module is `module` (its `__name__`), `prog` named here."""
    name = next(c.name for c in COMMANDS.values() if c.module == module)
    return Parser(prog=f"lmcockpit {name}", **kwargs)


def similarity(word: str, name: str) -> float:
    return difflib.SequenceMatcher(None, word, name).ratio()


# Two letters swapped in a four-letter name (chta) score 0.75; a longer word that only shares a
# stem with a command (nosuchpreset and presets: 0.63) is not taken for it.
CLOSE = 0.7


def nearest(word: str, names=None, cutoff: float = CLOSE) -> str | None:
    """The command (or one of `names`) that `word` most likely misspells, if any is close."""
    found = difflib.get_close_matches(word, list(COMMANDS if names is None else names), n=1, cutoff=cutoff)
    return found[0] if found else None

"""What every `lmcockpit` command shares: `UsageError`, the one red `error:` line, its console.

For bad input, argparse whose mistakes raise `UsageError`, and `error`, the one red `error:` line
on stderr that goes with exit 2 (no traceback); for everything else, `new_console`, the one way a
command's console is made."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.text import Text


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    """argparse whose mistakes become our one-line `error:` and exit 2, for every subcommand."""

    def error(self, message: str):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def new_console(stderr: bool = False, markup: bool = True) -> Console:
    """The console every command prints through: no guessed highlighting of numbers and paths in
    its lines, which are never wrapped (a piped line stays whole for grep). `markup=False` for
    text that is the user's (a source's name may hold `[/x]`), emoji codes off with it."""
    return Console(stderr=stderr, highlight=False, soft_wrap=True, markup=markup, emoji=markup)


def error(message: str) -> int:
    new_console(stderr=True).print(Text(f"error: {message}"), style="bold red")
    return 2

"""What every `lmcockpit` command shares for bad input: `UsageError`, and the one red `error:` line.

What every `lmcockpit` command shares for bad input: argparse whose mistakes raise `UsageError`,
and `error`, the one red `error:` line on stderr that goes with exit 2 (no traceback)."""

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


def error(message: str) -> int:
    Console(stderr=True, highlight=False, soft_wrap=True).print(Text(f"error: {message}"), style="bold red")
    return 2

"""`lmcockpit help [COMMAND | config]`: the overview, one command's help, or every config key.

The overview is `lmcockpit --help`; a command's help is `lmcockpit COMMAND --help`, run here, so
the two cannot differ. The config keys' listing is made from their declarations (core/config.py's
`key_help`), so it cannot differ from what a preset or `--set` accepts.
"""

from __future__ import annotations

import argparse
import textwrap

from . import COMMANDS, command_parser, nearest
from ..completers import command_names
from ..usage import error

CONFIG = "config"  # `lmcockpit help config`: a topic, not a command
WIDTH = 80  # the listing's: an 80-column terminal over SSH shows it unwrapped


def build_parser() -> argparse.ArgumentParser:
    p = command_parser(__name__, description="Show the overview of lmcockpit, or one command's help "
                       "(the same as `lmcockpit COMMAND --help`); `lmcockpit help config` lists every "
                       "config key with its type, default and meaning.")
    p.add_argument("command", metavar="COMMAND", nargs="?", help="the command to explain, or config"
                   ).completer = topics
    return p


def topics(prefix: str, **kwargs) -> dict[str, str]:
    return command_names(prefix, **kwargs) | {CONFIG: "every config key: type, default, what it does"}


def config_keys_text(width: int = WIDTH) -> str:
    """Every key as `section.key  type, default X` and its help indented below, by section."""
    from ...core.config import key_help

    lines = ["Every config key: a preset's [section] table sets it, or --set section.key=VALUE",
             "(VALUE in TOML). \"may change on resume\": --resume RUN --set may change it."]
    section = None
    for row in key_help():
        if row.key.split(".")[0] != section:
            section = row.key.split(".")[0]
            lines += ["", f"[{section}]"]
        head = f"{row.key}  {row.type}" + (f", default {row.default}" if row.default else "")
        head += ", may change on resume" if row.safe_on_resume else ""
        lines += textwrap.wrap(head, width, subsequent_indent=" " * 8, break_on_hyphens=False)
        lines += textwrap.wrap(row.help, width, initial_indent=" " * 4, subsequent_indent=" " * 4)
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from .. import cli

    args = build_parser().parse_args(argv)
    if args.command is None:
        return cli.main(["--help"])
    if args.command == CONFIG:
        print(config_keys_text())
        return 0
    if args.command not in COMMANDS:
        guess = nearest(args.command)
        return error(f"lmcockpit help {args.command}: no such command"
                     + (f"; did you mean {guess}?" if guess else f" (commands: {', '.join(COMMANDS)})"))
    return cli.main([args.command, "--help"])

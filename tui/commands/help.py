"""`lmcockpit help [COMMAND]`: the overview (`lmcockpit --help`), or one command's help.

It runs `lmcockpit COMMAND --help` itself, so the two cannot differ.
"""

from __future__ import annotations

import argparse

from . import COMMANDS, command_parser, nearest
from ..completers import command_names
from ..usage import error


def build_parser() -> argparse.ArgumentParser:
    p = command_parser(__name__, description="Show the overview of lmcockpit, or one command's help "
                       "(the same as `lmcockpit COMMAND --help`).")
    p.add_argument("command", metavar="COMMAND", nargs="?", help="the command to explain").completer = command_names
    return p


def main(argv: list[str]) -> int:
    from .. import cli

    args = build_parser().parse_args(argv)
    if args.command is None:
        return cli.main(["--help"])
    if args.command not in COMMANDS:
        guess = nearest(args.command)
        return error(f"lmcockpit help {args.command}: no such command"
                     + (f"; did you mean {guess}?" if guess else f" (commands: {', '.join(COMMANDS)})"))
    return cli.main([args.command, "--help"])

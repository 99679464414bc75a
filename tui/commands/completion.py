"""`lmcockpit completion SHELL`: tab completion for bash, zsh or fish, and what runs on each Tab.

The script that gives `lmcockpit` tab completion in bash, zsh or
fish; and `complete`, what the `lmcockpit` process does when that script runs it on Tab.

argcomplete does the work (its scripts, and the reading of argparse parsers): the script runs
`lmcockpit` with the line typed so far in COMP_LINE and COMP_POINT and `_ARGCOMPLETE` set, and
reads the completions from fd 8 (or the file `_ARGCOMPLETE_STDOUT_FILENAME` names). Each
command's own parser answers for its arguments, through the completers set on them
(completers.py), so completion cannot disagree with what the command accepts.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import NoReturn

import argcomplete

from . import COMMANDS, command_parser
from ..usage import Parser

SHELLS = ("bash", "zsh", "fish")

ENABLE = """\
to enable it:
  bash  in ~/.bashrc:  eval "$(lmcockpit completion bash)"
  zsh   in ~/.zshrc, after compinit:  eval "$(lmcockpit completion zsh)"
  fish  once:  lmcockpit completion fish > ~/.config/fish/completions/lmcockpit.fish"""


def build_parser() -> argparse.ArgumentParser:
    p = command_parser(__name__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Print the script that gives lmcockpit tab completion in SHELL: commands, flags,\n"
                                   "shipped presets, run folders under runs/, and config keys for --set.",
                       epilog=ENABLE)
    p.add_argument("shell", metavar="SHELL", choices=SHELLS, help="bash, zsh or fish")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    print(argcomplete.shellcode(["lmcockpit"], shell=args.shell), end="")
    return 0


def complete(training_parser: Callable[[], argparse.ArgumentParser]) -> NoReturn:
    """Answer one Tab and exit. A command's arguments are completed by that command's own parser,
    set under a parent that names it; anything else by the bare command's (`training_parser`),
    whose first word completes to the commands as well as presets."""
    line, point = os.environ.get("COMP_LINE", ""), int(os.environ.get("COMP_POINT", 0))
    # The words before the one being completed; `_ARGCOMPLETE` says which of them is `lmcockpit`.
    words = argcomplete.split_line(line, point)[3][int(os.environ["_ARGCOMPLETE"]) - 1:]
    command = COMMANDS.get(words[1]) if len(words) > 1 else None
    if command is None:
        parser = training_parser()
    else:
        parser = Parser(prog="lmcockpit")
        parser.add_subparsers().choices[command.name] = command.parser()
    # Flags once a `-` is typed: a bare Tab lists what a user most often wants (commands, presets,
    # run folders), not thirty options.
    argcomplete.autocomplete(parser, always_complete_options=False)
    os._exit(1)  # autocomplete exits by itself; reaching here means it could not answer

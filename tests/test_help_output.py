"""What `lmcockpit --help`, every `lmcockpit help COMMAND`, each `data` action's help and every
`completion SHELL` print, byte for byte as recorded in tests/golden/help/: a move of the commands'
modules (issue #40) must change none of it. A deliberate change of a help text is recorded again
with `LMCOCKPIT_RECORD_HELP=1 python -m pytest -q tests/test_help_output.py`, and the diff of the
golden files is the review of what users will read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lmcockpit.tui.cli import main
from lmcockpit.tui.commands import COMMANDS

GOLDEN = Path(__file__).resolve().parent / "golden" / "help"
INVOCATIONS = {
    "lmcockpit--help": ["--help"],
    "help": ["help"],
    **{f"help-{name}": ["help", name] for name in COMMANDS},
    "help-config": ["help", "config"],
    **{f"data-{action}--help": ["data", action, "--help"] for action in ("prepare", "info", "rm")},
    **{f"completion-{shell}": ["completion", shell] for shell in ("bash", "zsh", "fish")},
}


def printed(argv: list[str], capsys) -> str:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's --help
        code = e.code
    out, err = capsys.readouterr()
    assert code == 0 and not err, (code, err)
    return out


@pytest.mark.parametrize("name", sorted(INVOCATIONS))
def test_help_and_completion_print_what_was_recorded(name, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps to the terminal's width
    out = printed(INVOCATIONS[name], capsys)
    golden = GOLDEN / f"{name}.txt"
    if os.environ.get("LMCOCKPIT_RECORD_HELP") == "1":
        golden.write_text(out, encoding="utf-8")
    assert out == golden.read_text(encoding="utf-8"), f"`lmcockpit {' '.join(INVOCATIONS[name])}` changed"


def test_every_command_s_help_is_recorded():
    assert {f"help-{name}.txt" for name in COMMANDS} <= {p.name for p in GOLDEN.iterdir()}

"""`lmcockpit ps`: the runs training in the background, and those whose engine died.

Each line is a run a run host serves (started from the cockpit or with `--detach`): its folder,
preset, step, loss, time left, when it should reach its target loss (training.target_val_loss),
how many cockpits watch it, and its state (`stalled` when its engine has gone silent). A run whose host and engine died
without ending it is listed as dead, with the command that resumes it, never as live. One whose
live.json cannot be acted on (damaged, a link, someone else's, writable by others) is listed as
unreadable, saying why, and nothing more is read from it: the user learns where a run went, and
what to look at, rather than see it vanish.
"""

from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text

from lmcockpit.core.process import live
from lmcockpit.tui.commands import command_parser
from lmcockpit.tui.formatting import DASH, fmt_duration
from lmcockpit.tui.usage import Parser, new_console


def build_parser() -> Parser:
    return command_parser(__name__, description=__doc__.split("\n\n")[0])


def rows(runs: list[live.LiveRun], unreadable: list[live.Unreadable] = ()) -> list[tuple[str, ...]]:
    out = []
    for run in runs:
        r = run.record
        step = f"{r.step}/{r.max_steps}" if r.max_steps else str(r.step)
        loss = f"{r.loss:.3f}" if r.loss is not None else DASH
        if run.live:
            state, eta, viewers = r.state, fmt_duration(r.eta_s) if r.eta_s is not None else DASH, str(r.viewers)
        else:
            state, eta, viewers = f"dead: {run.resume_command}", DASH, DASH
        out.append((str(run.run_dir), r.preset, step, loss, eta, r.target or DASH, viewers, state))
    for bad in unreadable:
        out.append((str(bad.run_dir), DASH, DASH, DASH, DASH, DASH, DASH, f"unreadable: {bad.why}"))
    return out


def main(argv: list[str]) -> int:
    build_parser().parse_args(argv)
    runs, unreadable = live.survey()
    console = new_console()
    if not runs and not unreadable:
        console.print("no run is training in the background (start one with `lmcockpit PRESET --detach`)")
        return 0
    columns = ("run", "preset", "step", "loss", "ETA", "target", "viewers", "state")
    if not console.is_terminal:  # piped: one tab-separated line per run, whole, for scripts and grep
        for row in [columns, *rows(runs, unreadable)]:
            print("\t".join(row))
        return 0
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows(runs, unreadable):
        # Text, not markup: a folder's name or a reason may hold brackets
        table.add_row(*map(Text, row), style="red" if row[-1].startswith(("dead", "unreadable")) else "")
    console.print(table)
    return 0

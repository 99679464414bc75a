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

from pathlib import Path

from rich import box
from rich.table import Table
from rich.text import Text

from ...core.process import live
from . import command_parser
from ..formatting import DASH, fmt_duration
from ..usage import Parser, new_console


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


# On a terminal each run is one line: every figure whole and the run's folder shortened from here,
# then cut from the left where it must be (its name is at the end). What is too long for a column
# follows the table, whole, to copy: a dead run's resume command, why a live.json is unreadable,
# and the target forecasts where their column does not fit.
RUN_MIN = 16  # the fewest columns the run's folder is cut to


def overhead(columns: int) -> int:
    """What the table (`new_table`) adds to its columns' widths: two blanks between two."""
    return 2 * (columns - 1)


def new_table() -> Table:
    """A rule under the header; no edges, one padding between two columns: room for the figures."""
    return Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)


def widths(columns: list[str], rows: list[tuple[str, ...]]) -> list[int]:
    return [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]


def table_rows(columns: tuple[str, ...], rows: list[tuple[str, ...]], width: int
               ) -> tuple[list[str], list[tuple[str, ...]], list[str]]:
    """The terminal's table at `width` columns: its columns (those where every run has a dash
    left out; the preset too where each folder's name starts with it, as the runs the cockpit
    starts are named; the target where it does not fit whole), its rows (folders shortened from
    here; a dead or unreadable run's state one word), and the lines that follow it."""
    notes, targets, shown = [], [], []
    target = columns.index("target")
    for row in rows:
        run, state = shown_path(row[0]), row[-1]
        if state.startswith(("dead: ", "unreadable: ")):
            notes.append(state if state.startswith("dead") else f"{run}: {state}")  # a resume command names the run
            state = state.split(":", 1)[0]
        if row[target] != DASH:
            targets.append(f"{run}: target {row[target]}")
        shown.append((run, *row[1:-1], state))
    preset = columns.index("preset")
    named = all(r[preset] == DASH or Path(r[0]).name.startswith(r[preset]) for r in shown)
    kept = [i for i, c in enumerate(columns)
            if c in ("run", "state") or (i != preset or not named) and any(r[i] != DASH for r in shown)]
    if target in kept:
        need = widths([columns[i] for i in kept], [tuple(r[i] for i in kept) for r in shown])
        if sum(need[1:]) + min(need[0], RUN_MIN) + overhead(len(kept)) > width:
            kept.remove(target)
            notes = targets + notes
    return [columns[i] for i in kept], [tuple(r[i] for i in kept) for r in shown], notes


def run_width(columns: list[str], rows: list[tuple[str, ...]], width: int) -> int:
    """The run column's width at `width` columns: its longest folder, or what the other columns
    leave, RUN_MIN at least."""
    need = widths(columns, rows)
    return min(need[0], max(RUN_MIN, width - sum(need[1:]) - overhead(len(columns))))


def cut(path: str, room: int) -> str:
    """`path` in `room` columns, its start cut: at a slash where its end then fits, else in its
    name (a run's name ends in its time: that end tells runs apart)."""
    if len(path) <= room:
        return path
    parts = path.rstrip("/").split("/")
    for n in range(1, len(parts)):
        if len(tail := "…/" + "/".join(parts[n:])) <= room:
            return tail
    return "…" + parts[-1][-(room - 1):]


def shown_path(path: str) -> str:
    """A run folder as a person would type it from here: relative to the current folder where it
    is under it, else to the home folder (`~/...`), else whole."""
    full = Path(path)
    for base, prefix in ((Path.cwd, ""), (Path.home, "~/")):
        try:
            return prefix + str(full.relative_to(base()))
        except (ValueError, OSError):  # not under it, or no current folder (deleted) or home
            continue
    return path


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
    names, shown, notes = table_rows(columns, rows(runs, unreadable), console.width)
    room = run_width(names, shown, console.width)
    table = new_table()
    for column in names:
        table.add_column(column, no_wrap=True, width=room if column == "run" else None)
    for run, *cells in shown:
        # Text, not markup: a folder's name or a reason may hold brackets
        table.add_row(*map(Text, (cut(run, room), *cells)), style="red" if cells[-1] in ("dead", "unreadable") else "")
    console.print(table)
    for note in notes:
        console.print(Text(note, style="" if ": target " in note else "red"))
    return 0

"""`lmcockpit compare RUN RUN ... [--png FILE] [--x step|tokens|time] [--log]`: runs side by side.

Prints the settings in which the runs differ, a row each, then how each run went: final loss,
best validation loss, tokens/s, training time. A table on a terminal, tab-separated lines when
piped. `--png` also draws their loss curves into an image, with matplotlib (the `plot` extra),
imported only then: the rest of the command, and the cockpit's compare view, do without it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ...core.run.curves import AXES, RunCurves, load_runs
from ...core.run.ticks import axis_title, ticks
from . import command_parser
from ..completers import run_folders
from ..rows import labels, result_rows, setting_rows
from ..usage import UsageError, new_console

PNG_POINTS = 2000  # a curve's points in the PNG: twice its 1000 pixels' width


def build_parser() -> argparse.ArgumentParser:
    p = command_parser(__name__, description="Compare run folders: the settings they differ in, then "
                       "final loss, best validation loss, tokens/s and training time; --png draws their loss curves.")
    p.add_argument("runs", metavar="RUN", nargs="+", help="two or more run folders").completer = run_folders
    p.add_argument("--png", metavar="FILE", help="also write the loss curves to this PNG (needs matplotlib: "
                   "pip install 'lmcockpit[plot]')")
    p.add_argument("--x", choices=AXES, default="step",
                   help="the chart's x axis: step, tokens seen, or training time (default: step)")
    p.add_argument("--log", action="store_true", help="log-scale loss axis in the chart")
    return p


def write_png(runs: list[RunCurves], path: Path, axis: str = "step", log: bool = False) -> None:
    """The loss curves, one colour a run: its train loss smoothed (EMA) as a line, its evaluations
    as points. A UsageError when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: a file is all that is drawn
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--png needs matplotlib, which is not installed: pip install 'lmcockpit[plot]'") from None
    fig, ax = plt.subplots(figsize=(10, 6), dpi=100)
    for i, (run, label) in enumerate(zip(runs, labels(runs))):
        color = f"C{i % 10}"
        if run.has_steps:
            x, points = run.curve(axis, PNG_POINTS)
            ax.plot(x, [p.ema for p in points], color=color, label=label, linewidth=1.5)
        if run.val_steps:
            ax.scatter(run.val_x(axis), run.val_losses, color=color, s=24, marker="o",
                       edgecolors="black", linewidths=0.5, zorder=3, label=f"{label} (val)")
    largest = max((r.largest_x(axis) for r in runs), default=0.0)
    if marks := ticks(axis, 0.0, largest, most=8):  # as a person writes them: 300k, 1.2M, 2h05
        ax.set_xticks([v for v, _ in marks], [text for _, text in marks])
    if log:
        from matplotlib.ticker import FormatStrFormatter

        ax.set_yscale("log")
        for set_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            set_formatter(FormatStrFormatter("%.3g"))  # loss units (3.5), not 10^x notation
    ax.set_xlabel(axis_title(axis))
    ax.set_ylabel("loss (train: EMA; points: validation)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, format="png")
    except OSError as e:
        raise UsageError(f"--png {path}: cannot write it ({e.strerror})") from None
    finally:
        plt.close(fig)


def main(argv: list[str]) -> int:
    from rich import box
    from rich.table import Table

    args = build_parser().parse_args(argv)
    if len(args.runs) < 2:
        raise UsageError("compare needs two or more run folders (see `lmcockpit compare --help`)")
    runs = load_runs(args.runs)
    if args.png:
        write_png(runs, Path(args.png).expanduser(), args.x, args.log)
    console = new_console()
    header = ["", *labels(runs)]
    settings, results = setting_rows(runs), result_rows(runs)
    if not console.is_terminal:  # piped: one tab-separated line per row, whole, for scripts and grep
        for what, cells in [(header[0], header[1:]), *settings, *results]:
            print("\t".join([what, *cells]))
    else:
        # The keys whole, each on one line (the runs' columns share what is left, and wrap): a
        # setting's name broken mid-word reads as two.
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        table.add_column(header[0], no_wrap=True, min_width=max(len(what) for what, _ in [*settings, *results]))
        for column in header[1:]:
            table.add_column(column, overflow="fold", ratio=1)
        for i, (what, cells) in enumerate(settings):
            table.add_row(what, *cells, style="bold", end_section=i == len(settings) - 1)
        for what, cells in results:
            table.add_row(what, *cells)
        console.print(table)
    if args.png:  # on stderr: piped, stdout stays the table alone
        new_console(stderr=True).print(f"chart: {args.png}")
    return 0

"""The dashboard's layers panel: each block's health over the last records, as a heatmap.

A row per transformer block (0 at the top, the embedding with the head last, "emb"), a column per
record (logging.layer_stats_every; core/run/layer_history.py), the newest at the right, as many as
the panel is wide. A cell's height and colour are its value's place between the smallest and the
largest shown, on a log scale (the values span decades: a block's update ratio is 1e-4 in one run
and 1e-2 in another, and a jump of 5x is what matters). One metric at a time: the update/weight
ratio (what moves before the loss does), or the gradient norm; a click on the panel switches.
Under the map, a legend: the metric, its range, the last record's step.

Hidden until the run has a record (a run without logging.layer_stats_every has none). Collapsed,
one line: the block with the metric's largest value in the last record, and the value."""

from __future__ import annotations

import math

from rich.table import Table
from rich.text import Text

from ...core import protocol as P
from ...core.run.layer_history import LayerWindow
from ...core.run.state import RunState
from .panels import Panel

SHADES = "▁▂▃▄▅▆▇█"
# From cool to hot: what a glance reads as "this block moves more than the rest".
COLOURS = ("#3b4cc0", "#5977e3", "#7b9ff9", "#9ebeff", "#f7b89c", "#f49a7b", "#e7745b", "#b40426")
METRICS = {"update": ("upd/w", "update/weight ratio"), "grad": ("grad", "gradient norm")}
LABEL = 4  # a row's label and its space: " 12 ", "emb "


def values(record: P.LayerStats, metric: str) -> list[float]:
    """A record's values of `metric`, a block each, then the embedding's."""
    if metric == "grad":
        return [*record.grad_norm, record.embed_grad_norm]
    return [*record.update_ratio, record.embed_update_ratio]


def shown(v: float) -> bool:
    return math.isfinite(v) and v > 0


def fmt(v: float, digits: int = 1) -> str:
    """A value in the fewest columns: 1.2e-3, 2.0e0."""
    return f"{v:.{digits}e}".replace("e-0", "e-").replace("e+0", "e")


def heat_lines(window: LayerWindow, metric: str, width: int) -> list[Text]:
    """The heatmap's rows and the legend, each at most `width` columns; none without a record."""
    columns = max(1, width - LABEL)
    records = list(window)[-columns:]
    if not records:
        return []
    grid = [values(r, metric) for r in records]
    rows = max(len(col) for col in grid)
    seen = [v for col in grid for v in col if shown(v)]
    lo, hi = (math.log10(min(seen)), math.log10(max(seen))) if seen else (0.0, 0.0)
    lines = []
    for row in range(rows):
        line = Text(f"{'emb' if row == rows - 1 else row:>3} ", style="dim")
        for col in grid:
            line.append(*cell(col[row] if row < len(col) else None, lo, hi))
        lines.append(line)
    span = f"{fmt(min(seen), 0)}…{fmt(max(seen), 0)}" if seen else "–"  # a decade is what the shades tell
    short, name = METRICS[metric]
    legend = f"{name} {span} @{records[-1].step}"
    legend = legend if len(legend) <= width else f"{short} {span} @{records[-1].step}"
    lines.append(Text(legend[:width], style="dim"))
    return lines


def cell(v: float | None, lo: float, hi: float) -> tuple[str, str]:
    """A value's character and style: its shade between `lo` and `hi` (log10); "!" for a value that
    is not finite (an overflowed gradient), "·" for none at all (an update skipped), " " for a
    block a record lacks (never within one run: its depth is fixed)."""
    if v is None:
        return " ", ""
    if not math.isfinite(v):
        return "!", "bold red"
    if v <= 0:
        return "·", "dim"
    level = round((math.log10(v) - lo) / (hi - lo) * (len(SHADES) - 1)) if hi > lo else len(SHADES) // 2
    return SHADES[level], COLOURS[level]


def peak_text(window: LayerWindow, metric: str) -> str:
    """The block with the last record's largest value of `metric` (what a collapsed line is read
    for: which block moves most), and the value."""
    last = list(window)[-1:]
    if not last:
        return ""
    vals = values(last[0], metric)
    best = max(range(len(vals)), key=lambda i: vals[i] if shown(vals[i]) else -1.0)
    where = "emb" if best == len(vals) - 1 else f"block {best}"
    return f"{where}: {METRICS[metric][0]} {fmt(vals[best])} @{last[0].step}"


class LayerPanel(Panel):
    """The layers panel: hidden until the run has a record; a click switches the metric."""

    def __init__(self, **kwargs):
        super().__init__("layers", **kwargs)
        self.display = False
        self.metric = "update"
        self.window = LayerWindow()
        self.drawn: tuple[int, int, str, int] | None = None  # what the lines were made of: no redraw for nothing
        self.inside = 0  # its inside width when open, as last drawn

    def show_layers(self, v: RunState, width: int) -> bool:
        """Redraw from the run; `width`: its inside width when open. Whether it shows."""
        window, width = v.history.layers, max(12, width)
        if self.display != bool(len(window)):
            self.display = bool(len(window))
        last = window.records[-1].step if len(window) else -1
        key = (last, len(window), self.metric, width)
        if not len(window) or key == self.drawn:
            return bool(len(window))
        self.window, self.drawn, self.inside = window, key, width
        table = Table.grid()
        table.add_column(no_wrap=True)
        for line in heat_lines(window, self.metric, width):
            table.add_row(line)
        self.border_subtitle = "click: " + METRICS["grad" if self.metric == "update" else "update"][0]
        self.show(table)
        return True

    def on_click(self) -> None:
        self.metric = "grad" if self.metric == "update" else "update"
        self.drawn = None
        self.show_layers_again()

    def show_layers_again(self) -> None:
        """The same records in the other metric, at once (the next redraw would take up to a second)."""
        screen_view = getattr(self.screen, "view", None)
        if screen_view is not None:
            self.show_layers(screen_view, self.inside)

    def summary(self) -> Text:
        text = Text("▸ ", style="dim")
        text.append(self.border_title or "", style="bold")
        text.append("  " + peak_text(self.window, self.metric))
        text.no_wrap, text.overflow = True, "ellipsis"
        return text

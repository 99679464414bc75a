"""The compare view: the marked runs' loss curves on one chart, then how their settings and ends differ.

The compare view, opened from the launch screen with the runs marked there: their loss curves
on one chart, then the settings they differ in and how each went, the rows `lmcockpit compare`
prints."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import DataTable, Footer

from ...core.run.curves import AXES, RunCurves
from ..rows import labels, result_rows, setting_rows
from ..widgets.compare_chart import CompareChart


class CompareScreen(Screen):
    BINDINGS = [
        ("x", "next_axis", "x axis"),
        ("l", "toggle_log", "Log scale"),
        ("escape", "back", "Back"),
        ("b", "back", "Back"),
        ("q", "back", "Back"),
    ]

    def __init__(self, runs: list[RunCurves]):
        super().__init__()
        self.runs = runs
        self.labels = labels(self.runs)

    def compose(self) -> ComposeResult:
        yield CompareChart(self.runs, self.labels, id="compare-chart")
        yield DataTable(id="compare-table", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#compare-table", DataTable)
        table.border_title = "the settings they differ in, then how each went"
        table.add_column("", key="what")
        for label in self.labels:
            table.add_column(label, key=label)
        settings = setting_rows(self.runs)
        for key, cells in settings:
            table.add_row(Text(key, style="bold yellow"), *(Text(c, style="yellow") for c in cells), key=key)
        if not settings:
            table.add_row(Text("(the same settings)", style="dim"), *("" for _ in self.runs))
        for what, cells in result_rows(self.runs):
            table.add_row(what, *cells, key=what)

    def action_next_axis(self) -> None:
        chart = self.query_one(CompareChart)
        chart.axis = AXES[(AXES.index(chart.axis) + 1) % len(AXES)]
        chart.refresh()

    def action_toggle_log(self) -> None:
        chart = self.query_one(CompareChart)
        chart.log_scale = not chart.log_scale
        chart.refresh()

    def action_back(self) -> None:
        self.app.pop_screen()


"""The compare view's chart: several runs' losses on one plot, a colour each.

Several runs' losses on one plot, a colour each, against step,
tokens seen or training time, optionally on a log scale.

Built on plotext as LossChart is, with its helpers: each curve from its run's history at about
twice the width, ticks as a person writes them (300k, 2h05), log scale as log10 of the values with tick labels in loss units, and the plot built afresh
on every render from the runs it holds.
"""

from __future__ import annotations

from ...core.run.curves import RunCurves
from ...core.run.ticks import axis_title
from .charts import Chart, drawn, plotted, set_log_ticks, set_x_ticks

COLORS = ("cyan", "orange", "green", "magenta", "red", "blue", "yellow", "white")


class CompareChart(Chart):
    what = "compare chart"

    def __init__(self, runs: list[RunCurves], labels: list[str], **kwargs):
        super().__init__(**kwargs)
        self.runs, self.labels = runs, labels
        self.axis = "step"
        self.legend: list[str] = []  # the series the last build drew, by label: what the legend names
        self.xlabel = ""

    def values(self) -> list[float]:
        width = 2 * max(10, self.size.width)
        return [v for r in self.runs for v in [p.ema for p in r.history.points(width)] + r.val_losses]

    def build_plot(self) -> None:
        plt = self.plt
        plt.clear_figure()
        log = self.plots_log
        y = plotted(log)
        self.xlabel = axis_title(self.axis)
        width = max(10, self.size.width)
        self.legend = []
        xs: list[float] = []
        for i, (run, label) in enumerate(zip(self.runs, self.labels)):
            color = COLORS[i % len(COLORS)]
            if run.has_steps:
                x, points = run.curve(self.axis, 2 * width)
                plt.plot(x, y([p.ema for p in points]), label=label, color=color, marker="braille")
                self.legend.append(label)
                xs += x
            if run.val_steps:
                vx, vy = drawn(list(zip(run.val_x(self.axis), run.val_losses)), width)
                plt.scatter(vx, y(vy), color=color, marker="dot")
                xs += vx
        if log:
            set_log_ticks(plt, self.values())
        set_x_ticks(plt, self.axis, xs + [0.0], width)
        scale = " (log scale)" if log else " (log scale needs positive values)" if self.log_scale else ""
        plt.title(f"loss by {self.xlabel}{scale}: lines train EMA, dots validation")
        plt.xlabel(self.xlabel)

"""The compare view's chart: several runs' losses on one plot, a colour each.

Several runs' losses on one plot, a colour each, against step,
tokens seen or training time, optionally on a log scale.

Built on plotext as LossChart is, with its helpers: each curve downsampled to about twice the
width, log scale as log10 of the values with tick labels in loss units, and the plot built afresh
on every render from the runs it holds.
"""

from __future__ import annotations

from lmcockpit.core.run.curves import RunCurves, axis_scale
from lmcockpit.tui.widgets.charts import Chart, downsample, plotted, set_log_ticks

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
        return [v for r in self.runs for v in r.losses + r.val_losses]

    def build_plot(self) -> None:
        plt = self.plt
        plt.clear_figure()
        log = self.plots_log
        y = plotted(log)
        largest = max((max(r.x(self.axis)[-1:] + r.val_x(self.axis)[-1:], default=0.0) for r in self.runs),
                      default=0.0)
        self.xlabel, unit = axis_scale(self.axis, largest)
        width = max(10, self.size.width)
        self.legend = []
        for i, (run, label) in enumerate(zip(self.runs, self.labels)):
            color = COLORS[i % len(COLORS)]
            if run.steps:
                xs, ys = downsample([x / unit for x in run.x(self.axis)], run.smoothed, 2 * width)
                plt.plot(xs, y(ys), label=label, color=color, marker="braille")
                self.legend.append(label)
            if run.val_steps:
                plt.scatter([x / unit for x in run.val_x(self.axis)], y(run.val_losses), color=color, marker="dot")
        if log:
            set_log_ticks(plt, self.values())
        scale = " (log scale)" if log else " (log scale needs positive values)" if self.log_scale else ""
        plt.title(f"loss by {self.xlabel}{scale}: lines train EMA, dots validation")
        plt.xlabel(self.xlabel)

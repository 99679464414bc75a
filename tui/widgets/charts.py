"""The loss chart: train loss raw and smoothed, validation points, and an optional baseline run.

Train loss raw and smoothed, validation points, optional log scale, and
optionally a finished run's curves underneath as a baseline.

plotext rebuilds every point on each draw, so the chart plots the whole history downsampled to
about twice its width, and redraws only when asked (the dashboard asks at a bounded rate).

Textual also renders the widget again on its own (a resize, a neighbour appearing), so the plot
is built afresh from the stored history on every render, never left in plotext between two.
Log scale takes log10 of the values here and keeps plotext's axis linear, with tick labels in
loss units: plotext's own log axis transforms its stored data in place on each build.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from rich.text import Text
from textual.app import RenderResult
from textual_plotext import PlotextPlot

from lmcockpit.core.run.curves import RunCurves


def downsample(xs: list[int], ys: list[float], points: int) -> tuple[list[float], list[float]]:
    """At most `points` points: the mean of each consecutive bucket, so the whole history shows
    and a spike still moves its bucket."""
    n = len(xs)
    if n <= points or points <= 0:
        return list(map(float, xs)), list(ys)
    out_x, out_y = [], []
    for b in range(points):
        lo, hi = b * n // points, (b + 1) * n // points
        if hi > lo:
            out_x.append(sum(xs[lo:hi]) / (hi - lo))
            out_y.append(sum(ys[lo:hi]) / (hi - lo))
    return out_x, out_y


def log_ticks(lo: float, hi: float, most: int = 6) -> list[float]:
    """Readable tick values (in loss units) between lo and hi > 0 for a log axis: 1, 2, 5 × 10^k
    (or every integer mantissa on a short range), else evenly spaced in log space."""
    if not (0 < lo <= hi and math.isfinite(hi)):
        return []
    for mantissas in ((1, 2, 3, 4, 5, 6, 7, 8, 9), (1, 2, 5), (1,)):
        ticks = [m * 10.0**k for k in range(math.floor(math.log10(lo)), math.floor(math.log10(hi)) + 1)
                 for m in mantissas if lo <= m * 10.0**k <= hi]
        if 2 <= len(ticks) <= most:
            return ticks
    a, b = math.log10(lo), math.log10(hi)
    n = min(most, 4)
    return [10 ** (a + (b - a) * i / (n - 1)) for i in range(n)] if b > a else [lo]


def plotted(log: bool) -> Callable[[list[float]], list[float]]:
    """How values are plotted: log10 of them on a log scale (the axis itself stays linear)."""
    return (lambda vs: [math.log10(v) for v in vs]) if log else list


def set_log_ticks(plt, values: list[float]) -> None:
    """Tick labels in loss units on an axis that plots log10 of the values."""
    ticks = log_ticks(min(values), max(values))
    plt.yticks([math.log10(t) for t in ticks], [f"{t:.3g}" for t in ticks])


class Chart(PlotextPlot):
    """A plotext chart built afresh on every render (`build_plot`); one that cannot draw says why
    in its place instead of taking the cockpit down."""

    what = "chart"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.log_scale = False
        self.error: str = ""  # why the last render failed, if it did

    def values(self) -> list[float]:
        """Every loss the chart draws."""
        raise NotImplementedError

    def build_plot(self) -> None:
        raise NotImplementedError

    @property
    def plots_log(self) -> bool:
        """Log scale is asked for and every value can take it."""
        values = self.values()
        return self.log_scale and bool(values) and all(v > 0 and math.isfinite(v) for v in values)

    def render(self) -> RenderResult:
        try:
            self.build_plot()
            rendered = super().render()
        except Exception as e:  # noqa: BLE001 -- a chart that cannot draw must never take the cockpit down
            self.error = f"{type(e).__name__}: {e}"
            return Text(f"{self.what} unavailable ({self.error})", style="dim red")
        self.error = ""
        return rendered


@dataclass(frozen=True)
class Baseline:
    """A finished run drawn under the live curves: its smoothed train loss and its validation
    points, computed once (the run does not change)."""
    name: str
    steps: list[int]
    ema: list[float]
    val_steps: list[int]
    val_losses: list[float]

    @classmethod
    def of(cls, run: RunCurves) -> Baseline:
        return cls(run.name, run.steps, run.smoothed, run.val_steps, run.val_losses)


class LossChart(Chart):
    what = "loss chart"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.val_steps: list[int] = []
        self.val_losses: list[float] = []
        self.baseline: Baseline | None = None
        self.smoothed: list[float] = []
        self.spikes: list[int] = []

    def set_data(self, steps, losses, smoothed, val_steps, val_losses, spikes=()) -> None:
        """`smoothed`: the losses' EMA, kept by the RunState a step at a time; `spikes`: the steps
        of loss spikes, marked."""
        self.steps, self.losses, self.smoothed = steps, losses, smoothed
        self.val_steps, self.val_losses = val_steps, val_losses
        self.spikes = list(spikes)

    def redraw(self) -> None:
        self.refresh()

    def values(self) -> list[float]:
        """Every loss drawn: the live run's and the baseline's."""
        base = self.baseline
        return self.losses + self.val_losses + (base.ema + base.val_losses if base else [])

    def build_plot(self) -> None:
        """Put the whole figure into plotext, sized for the widget as it is now."""
        plt = self.plt
        plt.clear_figure()
        log = self.plots_log
        y = plotted(log)
        if self.log_scale and not log and (self.losses or self.val_losses):
            plt.title("loss (log scale needs positive values)")
        else:
            plt.title("loss" + (" (log scale)" if self.log_scale else ""))
        width = max(10, self.size.width)
        if base := self.baseline:  # first, so the live curves draw over it
            bx, by = downsample(base.steps, base.ema, 2 * width)
            plt.plot(bx, y(by), label=f"base {base.name}", color="magenta", marker="braille")
            if base.val_steps:
                plt.scatter(base.val_steps, y(base.val_losses), label="base val", color="magenta", marker="x")
        if self.steps:
            xs, ys = downsample(self.steps, self.losses, 2 * width)
            plt.plot(xs, y(ys), label="train", color="gray", marker="braille")
            sx, sy = downsample(self.steps, self.smoothed, 2 * width)
            plt.plot(sx, y(sy), label="ema", color="cyan", marker="braille")
        if self.val_steps:
            plt.scatter(self.val_steps, y(self.val_losses), label="val", color="orange", marker="dot")
        if self.spikes and self.losses:
            # At the top of the losses drawn: a spike's own loss (often tens of times the run's) would
            # squash every curve into the bottom row.
            top = max(self.losses + self.val_losses)
            plt.scatter(self.spikes, y([top] * len(self.spikes)), label="spike", color="red", marker="x")
        if log:
            set_log_ticks(plt, self.values())
        plt.xlabel("step")


"""The loss chart: train loss raw and smoothed, validation points, and an optional baseline run.

Train loss raw and smoothed, validation points, optional log scale, and
optionally a finished run's curves underneath as a baseline.

plotext rebuilds every point on each draw, so the chart plots the run's history
(core/run/history.py) at about twice its width, whatever the run's length, and redraws only when
asked (the dashboard asks at a bounded rate). The step axis is labelled as a person writes it
(core/run/ticks.py: 300k, 1.2M).

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
from lmcockpit.core.run.history import History
from lmcockpit.core.run.target import spread
from lmcockpit.core.run.ticks import ticks


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


def drawn(points: list[tuple[float, float]], width: int) -> tuple[list[float], list[float]]:
    """(xs, ys) of at most twice `width` of `points` (evaluations: every one is kept, a long run's
    by the thousand), evenly spread, the first and last among them: more dots than the chart has
    columns draw nothing more and cost plotext every redraw."""
    kept = spread(points, 2 * width)
    return [x for x, _ in kept], [y for _, y in kept]


def set_x_ticks(plt, axis: str, xs: list[float], width: int) -> None:
    """Tick labels a person would write (core/run/ticks.py): whole steps, 300k, 1.2M, 2h05."""
    if xs:
        marks = ticks(axis, min(xs), max(xs), most=max(2, min(6, width // 12)))
        if marks:
            plt.xticks([v for v, _ in marks], [text for _, text in marks])


@dataclass(frozen=True)
class Baseline:
    """A finished run drawn under the live curves: its history (its smoothed train loss and its
    validation points), read once (the run does not change)."""
    name: str
    history: History

    @classmethod
    def of(cls, run: RunCurves) -> Baseline:
        return cls(run.name, run.history)


class LossChart(Chart):
    what = "loss chart"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.history = History()
        self.baseline: Baseline | None = None

    def set_data(self, history: History) -> None:
        """The run's history (the RunState's): its curves at the chart's width, its evaluations and
        its spikes, marked."""
        self.history = history

    def redraw(self) -> None:
        self.refresh()

    def values(self) -> list[float]:
        """Every loss drawn: the live run's and the baseline's, at the chart's width."""
        width = 2 * max(10, self.size.width)
        out = [v for p in self.history.points(width) for v in (p.loss, p.ema)] + [e[1] for e in self.history.evals]
        if base := self.baseline:
            out += [p.ema for p in base.history.points(width)] + [e[1] for e in base.history.evals]
        return out

    def build_plot(self) -> None:
        """Put the whole figure into plotext, sized for the widget as it is now."""
        plt = self.plt
        plt.clear_figure()
        log = self.plots_log
        y = plotted(log)
        h = self.history
        if self.log_scale and not log and (h.count or h.evals):
            plt.title("loss (log scale needs positive values)")
        else:
            plt.title("loss" + (" (log scale)" if self.log_scale else ""))
        width = max(10, self.size.width)
        xs: list[float] = []
        if base := self.baseline:  # first, so the live curves draw over it
            points = base.history.points(2 * width)
            bx = [p.step for p in points]
            plt.plot(bx, y([p.ema for p in points]), label=f"base {base.name}", color="magenta", marker="braille")
            if base.history.evals:
                vx, vy = drawn([e[:2] for e in base.history.evals], width)
                plt.scatter(vx, y(vy), label="base val", color="magenta", marker="x")
            xs += bx
        points = h.points(2 * width)
        if points:
            px = [p.step for p in points]
            plt.plot(px, y([p.loss for p in points]), label="train", color="gray", marker="braille")
            plt.plot(px, y([p.ema for p in points]), label="ema", color="cyan", marker="braille")
            xs += px
        if h.evals:
            vx, vy = drawn([e[:2] for e in h.evals], width)
            plt.scatter(vx, y(vy), label="val", color="orange", marker="dot")
        if h.spikes and points:
            # At the top of the losses drawn: a spike's own loss (often tens of times the run's) would
            # squash every curve into the bottom row.
            top = max([p.loss for p in points] + [e[1] for e in h.evals])
            plt.scatter([s for s, _, _ in h.spikes], y([top] * len(h.spikes)), label="spike", color="red", marker="x")
        if log:
            set_log_ticks(plt, self.values())
        set_x_ticks(plt, "step", xs, width)
        plt.xlabel("step")

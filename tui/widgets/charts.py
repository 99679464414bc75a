"""The loss chart: train loss raw and smoothed, validation points, and an optional baseline run.

Train loss raw and smoothed, validation points, optional log scale, and
optionally a finished run's curves underneath as a baseline.

plotext rebuilds every point on each draw, so the chart plots the run's history
(core/run/history.py) at about twice its width, whatever the run's length, and is painted again
only when what it would draw moves by a braille dot (the dashboard asks once a second; a long
run's second of steps moves none). The step axis is labelled as a person writes it
(core/run/ticks.py: 300k, 1.2M).

Textual also renders the widget again on its own (a resize, a neighbour appearing), so the plot
is built afresh from the stored history on every render, never left in plotext between two.
Log scale takes log10 of the values here and keeps plotext's axis linear, with tick labels in
loss units: plotext's own log axis transforms its stored data in place on each build.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from rich.text import Text
from textual.app import RenderResult
from textual_plotext import PlotextPlot

from ...core.run.curves import RunCurves
from ...core.run.history import History
from ...core.run.target import spread
from ...core.run.ticks import ticks


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


@dataclass(frozen=True)
class Series:
    """One thing the loss chart draws, in loss units: a line or a scatter of marks."""
    xs: list[float]
    ys: list[float]
    label: str
    color: str
    marker: str
    line: bool = True


@dataclass(frozen=True)
class Frame:
    """The box a picture was drawn in, and the size of one of its braille dots in data units."""
    look: tuple  # the widget's size, scale, title and series: any change is a new picture
    x0: float
    x1: float
    y0: float
    y1: float
    dx: float
    dy: float

    @classmethod
    def around(cls, look: tuple, xs: list[float], ys: list[float], width: int, height: int) -> Frame:
        x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
        return cls(look, x0, x1, y0, y1, (x1 - x0) / (2 * width) or 1.0, (y1 - y0) / (4 * height) or 1.0)

    def holds(self, look: tuple, xs: list[float], ys: list[float]) -> bool:
        """The data still fits this box to within a dot each way (a curve that goes on to the
        right by less than a dot, or whose range moves by less than one, draws as it did)."""
        x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
        return (look == self.look and x0 == self.x0 and self.x1 <= x1 <= self.x1 + self.dx
                and abs(y0 - self.y0) <= self.dy and abs(y1 - self.y1) <= self.dy)

    def dots(self, series: list[Series], y: Callable[[list[float]], list[float]]) -> tuple:
        return tuple(tuple((round((a - self.x0) / self.dx), round((b - self.y0) / self.dy))
                           for a, b in zip(s.xs, y(s.ys))) for s in series)


EDGE_EVERY = 5.0  # seconds between paintings of a long run's chart where only its newest points moved


def edge_only(before: tuple | None, now: tuple) -> bool:
    """Two sightings in one frame that differ in the last dot of some curves alone."""
    if not (before and len(before) == 2 and len(now) == 2 and before[0] == now[0]):
        return False
    return all(a[:-1] == b[:-1] for a, b in zip(before[1], now[1], strict=True))


class LossChart(Chart):
    what = "loss chart"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.history = History()
        self.baseline: Baseline | None = None
        self.painted: tuple | None = None  # the frame and dots of the picture last asked for
        self.painted_at = -math.inf
        self.waiting = False  # a move of the newest points is yet to be painted
        self.clock = time.monotonic
        self.evals_seen: dict[int, tuple] = {}  # by history: its evaluations drawn, and of what

    def set_data(self, history: History) -> None:
        """The run's history (the RunState's): its curves at the chart's width, its evaluations and
        its spikes, marked."""
        self.history = history

    def redraw(self) -> None:
        """Paint again only where the picture would move by a braille dot: at a million steps a
        second of training moves none, and plotext costs as much to draw the same picture again
        (a third of what watching a run cost). The newest point, the mean of a bucket still
        filling, moves with each step's noise: where nothing else moved it is painted every
        EDGE_EVERY seconds."""
        try:
            seen = self.sighting()
        except Exception:  # noqa: BLE001 -- drawn again, where render() says what is wrong in the chart's place
            seen = None
        self.waiting = False
        if seen is not None and seen == self.painted:
            return
        now = self.clock()
        if seen is not None and edge_only(self.painted, seen) and now - self.painted_at < EDGE_EVERY:
            self.waiting = True  # painted by a later redraw, whether or not anything else moves
            return
        self.painted, self.painted_at = seen, now
        self.refresh()

    def sighting(self) -> tuple | None:
        """The picture as dots in the frame it was last drawn in (a new frame where the data left
        it); None where it cannot say (a value that is not finite): then it is drawn again."""
        series = self.series()
        log = self.plots(series)
        y = plotted(log)
        look = (self.size.width, self.size.height, self.log_scale, log, self.baseline and self.baseline.name,
                tuple((s.label, len(s.xs)) for s in series))
        xs = [x for s in series for x in s.xs]
        ys = y([v for s in series for v in s.ys])
        if not xs:
            return (look,)
        if not all(math.isfinite(v) for v in xs + ys):
            return None
        width, height = max(10, self.size.width), max(1, self.size.height)
        old = self.painted[0] if self.painted and len(self.painted) == 2 else None
        frame = old if old is not None and old.holds(look, xs, ys) else Frame.around(look, xs, ys, width, height)
        return frame, frame.dots(series, y)

    def series(self) -> list[Series]:
        """What the chart draws, in drawing order: the baseline under the live curves, then the
        train loss and its EMA, the validation points and the spikes' marks."""
        h, width = self.history, max(10, self.size.width)
        out = []
        if base := self.baseline:  # first, so the live curves draw over it
            points = base.history.points(2 * width)
            out.append(Series([p.step for p in points], [p.ema for p in points], f"base {base.name}", "magenta",
                              "braille"))
            if base.history.evals:
                out.append(Series(*self.evals_drawn(base.history, width), "base val", "magenta", "x", line=False))
        points = h.points(2 * width)
        if points:
            px = [p.step for p in points]
            out.append(Series(px, [p.loss for p in points], "train", "gray", "braille"))
            out.append(Series(px, [p.ema for p in points], "ema", "cyan", "braille"))
        if h.evals:
            out.append(Series(*self.evals_drawn(h, width), "val", "orange", "dot", line=False))
        if h.spikes and points:
            # At the top of the losses drawn: a spike's own loss (often tens of times the run's) would
            # squash every curve into the bottom row.
            top = max([p.loss for p in points] + [e[1] for e in h.evals])
            out.append(Series([s for s, _, _ in h.spikes], [top] * len(h.spikes), "spike", "red", "x", line=False))
        return out

    def evals_drawn(self, h: History, width: int) -> tuple[list[float], list[float]]:
        """drawn() of `h`'s evaluations, again only when they changed: a long run has thousands,
        and the chart asks once a second."""
        key = (len(h.evals), h.evals[-1] if h.evals else None, width)
        seen = self.evals_seen.get(id(h))
        if seen is None or seen[0] is not h.evals or seen[1] != key:
            self.evals_seen[id(h)] = seen = h.evals, key, drawn([e[:2] for e in h.evals], width)
        return seen[2]

    def plots(self, series: list[Series]) -> bool:
        """Log scale is asked for and every value drawn can take it."""
        values = [v for s in series for v in s.ys]
        return self.log_scale and bool(values) and all(v > 0 and math.isfinite(v) for v in values)

    def values(self) -> list[float]:
        """Every loss drawn: the live run's and the baseline's, at the chart's width."""
        return [v for s in self.series() for v in s.ys]

    def build_plot(self) -> None:
        """Put the whole figure into plotext, sized for the widget as it is now."""
        plt = self.plt
        plt.clear_figure()
        series = self.series()
        log = self.plots(series)
        y = plotted(log)
        h = self.history
        if self.log_scale and not log and (h.count or h.evals):
            plt.title("loss (log scale needs positive values)")
        else:
            plt.title("loss" + (" (log scale)" if self.log_scale else ""))
        for s in series:
            draw = plt.plot if s.line else plt.scatter
            draw(s.xs, y(s.ys), label=s.label, color=s.color, marker=s.marker)
        if log:
            set_log_ticks(plt, [v for s in series for v in s.ys])
        xs = [x for s in series if s.line for x in s.xs]  # the curves span the axis; marks fall within
        set_x_ticks(plt, "step", xs, max(10, self.size.width))
        plt.xlabel("step")

"""The loss chart: train loss raw and smoothed, validation points, optional log scale.

plotext rebuilds every point on each draw, so the chart plots the whole history downsampled to
about twice its width, and redraws only when asked (the dashboard asks at a bounded rate).
"""

from __future__ import annotations

from textual_plotext import PlotextPlot

EMA_BETA = 0.9


def ema(values: list[float], beta: float = EMA_BETA) -> list[float]:
    """Bias-corrected exponential moving average, as training dashboards smooth a loss."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i))
    return out


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


class LossChart(PlotextPlot):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.log_scale = False
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.val_steps: list[int] = []
        self.val_losses: list[float] = []

    def set_data(self, steps, losses, val_steps, val_losses) -> None:
        self.steps, self.losses, self.val_steps, self.val_losses = steps, losses, val_steps, val_losses

    def redraw(self) -> None:
        plt = self.plt
        plt.clear_figure()
        plt.title("loss" + (" (log scale)" if self.log_scale else ""))
        width = max(10, self.size.width)
        if self.steps:
            xs, ys = downsample(self.steps, self.losses, 2 * width)
            plt.plot(xs, ys, label="train", color="gray", marker="braille")
            sx, sy = downsample(self.steps, ema(self.losses), 2 * width)
            plt.plot(sx, sy, label="ema", color="cyan", marker="braille")
        if self.val_steps:
            plt.scatter(self.val_steps, self.val_losses, label="val", color="orange", marker="dot")
        if self.log_scale and (self.losses or self.val_losses) and min(self.losses + self.val_losses) > 0:
            plt.yscale("log")
        else:
            plt.yscale("linear")
        plt.xlabel("step")
        self.refresh()

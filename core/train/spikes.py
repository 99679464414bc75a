"""Loss spikes: a step's loss (or gradient norm) far above the steps just before it.

llm.c's test: the z-score of a step's value against the mean and standard deviation of the last
`window` steps, once that many are seen; a healthy run's step-to-step noise stays within a few
deviations, a spike that ruins a run is tens of them (the cpu preset's run, resumed with a
learning rate of 5, went from 3.69 to 22.1 in one step). Only values above the window count: a
loss that falls fast is the point of training.

The window is part of a checkpoint's state (`state()`, `restore()`), so a resumed run judges its
next steps as the uninterrupted one would. What a spike leads to (warn, skip, rollback, stop) is
the trainer's. Torch: never.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Spike:
    loss: float
    grad_norm: float
    mean_loss: float  # the window's
    z_loss: float
    z_grad: float

    def describe(self) -> str:
        grad = f", grad norm {self.grad_norm:.3g} ({self.z_grad:.1f} sd)" if math.isfinite(self.z_grad) else ""
        return f"loss {self.loss:.4f}, {self.z_loss:.1f} sd above the last steps' mean {self.mean_loss:.4f}{grad}"


def zscore(value: float, window: deque) -> float:
    n = len(window)
    mean = sum(window) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in window) / n)
    if std == 0.0:
        return math.inf if value > mean else 0.0
    return (value - mean) / std


class SpikeWatch:
    """The loss and gradient norm of the last `window` steps that were taken as they came."""

    def __init__(self, window: int, z_loss: float, z_grad: float):
        self.losses: deque[float] = deque(maxlen=window)
        self.norms: deque[float] = deque(maxlen=window)
        self.z_loss, self.z_grad = z_loss, z_grad

    def check(self, loss: float, grad_norm: float) -> Spike | None:
        """The spike this step is, judged against the window before it; None for a step in line
        (or while the window is still filling)."""
        if len(self.losses) < (self.losses.maxlen or 0):
            return None
        z_loss = zscore(loss, self.losses)
        z_grad = zscore(grad_norm, self.norms) if self.z_grad else math.nan
        if (self.z_loss and z_loss > self.z_loss) or (self.z_grad and z_grad > self.z_grad):
            return Spike(loss, grad_norm, sum(self.losses) / len(self.losses), z_loss, z_grad)
        return None

    def add(self, loss: float, grad_norm: float) -> None:
        self.losses.append(loss)
        self.norms.append(grad_norm)

    def state(self) -> dict:
        return {"losses": list(self.losses), "grad_norms": list(self.norms)}

    def restore(self, state: dict | None) -> None:
        """The window a checkpoint saved (its last `window` values, if the window has changed);
        none in a checkpoint from before spikes were watched: the window fills again."""
        self.losses.clear()
        self.norms.clear()
        for loss, norm in zip((state or {}).get("losses", []), (state or {}).get("grad_norms", [])):
            self.add(float(loss), float(norm))

"""Loss spikes: a step's loss (or gradient norm) far above the steps just before it.

llm.c's test: the z-score of a step's value against the mean and standard deviation of the last
`window` steps, once that many are seen; a healthy run's step-to-step noise stays within a few
deviations, a spike that ruins a run is tens of them (the cpu preset's run, resumed with a
learning rate of 5, went from 3.69 to 22.1 in one step). Only values above the window count: a
loss that falls fast is the point of training.

A window still filling is judged too, from JUDGED_FROM steps on (a run's first steps, a run resumed
from an early checkpoint: a surge there went 4.15 → 61.0 → 140.7 unseen while a 100-step window
filled), against its median and median absolute deviation: a few values' standard deviation is
swayed by any one of them. Before JUDGED_FROM steps nothing is judged.

The window is part of a checkpoint's state (`state()`, `restore()`), so a resumed run judges its
next steps as the uninterrupted one would. What a spike leads to (warn, skip, rollback, stop) is
the trainer's. Torch: never.

With logging.layer_stats_every, each block's update/weight ratio is watched too
(`UpdateRatioWatch`): a warning only, since it moves before the loss does.
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
    steps: int = 0  # the window's length when it was judged
    center: str = "mean"  # what mean_loss is: the window's mean, or its median while it filled

    def describe(self) -> str:
        grad = f", grad norm {self.grad_norm:.3g} ({self.z_grad:.1f} sd)" if math.isfinite(self.z_grad) else ""
        return (f"loss {self.loss:.4f}, {self.z_loss:.1f} sd above the last {self.steps} steps' {self.center} "
                f"{self.mean_loss:.4f}{grad}")


JUDGED_FROM = 10  # steps seen before any is judged (fewer when the window itself is shorter)
MAD_TO_SD = 1.4826  # the median absolute deviation of a normal distribution, times this, is its sd


def robust_zscore(value: float, window: deque) -> float:
    """How far above the window's median `value` is, in standard deviations as the median absolute
    deviation estimates them; the standard deviation itself where half the values are equal."""
    ordered = sorted(window)
    median = _median(ordered)
    spread = MAD_TO_SD * _median(sorted(abs(v - median) for v in ordered))
    if spread == 0.0:
        return zscore(value, window)
    return (value - median) / spread


def _median(ordered: list[float]) -> float:
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


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
        """The spike this step is, judged against the window before it (robustly while it fills);
        None for a step in line, or before JUDGED_FROM steps are seen."""
        window = self.losses.maxlen or 0
        if len(self.losses) < min(window, JUDGED_FROM):
            return None
        full = len(self.losses) >= window
        z = zscore if full else robust_zscore
        z_loss = z(loss, self.losses)
        z_grad = z(grad_norm, self.norms) if self.z_grad else math.nan
        if (self.z_loss and z_loss > self.z_loss) or (self.z_grad and z_grad > self.z_grad):
            center = sum(self.losses) / len(self.losses) if full else _median(sorted(self.losses))
            return Spike(loss, grad_norm, center, z_loss, z_grad, len(self.losses), "mean" if full else "median")
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


# A block's update/weight ratio, per unit of learning rate (so that warmup, decay and a rollback's
# cut do not move it), stays within about 2x of its recent median in a healthy run: Adam's and
# Muon's updates have a size set by the rate, not by the gradient. RATIO_JUMP is well past that.
RATIO_JUMP = 5.0
RATIO_WINDOW = 20  # a block's records its median is taken over; also those a warning keeps it quiet
RATIO_JUDGED_FROM = 5  # records of a block seen before any is judged


class UpdateRatioWatch:
    """Each block's update/weight ratio (core/train/layer_stats.py) against its own recent median:
    a jump often comes before the loss spikes. Says so, once per block per RATIO_WINDOW records;
    what a spike leads to stays training.on_spike's. Not in a checkpoint: a resumed run's watch
    fills again from its next records."""

    def __init__(self, jump: float = RATIO_JUMP, window: int = RATIO_WINDOW):
        self.jump, self.window = jump, window
        self.seen: list[deque[float]] = []  # by block: ratio / lr of its last records
        self.quiet: list[int] = []  # by block: records before it may be warned of again

    def check(self, step: int, ratios: list[float], lr: float) -> list[str]:
        """The warning lines for the record of `step` (each block's ratio, at learning rate `lr`)."""
        lines: list[str] = []
        if not lr > 0:  # a schedule at zero: no update to judge
            return lines
        while len(self.seen) < len(ratios):
            self.seen.append(deque(maxlen=self.window))
            self.quiet.append(0)
        for block, ratio in enumerate(ratios):
            value, seen = ratio / lr, self.seen[block]
            if not math.isfinite(value):
                continue
            self.quiet[block] = max(0, self.quiet[block] - 1)
            if len(seen) >= RATIO_JUDGED_FROM and not self.quiet[block]:
                median = _median(sorted(seen))
                if median > 0 and value > self.jump * median:
                    lines.append(f"warning: block {block}'s update/weight ratio {value / median:.1f}x its median "
                                 f"at step {step}: the loss may spike next (training goes on)")
                    self.quiet[block] = self.window
            seen.append(value)
        return lines


def watching(t) -> str:
    """What the run watches for, and what a spike leads to, in one line (`t`: the training config)."""
    names = {"the loss": t.spike_zscore, "the gradient norm": t.spike_grad_zscore}
    seen = [f"{name} ({z:g} sd)" for name, z in names.items() if z]
    if not seen:
        return "spikes: not watched (training.spike_zscore and spike_grad_zscore = 0)"
    unseen = [name for name, z in names.items() if not z]
    action = t.on_spike
    if action == "rollback":
        cut = (f", the learning rate × {t.spike_lr_factor:g} for {t.spike_lr_steps} steps, again at each further one"
               if t.spike_lr_factor < 1 and t.spike_lr_steps else "")
        action = f"rollback to the last checkpoint (at most {t.max_rollbacks}{cut}), then stop"
    return (f"spikes: {' and '.join(seen)} above the mean of the last {t.spike_window} steps, judged from the "
            f"{min(t.spike_window, JUDGED_FROM)}th step on (against the median while the window fills)"
            f"{'; not ' + ' or '.join(unseen) if unseen else ''}; a spike: {action} (training.on_spike)")

"""Where a run's time goes: its steps' parts and the work between steps, folded from its rows.

Each step row holds `parts`, the step's own seconds split at its boundaries (train/step_clock.py
measures them), and `between`, the seconds spent since the step before on other work; the `end` row
holds the last of that (the final evaluation and checkpoint). Summed here, never cut by a rollback:
time spent is spent. Pauses and waiting for commands are in neither: the shares are of the time the
engine worked. No torch.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Mapping

# A step's parts, in the order the step does them.
STEP_PARTS = ("data", "compute", "sync", "optimizer")  # and "layer_stats", on the steps that record them
# The work between steps, by what it is.
OUTSIDE = ("compile", "evaluation", "tasks", "samples", "checkpoints", "profile")
LABELS = {"data": "data", "compute": "forward+backward", "sync": "sync", "optimizer": "optimizer", "layer_stats": "layer stats",
          "compile": "compile", "evaluation": "validation", "tasks": "tasks", "samples": "samples",
          "checkpoints": "checkpoints", "profile": "profiling"}
RECENT_BETA = 0.9  # the live split's smoothing: about the last ten steps
RECENT_STEPS = 40  # the steps it is taken over (0.9^40: under 2 % of the weight is left beyond them)


def _added(into: dict[str, float], seconds: Mapping[str, float] | None) -> None:
    for name, value in (seconds or {}).items():
        into[name] = into.get(name, 0.0) + value


class Anatomy:
    """The run's seconds by part of a step and by work between steps, and the recent steps' split."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}  # summed over every step
        self.between: dict[str, float] = {}
        # The last steps' parts, for `recent`: kept, not smoothed as they come, since a folder's
        # first reading folds a million rows and only the last few make the split.
        self.last: deque[Mapping[str, float]] = deque(maxlen=RECENT_STEPS)

    def add(self, parts: Mapping[str, float] | None, between: Mapping[str, float] | None = None) -> None:
        if parts:
            _added(self.parts, parts)
            self.last.append(parts)
        if between:
            _added(self.between, between)

    @property
    def recent(self) -> dict[str, float]:
        """Each part's share of the recent steps, smoothed (RECENT_BETA, from the oldest kept)."""
        split: dict[str, float] = {}
        for parts in self.last:
            total = sum(parts.values())
            if total <= 0:
                continue
            if not split:
                split = {name: value / total for name, value in parts.items()}
            else:
                split = {n: RECENT_BETA * split.get(n, 0.0) + (1 - RECENT_BETA) * parts.get(n, 0.0) / total
                         for n in split.keys() | parts.keys()}
        return split

    def state(self) -> dict:
        return {"parts": self.parts, "between": self.between, "last": list(self.last)}

    @classmethod
    def from_state(cls, s: dict) -> Anatomy:
        """As `state` saved it; TypeError or ValueError for anything else."""
        a = cls()
        a.parts, a.between = ({str(k): float(v) for k, v in s.get(name, {}).items()} for name in ("parts", "between"))
        a.last.extend({str(k): float(v) for k, v in parts.items()} for parts in s.get("last", []))
        return a

    @property
    def steps(self) -> float:
        return sum(self.parts.values())

    @property
    def wall(self) -> float:
        """The seconds the engine worked: its steps and the work between them."""
        return self.steps + sum(self.between.values())

    def __bool__(self) -> bool:
        return self.wall > 0

    def shares(self) -> list[tuple[str, float]]:
        """(name, share of the wall time) for each part of a step, then each kind of work between
        steps, in their orders; a name never seen is left out."""
        wall = self.wall
        if wall <= 0:
            return []
        named = [(n, self.parts[n]) for n in ordered(self.parts, STEP_PARTS)]
        named += [(n, self.between[n]) for n in ordered(self.between, OUTSIDE)]
        return [(n, s / wall) for n, s in named]

    def compute_share(self) -> float | None:
        """The recent steps' share in forward and backward: MFU over it is what the model's own
        work reaches (the rest of the step stands between the MFU and that)."""
        return self.recent.get("compute") if self.recent else None

    def line(self) -> str:
        """One line: the steps' share with its parts, then the work between steps."""
        if not self:
            return ""
        wall = self.wall
        inside = ", ".join(f"{LABELS.get(n, n)} {pct(self.parts[n] / wall)}" for n in ordered(self.parts, STEP_PARTS))
        text = f"steps {pct(self.steps / wall)} ({inside})" if inside else "steps 0%"
        outside = [n for n in ordered(self.between, OUTSIDE) if self.between[n] > 0]
        if outside:
            text += "; " + ", ".join(f"{LABELS.get(n, n)} {pct(self.between[n] / wall)}" for n in outside)
        return text


def ordered(seconds: Mapping[str, float], order: Iterable[str]) -> list[str]:
    """The names of `seconds` in `order`, then any other (a newer engine's part) by name."""
    known = [n for n in order if n in seconds]
    return known + sorted(set(seconds) - set(known))


def pct(share: float) -> str:
    """A share as a percentage: whole from 10 %, one decimal under, "<0.1%" for a trace."""
    if share <= 0:
        return "0%"
    if share < 0.001:
        return "<0.1%"
    return f"{share * 100:.1f}%" if share < 0.1 else f"{share * 100:.0f}%"

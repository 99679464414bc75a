"""A step's time split at its boundaries, and the time spent between steps (run/anatomy.py folds both).

No synchronisation of its own: on a GPU each boundary records a CUDA event on the stream, and the
events are read once the step's own synchronisation (the trainer's, before it reports the step)
has completed them; on a CPU the work is done when the call returns, and `perf_counter` at each
boundary is the time it took. Either way the parts cover the step from its first boundary to its
last: they add up to it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch


class StepClock:
    """`start()`, then `mark(part)` at the end of each stretch of the step (the time since the
    previous mark is `part`'s; a part may come back, as data and compute do per micro-batch),
    then `read()` once the step has synchronised."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.parts: dict[str, float] = {}
        self.events: list[tuple[str, torch.cuda.Event]] = []
        self.last = 0.0

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.parts = {}
        if self.cuda:
            self.events = [("", self._event())]
        else:
            self.last = time.perf_counter()

    def mark(self, part: str) -> None:
        if self.cuda:
            self.events.append((part, self._event()))
            return
        now = time.perf_counter()
        self.parts[part] = self.parts.get(part, 0.0) + (now - self.last)
        self.last = now

    def read(self) -> dict[str, float]:
        """Seconds by part. On a GPU, only once the events are complete (after the step's sync)."""
        if self.cuda:
            for (_, before), (part, after) in zip(self.events, self.events[1:]):
                self.parts[part] = self.parts.get(part, 0.0) + before.elapsed_time(after) / 1000
            self.events = []
        return {part: round(seconds, 6) for part, seconds in self.parts.items()}


class Between:
    """Seconds of work between steps, by what (evaluation, tasks, samples, checkpoints, compile, profile),
    taken into the next step's row (or the end row)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def add(self, what: str, seconds: float) -> None:
        if seconds > 0:
            self.spent[what] = self.spent.get(what, 0.0) + seconds

    @contextlib.contextmanager
    def timing(self, what: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(what, time.perf_counter() - t0)

    def take(self) -> dict[str, float]:
        spent, self.spent = self.spent, {}
        return {what: round(seconds, 6) for what, seconds in spent.items()}

"""A run that has stopped moving: no word from its engine for far longer than its steps take.

A hung collective or a stuck filesystem leaves the engine alive and silent; nothing fails, and the
run is found hours later. Whichever process owns the engine (the run host, or `--run`'s headless
front-end) tells a StallWatch each time it hears from the engine and asks it, between events,
whether the silence has gone on too long: longer than notify.stall_after and than STEP_TIMES of the
run's own steps (a large model's step may take minutes), while it trains, evaluates or checkpoints.
The first event after the silence ends the stall by itself. The step time and the engine's state
are the run's (core/run/state.py's RunState, which the owner keeps): the watch folds nothing.

Silence, not steps: a long evaluation or a large data preparation says what it does as it goes
(state changes, progress); what says nothing at all is the stall. Torch: never.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .. import protocol as P
from ..run.state import RunState

STEP_TIMES = 20  # a silence this many step times long is no step that is merely slow
# Training and what it stops for. Preparing data and compiling take as long as the corpus and the
# compiler take, with no step time to weigh them against; paused and ended runs are silent by right.
WATCHED = {P.RUNNING, P.EVALUATING, P.CHECKPOINTING}


def duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds} s"
    minutes = seconds // 60
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


class StallWatch:
    def __init__(self, stall_after: float, run: RunState, clock: Callable[[], float] = time.monotonic):
        self.stall_after, self.run, self.clock = stall_after, run, clock
        self.heard_at = clock()
        self.stalled_since: float | None = None

    @property
    def step_time(self) -> float | None:
        """The run's step time, the figure every view of it shows."""
        return self.run.dt_ema

    @property
    def state(self) -> str:
        """The engine's own state, which a stall hides and its end gives back."""
        return self.run.engine_state

    @property
    def limit(self) -> float:
        return max(self.stall_after, STEP_TIMES * self.step_time) if self.step_time else self.stall_after

    def heard(self) -> str | None:
        """The engine said something; the line to say if that ends a stall."""
        now = self.clock()
        was, self.heard_at = self.stalled_since, now
        if was is None:
            return None
        self.stalled_since = None
        return f"training again after {duration(now - was)} without a word from the engine"

    def check(self) -> str | None:
        """The line to say if the silence has just become a stall; None otherwise (and while it lasts)."""
        if self.stalled_since is not None or self.state not in WATCHED:
            return None
        silence = self.clock() - self.heard_at
        if silence <= self.limit:
            return None
        self.stalled_since = self.heard_at
        steps = f"; its steps take {self.step_time:.2g} s" if self.step_time else ""
        return (f"stalled: no word from the engine for {duration(silence)} while {self.state}{steps} "
                f"(notify.stall_after = {self.stall_after:g} s). A hung collective or a stuck disk? It goes on by "
                "itself when the engine does")

    @property
    def stalled(self) -> bool:
        return self.stalled_since is not None

    @property
    def detail(self) -> str:
        """What a stalled state says beside it."""
        return f"no word for {duration(self.clock() - self.heard_at)}" if self.stalled else ""

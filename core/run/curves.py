"""Runs side by side: their loss curves and summaries, and the settings in which they differ.

A run folder read into its history (history_file: the summary the engine keeps and the rows of
metrics.jsonl after it, so a run of a million steps reads in a moment) and a summary, and the
settings in which several runs differ. What `lmcockpit compare`, the launch screen's compare view
and a dashboard's baseline overlay all read. No torch.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import ConfigError, read_toml
from ..step_schedules import Schedules
from . import history_file
from .folder import CONFIG, METRICS, run_summary
from .history import History, Point, ReadsHistory

AXES = ("step", "tokens", "time")
# Sections never read into a RunCurves: [notify] holds URLs with their tokens (a webhook's, an ntfy
# topic's) and says nothing of how a run trains, and whatever is read here is shown or compared.
UNSHOWN = frozenset({"notify"})


@dataclass
class RunCurves(ReadsHistory):
    """One run folder's history as it stands, and what a comparison says of it."""
    path: Path
    name: str
    config: dict[str, Any]  # config.toml flattened, less UNSHOWN's sections: {"optimizer.lr": 0.003, ...}
    tokens_per_step: int
    status: str  # run_summary's: the engine's final state (finished, aborted, interrupted, failed), stopped or empty
    history: History = field(default_factory=History)
    schedules: Schedules | None = None  # a batch or length schedule: each step's tokens differ

    def tokens_through(self, step: int) -> int:
        """Tokens seen through `step`, as the trainer counts them."""
        return self.schedules.tokens_before(step) if self.schedules else step * self.tokens_per_step

    # ------------------------------------------------------------------ summary
    @property
    def has_steps(self) -> bool:
        return self.history.count > 0

    @property
    def last_step(self) -> int:
        return self.history.last_step

    @property
    def final_loss(self) -> float | None:
        return self.history.loss

    @property
    def final_loss_ema(self) -> float | None:
        return self.history.ema

    @property
    def best_val(self) -> tuple[float, int] | None:
        """(the lowest validation loss, its step)."""
        if not self.history.evals:
            return None
        step, loss, _ = min(self.history.evals, key=lambda e: e[1])
        return loss, step

    @property
    def last_tasks(self) -> dict[str, float]:
        """Each task's accuracy when it was last scored."""
        return {name: points[-1][1] for name, points in self.tasks.items() if points}

    @property
    def last_core(self) -> float | None:
        return self.core[-1][1] if self.core else None

    @property
    def median_tokens_per_s(self) -> float | None:
        """What the run sustains: the median of its tokens/s at the finest resolution (each step
        while the run is shorter than the buckets' cap), the first step left out where it stands
        alone: it compiles and warms up."""
        points = self.history.resolution(0)
        rates = [p.tokens_per_s for p in (points[1:] if points and points[0].n == 1 else points)] or \
            [p.tokens_per_s for p in points]
        return statistics.median(rates) if rates else None

    @property
    def train_time(self) -> float:
        """Training seconds through the last step (pauses left out)."""
        return self.history.time

    # -------------------------------------------------------------------- axes
    def curve(self, axis: str, most: int) -> tuple[list[float], list[Point]]:
        """The train curve in at most `most` points, and each point's x on `axis`: the step, tokens
        seen (as the trainer counts them, a whole step's at a time, each its own under a schedule)
        or training seconds."""
        points = self.history.points(most)
        if axis == "step":
            return [p.step for p in points], points
        if axis == "tokens":
            return [self.tokens_through(p.step) for p in points], points
        if axis == "time":
            return [p.time for p in points], points
        raise ValueError(f"axis {axis!r}: expected one of {', '.join(AXES)}")

    def val_x(self, axis: str) -> list[float]:
        """Each evaluation's x on `axis` (its time: the training seconds through its step)."""
        if axis == "time":
            return [self.history.time_at(s) for s in self.val_steps]
        if axis in ("step", "tokens"):
            return [float(self.tokens_through(s) if axis == "tokens" else s) for s in self.val_steps]
        raise ValueError(f"axis {axis!r}: expected one of {', '.join(AXES)}")

    def largest_x(self, axis: str) -> float:
        """The furthest x of the run on `axis`."""
        if axis not in AXES:
            raise ValueError(f"axis {axis!r}: expected one of {', '.join(AXES)}")
        last = {"step": self.last_step, "tokens": self.tokens_through(self.last_step),
                "time": self.history.time}[axis] if self.has_steps else 0.0
        return max([float(last), *self.val_x(axis)[-1:]])


def flatten(raw: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested TOML tables as dotted keys; lists (a mixture's [[data.sources]]) stay one value."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def load_run(path: str | Path) -> RunCurves:
    """A run folder's curves and summary; a ConfigError naming the path when it is not one.

    The one call a dashboard needs for a baseline: `run.curve(axis, points)`, `run.val_x(axis)`
    against `run.val_losses`."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{path}: no such run folder")
    if not (path / CONFIG).is_file():
        raise ConfigError(f"{path}: not a run folder (expected {CONFIG} and {METRICS} in it)")
    config = flatten({section: values for section, values in read_toml(path / CONFIG).items() if section not in UNSHOWN})
    t = {k.split(".", 1)[1]: config.get(k, 1) for k in
         ("training.micro_batch_size", "training.grad_accum_steps", "training.seq_len")}
    world = config.get("distributed.nproc", 1) * config.get("distributed.nnodes", 1)
    # As Config.tokens_per_step reads it; a resume on another process count rescales accumulation
    # so that this product stays what it was (resume.same_sequences_per_step).
    tokens_per_step = t["micro_batch_size"] * t["grad_accum_steps"] * t["seq_len"] * world
    stages = config.get("training.batch_schedule") or [], config.get("training.seq_len_schedule") or []
    schedules = Schedules(*stages, config.get("training.max_steps", 1), t["seq_len"], t["grad_accum_steps"],
                          t["grad_accum_steps"] * world, tokens_per_step) if any(stages) else None
    run = RunCurves(path, path.name, config, tokens_per_step, run_summary(path)["status"], schedules=schedules)
    if (path / METRICS).is_file():
        run.history = history_file.load(path)[0]
    return run


def differing_settings(runs: list[RunCurves]) -> list[str]:
    """The config keys whose values are not the same in every run (a key some lack counts as
    differing), in the order the configs list them."""
    keys = list(dict.fromkeys(k for run in runs for k in run.config))
    return [k for k in keys if any(k not in run.config or run.config[k] != runs[0].config.get(k) for run in runs)]


def load_runs(paths: list[str | Path]) -> list[RunCurves]:
    return [load_run(p) for p in paths]

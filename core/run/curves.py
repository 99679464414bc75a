"""Runs side by side: their loss curves and summaries, and the settings in which they differ.

A run folder read into its loss curves and a summary, and the settings in
which several runs differ. What `lmcockpit compare`, the launch screen's compare view and a
dashboard's baseline overlay all read. No torch.

metrics.jsonl is streamed a line at a time and only numbers are kept: a long run's file holds
hundreds of thousands of lines. A resumed run's file may hold steps twice (a run that went past
its last checkpoint, then was continued from it): the later rows are the run as it stands, so a
step row cuts every step and evaluation at or past its step that came before it.
"""

from __future__ import annotations

import json
import statistics
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from ..config import ConfigError, read_toml
from .folder import CONFIG, METRICS, run_summary, well_formed

AXES = ("step", "tokens", "time")
EMA_BETA = 0.9


def ema(values: list[float], beta: float = EMA_BETA) -> list[float]:
    """Bias-corrected exponential moving average, as training dashboards smooth a loss."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i))
    return out


@dataclass
class RunCurves:
    """One run folder's history as it stands, and what a comparison says of it."""
    path: Path
    name: str
    config: dict[str, Any]  # config.toml flattened: {"optimizer.lr": 0.003, ...}
    tokens_per_step: int
    status: str  # finished, failed, stopped or empty (the launch screen's verdict)
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # training seconds through each step: pauses left out
    tokens_per_s: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)
    # Each task's accuracy, and CORE, as (step, value): scored on a cadence of their own
    # (eval.tasks_every), and a task may be scored at some evaluations and not others.
    tasks: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    core: list[tuple[int, float]] = field(default_factory=list)

    # ------------------------------------------------------------------ summary
    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None

    @cached_property
    def smoothed(self) -> list[float]:
        """The train loss's EMA, computed once: charts redraw it many times, and a run is read whole."""
        return ema(self.losses)

    @property
    def final_loss_ema(self) -> float | None:
        return self.smoothed[-1] if self.losses else None

    @property
    def best_val(self) -> tuple[float, int] | None:
        """(the lowest validation loss, its step)."""
        if not self.val_losses:
            return None
        i = min(range(len(self.val_losses)), key=self.val_losses.__getitem__)
        return self.val_losses[i], self.val_steps[i]

    @property
    def last_tasks(self) -> dict[str, float]:
        """Each task's accuracy when it was last scored."""
        return {name: points[-1][1] for name, points in self.tasks.items() if points}

    @property
    def last_core(self) -> float | None:
        return self.core[-1][1] if self.core else None

    @property
    def median_tokens_per_s(self) -> float | None:
        """The first step compiles and warms up: a median of the others says what the run sustains."""
        rates = self.tokens_per_s[1:] or self.tokens_per_s
        return statistics.median(rates) if rates else None

    @property
    def train_time(self) -> float:
        return self.times[-1] if self.times else 0.0

    # -------------------------------------------------------------------- axes
    def x(self, axis: str, steps: list[int] | None = None) -> list[float]:
        """The x value of each of `steps` (default: the train steps) on `axis`: the step, tokens
        seen (as the trainer counts them, a whole step's at a time) or training seconds."""
        steps = self.steps if steps is None else steps
        if axis == "step":
            return [float(s) for s in steps]
        if axis == "tokens":
            return [float(s * self.tokens_per_step) for s in steps]
        if axis == "time":
            # an evaluation comes after its step's row: the time through the last step at or before it
            return [self.times[i - 1] if (i := bisect_right(self.steps, s)) else 0.0 for s in steps]
        raise ValueError(f"axis {axis!r}: expected one of {', '.join(AXES)}")

    def val_x(self, axis: str) -> list[float]:
        return self.x(axis, self.val_steps)


def axis_scale(axis: str, largest: float) -> tuple[str, float]:
    """The axis's label and the unit its values are divided by, so that ticks stay short."""
    units = {"step": [("step", 0, 1.0)],
             "tokens": [("tokens (billions)", 1e9, 1e9), ("tokens (millions)", 1e6, 1e6),
                        ("tokens (thousands)", 1e3, 1e3), ("tokens", 0, 1.0)],
             # minutes from 2 of them on, hours from 2 hours: no axis of 0.0 to 1.9
             "time": [("training time (h)", 7200, 3600.0), ("training time (min)", 120, 60.0),
                      ("training time (s)", 0, 1.0)]}[axis]
    return next((label, unit) for label, threshold, unit in units if largest >= threshold)


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

    The one call a dashboard needs for a baseline: `run.x(axis)` against `run.losses` (or
    `ema(run.losses)`), `run.val_x(axis)` against `run.val_losses`."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{path}: no such run folder")
    if not (path / CONFIG).is_file():
        raise ConfigError(f"{path}: not a run folder (expected {CONFIG} and {METRICS} in it)")
    config = flatten(read_toml(path / CONFIG))
    t = {k.split(".", 1)[1]: config.get(k, 1) for k in
         ("training.micro_batch_size", "training.grad_accum_steps", "training.seq_len")}
    world = config.get("distributed.nproc", 1) * config.get("distributed.nnodes", 1)
    # As Config.tokens_per_step reads it; a resume on another process count rescales accumulation
    # so that this product stays what it was (resume.same_sequences_per_step).
    tokens_per_step = t["micro_batch_size"] * t["grad_accum_steps"] * t["seq_len"] * world
    run = RunCurves(path, path.name, config, tokens_per_step, run_summary(path)["status"])
    read_curves(path / METRICS, run)
    return run


def read_curves(metrics: Path, run: RunCurves) -> None:
    if not metrics.is_file():
        return
    with open(metrics, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                row = json.loads(line)
                kind, step = row["kind"], int(row["step"])
                if kind == "step":
                    add_step(run, step, float(row["loss"]), float(row.get("dt") or 0.0),
                             float(row.get("tokens_per_s") or 0.0))
                elif kind == "eval" and well_formed(row):  # its tasks are read whole, or not at all
                    add_eval(run, step, row.get("val_loss"), row.get("tasks") or {}, row.get("core"))
            except (json.JSONDecodeError, RecursionError, KeyError, TypeError, ValueError):
                continue  # a line cut short by a kill, or not ours


def add_step(run: RunCurves, step: int, loss: float, dt: float, tokens_per_s: float) -> None:
    if run.steps and step <= run.steps[-1]:  # the run went on from an earlier point: this is the run now
        cut = bisect_left(run.steps, step)
        del run.steps[cut:], run.losses[cut:], run.times[cut:], run.tokens_per_s[cut:]
        del_val = bisect_left(run.val_steps, step)
        del run.val_steps[del_val:], run.val_losses[del_val:]
        for points in [*run.tasks.values(), run.core]:
            cut_points(points, step)
    run.steps.append(step)
    run.losses.append(loss)
    run.times.append((run.times[-1] if run.times else 0.0) + dt)
    run.tokens_per_s.append(tokens_per_s)


def add_eval(run: RunCurves, step: int, val_loss: float | None,
             tasks: dict[str, dict[str, float]] | None = None, core: float | None = None) -> None:
    """An evaluation's points, each on its own curve: a row may hold the validation loss, the
    task scores, or both."""
    if val_loss is not None:
        if run.val_steps and step <= run.val_steps[-1]:
            cut = bisect_left(run.val_steps, step)
            del run.val_steps[cut:], run.val_losses[cut:]
        run.val_steps.append(step)
        run.val_losses.append(float(val_loss))
    for name, scores in (tasks or {}).items():
        add_point(run.tasks.setdefault(name, []), step, float(scores["accuracy"]))
    if core is not None:
        add_point(run.core, step, float(core))


def add_point(points: list[tuple[int, float]], step: int, value: float) -> None:
    cut_points(points, step)  # scored again at a step it had reached: the run went on from earlier
    points.append((step, value))


def cut_points(points: list[tuple[int, float]], step: int) -> None:
    """`points` without those at or past `step`."""
    del points[bisect_left(points, step, key=lambda p: p[0]):]


def differing_settings(runs: list[RunCurves]) -> list[str]:
    """The config keys whose values are not the same in every run (a key some lack counts as
    differing), in the order the configs list them."""
    keys = list(dict.fromkeys(k for run in runs for k in run.config))
    return [k for k in keys if any(k not in run.config or run.config[k] != runs[0].config.get(k) for run in runs)]


def load_runs(paths: list[str | Path]) -> list[RunCurves]:
    return [load_run(p) for p in paths]

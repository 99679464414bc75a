"""The batch-size and sequence-length schedules: what each step takes, as a pure function of the step.

modded-nanogpt's records train on smaller batches and shorter sequences early and the full ones
later. Here both are lists of stages, [fraction of training.max_steps, value], each value holding
from step ⌊fraction · max_steps⌋ (0-based) to the next stage; before the first stage, the full one:

* `training.batch_schedule`: the share of the full step's sequences (micro_batch_size ×
  grad_accum_steps × processes) a step takes. Only accumulation varies: a micro-batch keeps its
  shape, so compilation and memory stay as they are. A share must make whole micro-batches on every
  process (share × grad_accum_steps a whole number) and whole batches of the run's data unit.
* `training.seq_len_schedule`: the sequence length, at most training.seq_len (which memory is
  sized for). Each length is a shape of its own: a compiled model compiles once more per length.

A step's data stays a pure function of (seed, step): the first batch a step draws is the number of
batches every step before it drew (`first_batch`), counted stage by stage, so a resume from any
step, before or after a change, draws what the uninterrupted run drew. Tokens seen, throughput and
MFU count each step's own tokens (`step_tokens`), the data budget all of them (`run_tokens`).

Torch-free and numpy-free, beside config (which checks the keys with it) below every floor: the
data budget, the compute estimate and the trainer read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def stage_starts(stages: list[list[Any]], max_steps: int) -> list[tuple[int, Any]]:
    """(first 0-based step, value) of each stage, in order."""
    return [(math.floor(float(fraction) * max_steps + 1e-9), value) for fraction, value in stages]


def value_at(stages: list[list[Any]], max_steps: int, step: int, full: Any) -> Any:
    """The value at 0-based `step`: the last stage begun by then, else `full`."""
    value = full
    for start, v in stage_starts(stages, max_steps):
        if start <= step:
            value = v
    return value


def entry_problem(entry: Any, what: str) -> str | None:
    """Why one stage of a schedule is malformed (config.py's check of each item), or None.
    `what`: "share" (a batch share in (0, 1]) or "length" (a positive whole number)."""
    if not (isinstance(entry, list) and len(entry) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in entry)):
        return f": expected [fraction of max_steps, {what}], two numbers"
    fraction, value = entry
    if not 0 <= fraction < 1:
        return f"has fraction {fraction}: expected one in [0, 1) (of training.max_steps)"
    if what == "share" and not 0 < value <= 1:
        return f"has share {value}: expected one in (0, 1] (of the step's sequences)"
    if what == "length" and not (isinstance(value, int) and value > 0):
        return f"has length {value}: expected a positive whole number of tokens"
    return None


def order_problem(key: str, stages: list[list[Any]]) -> str | None:
    fractions = [f for f, _ in stages]
    if any(b <= a for a, b in zip(fractions, fractions[1:])):
        return f"{key}: the stages' fractions {fractions} must increase"
    return None


@dataclass(frozen=True)
class Schedules:
    """A run's schedules against its data unit: `per_step` batches of `rows` sequences make the
    full step (batches.DataUnit), `accum` micro-batches of each process, `max_steps` the run's."""
    batch: list[list[Any]]
    seq: list[list[Any]]
    max_steps: int
    full_seq_len: int
    accum: int
    per_step: int
    full_tokens: int  # the full step's tokens, every process's (Config.tokens_per_step)

    @classmethod
    def of(cls, cfg, per_step: int | None = None) -> Schedules:
        """`cfg`'s; `per_step`: the data unit's batches a full step (default: as a new run draws them)."""
        t = cfg.training
        return cls(t.batch_schedule, t.seq_len_schedule, t.max_steps, t.seq_len, t.grad_accum_steps,
                   per_step or t.grad_accum_steps * cfg.world, cfg.tokens_per_step)

    @property
    def active(self) -> bool:
        return bool(self.batch or self.seq)

    def share(self, step: int) -> float:
        return float(value_at(self.batch, self.max_steps, step, 1.0))

    def accum_at(self, step: int) -> int:
        """This process's micro-batches at 0-based `step`."""
        return round(self.share(step) * self.accum)

    def batches_at(self, step: int) -> int:
        """The data unit's batches step `step` draws."""
        return round(self.share(step) * self.per_step)

    def seq_len(self, step: int) -> int:
        return int(value_at(self.seq, self.max_steps, step, self.full_seq_len))

    def first_batch(self, step: int) -> int:
        """The first batch (batches.global_index's numbering) 0-based `step` draws: all the
        batches of the steps before it, summed stage by stage."""
        if not self.batch:
            return step * self.per_step
        bounds = [0] + [s for s, _ in stage_starts(self.batch, self.max_steps) if s > 0] + [math.inf]
        total = 0
        for lo, hi in zip(bounds, bounds[1:]):
            if lo >= step:
                break
            total += (min(hi, step) - lo) * self.batches_at(lo)
        return total

    def step_tokens(self, step: int) -> int:
        """Every process's tokens at 0-based `step`."""
        return round(self.full_tokens * self.share(step) * self.seq_len(step) / self.full_seq_len)

    def tokens_before(self, step: int) -> int:
        """The tokens of steps 0 to `step` - 1, summed between change points."""
        if not self.active:
            return step * self.full_tokens
        points = sorted({0, *(s for s, _ in stage_starts(self.batch + self.seq, self.max_steps)), step})
        return sum((min(hi, step) - lo) * self.step_tokens(lo) for lo, hi in zip(points, points[1:]) if lo < step)

    def problem(self) -> str | None:
        """Why a share does not make whole micro-batches and whole data batches, or None."""
        for _, share in self.batch:
            if not (math.isclose(share * self.accum, round(share * self.accum))
                    and math.isclose(share * self.per_step, round(share * self.per_step)) and round(share * self.accum)):
                return (f"training.batch_schedule's share {share} must make whole micro-batches: share × "
                        f"training.grad_accum_steps ({self.accum}) and share × the step's batches ({self.per_step}) "
                        "must be whole numbers above 0")
        return None

    def change(self, step: int, resumed_at: int | None = None) -> str | None:
        """The log line when a schedule moves to a new stage at 0-based `step` (or where a resumed
        run starts within one): what a step now takes."""
        starts = {s for s, _ in stage_starts(self.batch + self.seq, self.max_steps)}
        if not self.active or (step not in starts and step != resumed_at):
            return None
        accum, seq_len = self.accum_at(step), self.seq_len(step)
        return (f"schedule: from step {step + 1}, {accum} micro-batch(es) a process ({self.share(step):g} of the "
                f"step's sequences), sequence length {seq_len}: {self.step_tokens(step):,} tokens a step")


def run_tokens(cfg) -> int:
    """Every token the run's steps take."""
    return Schedules.of(cfg).tokens_before(cfg.training.max_steps)

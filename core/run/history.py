"""A run's history at a size that does not grow with the run: what a chart of it can show.

A run of days logs a million steps; a viewer that kept every one held a gigabyte and redrew them
all. This holds instead, whatever the run's length:

* every step row folded into buckets of a width in steps (`Buckets`): per bucket the count and the
  sum, minimum and maximum of the step, the training time, the loss, its smoothed value, the
  learning rate and tokens/s. At most CAP buckets: past that the width doubles and neighbours
  merge, so a bucket's figures are always exact over the rows it covers, and coarser resolutions
  (the width × 2^m, `resolution(m)`) are exact merges of it;
* the most recent rows exact as well (`tail`): at least TAIL_MIN, and every row of the buckets
  since the last checkpoint (up to TAIL_MAX), so that a rollback or a resume, which go back to a
  checkpoint, can cut the buckets and fold those rows again;
* every evaluation, task score, checkpoint, spike, rollback, target and sample, exactly;
* the last profile of a few steps, its summary and trace (a `profile` row);
* the last records of each block's health (`layers` rows, layer_history.py);
* the smoothed loss carried forward (its running sum and count), never recomputed whole.

Fed a step at a time (`add`, `fold`) by the engine, the run host's viewers and the readers of
a run folder; `cut` drops what a run that went back redoes. A cut into buckets whose rows have
left the tail (a rollback after a checkpoint interval longer than TAIL_MAX) cannot be undone: it
says so (returns False). A folder's reader then folds the file again knowing every cut in advance
(history_file.py); a live view (the run host's, and the copies it hands its viewers) goes on
without the rows of the one bucket it cut into, until a host started on the run reads the folder again.

Saved as JSON (`state`, `from_state`): numbers and strings only, floats as repr gives them, so a
history read back is the one written. No torch.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

from .. import protocol as P
from . import rows
from .anatomy import Anatomy
from .layer_history import LayerWindow

EMA_BETA = 0.9
CAP = 2048  # buckets at the finest resolution: a chart is at most a few hundred points wide
TAIL_MIN = 1024  # the most recent rows kept exact, always
TAIL_MAX = 16384  # rows kept exact at most, however long ago the last checkpoint was

# What a bucket holds of each step row, in this order: count, then sum, minimum and maximum of each.
FIELDS = ("step", "time", "loss", "ema", "lr", "tokens_per_s")
NF = len(FIELDS)
N, SUM, MIN, MAX = 1, 2, 2 + NF, 2 + 2 * NF  # a bucket: [index, count, sums..., minima..., maxima...]


class Row(NamedTuple):
    """One step row as the history keeps it exact."""
    step: int
    time: float  # training seconds through this step
    loss: float
    ema: float  # the smoothed loss through this step
    lr: float
    tokens_per_s: float


def _new_bucket(index: int, row: tuple[float, ...]) -> list[float]:
    return [index, 1, *row, *row, *row]


def _add_row(bucket: list[float], row: tuple[float, ...]) -> None:
    bucket[N] += 1
    for i, v in enumerate(row):
        bucket[SUM + i] += v
        if v < bucket[MIN + i]:
            bucket[MIN + i] = v
        if v > bucket[MAX + i]:
            bucket[MAX + i] = v


def _merge(into: list[float], other: list[float]) -> None:
    into[N] += other[N]
    for i in range(NF):
        into[SUM + i] += other[SUM + i]
        into[MIN + i] = min(into[MIN + i], other[MIN + i])
        into[MAX + i] = max(into[MAX + i], other[MAX + i])


def merged(buckets: Iterable[list[float]], factor: int) -> list[list[float]]:
    """`buckets` (in step order) as buckets `factor` times as wide: those whose index // factor
    agree, merged."""
    out: list[list[float]] = []
    for b in buckets:
        index = int(b[0]) // factor
        if out and out[-1][0] == index:
            _merge(out[-1], b)
        else:
            out.append([index, *b[1:]])
    return out


class Buckets:
    """Step rows folded into buckets of `width` steps (bucket i: steps i·width to (i+1)·width − 1),
    at most CAP of them: the width doubles when a new bucket would make CAP + 1."""

    def __init__(self, width: int = 1, buckets: list[list[float]] | None = None):
        self.width = width
        self.buckets: list[list[float]] = buckets or []
        self.generation = 0  # counts merges and cuts: what a reader's cache of the buckets depends on

    def add(self, row: tuple[float, ...]) -> None:
        index = int(row[0]) // self.width
        if self.buckets and self.buckets[-1][0] == index:
            _add_row(self.buckets[-1], row)
            return
        self.buckets.append(_new_bucket(index, row))
        while len(self.buckets) > CAP:
            self.width *= 2
            self.buckets = merged(self.buckets, 2)
            self.generation += 1

    @property
    def last_step(self) -> int | None:
        return int(self.buckets[-1][MAX]) if self.buckets else None


@dataclass(frozen=True)
class Point:
    """One point of a curve at some resolution: a bucket's figures, or one exact row."""
    n: int
    step: float  # the mean step of its rows: where a chart puts it
    time: float  # their mean training time (seconds)
    first_step: int
    last_step: int
    loss: float  # mean
    loss_min: float
    loss_max: float
    ema: float  # the smoothed loss, mean over the bucket
    lr: float
    tokens_per_s: float

    @classmethod
    def of(cls, b: list[float]) -> Point:
        n = int(b[N])
        mean = [b[SUM + i] / n for i in range(NF)]
        return cls(n, mean[0], mean[1], int(b[MIN]), int(b[MAX]), mean[2], b[MIN + 2], b[MAX + 2], mean[3],
                   mean[4], mean[5])


class History:
    """One run's history, bounded (see the module's docstring). Step rows are tuples in FIELDS'
    order; `last` is the last step as the engine said it (grad norm, MFU, step time, memory)."""

    def __init__(self) -> None:
        self.buckets = Buckets()
        self.tail: deque[Row] = deque()
        self.ema_sum = 0.0  # the smoothed loss before its bias correction
        self.count = 0  # step rows in the curve, bucketed and exact
        self.time = 0.0  # training seconds through the last step (pauses left out)
        self.first_loss: float | None = None
        # The last step's event, or its row as read (made an event when first asked for: a folder's
        # reader folds a million rows and needs one); None after a cut.
        self._last: P.StepMetrics | dict[str, Any] | None = None
        self.checkpoint_step = -1  # rows at or before it may leave the tail: no rollback goes behind it
        self.evals: list[tuple[int, float | None, float | None]] = []  # (step, val_loss, val_bpb) with a val loss
        self.tasks: dict[str, list[tuple[int, float]]] = {}  # each task's accuracy by step
        self.last_task_scores: dict[str, dict[str, float]] = {}  # each task's scores when last scored
        self.core: list[tuple[int, float]] = []
        self.checkpoints: list[tuple[int, str]] = []
        self.spikes: list[tuple[int, float, str]] = []  # (step, loss, action): never cut
        self.rollbacks: list[tuple[int, int]] = []  # (spike step, to step): never cut
        self.targets: list[tuple[int, str, float, float]] = []
        self.samples: list[tuple[int, str, str]] = []  # (step, prompt, text)
        self.profile: P.Profiled | None = None  # the last profile (core/train/profiling.py); never cut
        self.anatomy = Anatomy()  # never cut: time spent is spent
        self.layers = LayerWindow()  # the last `layers` records, cut with the steps
        self._cache: dict[int, tuple[tuple, list[Point]]] = {}  # by resolution: _settled's points

    # ------------------------------------------------------------------------- folding
    def add(self, event: P.StepMetrics) -> None:
        """A step; one at or before the last step first cuts (`cut`) what it redoes. Its other
        figures (grad norm, MFU, memory) are kept for the last step only."""
        self.add_step(event.step, event.loss, event.lr, event.dt, event.tokens_per_s)
        self.anatomy.add(event.parts, event.between)
        self._last = event

    @property
    def last(self) -> P.StepMetrics | None:
        if isinstance(self._last, dict):
            self._last = rows.event_of(self._last)
        return self._last

    def add_step(self, step: int, loss: float, lr: float, dt: float, tokens_per_s: float) -> None:
        """A step's figures the curves are drawn from (`add`, less what only the last step keeps)."""
        if self.count and step <= self.last_step:
            self.cut(step)
        self.ema_sum = EMA_BETA * self.ema_sum + (1 - EMA_BETA) * loss
        self.count += 1
        self.time += dt
        if self.first_loss is None:
            self.first_loss = loss
        row = Row(step, self.time, loss, self.ema_sum / (1 - EMA_BETA ** self.count), lr, tokens_per_s)
        self.buckets.add(row)
        self.tail.append(row)
        if len(self.tail) > TAIL_MIN:
            self._trim()

    def _trim(self) -> None:
        """The tail without rows no cut can reach: those before the bucket that holds the step
        after the last checkpoint (where a rollback or a resume goes back to)."""
        tail, keep = self.tail, (self.checkpoint_step + 1) // self.width * self.width
        while len(tail) > TAIL_MIN and (tail[0][0] < keep or len(tail) > TAIL_MAX):
            tail.popleft()

    def add_eval(self, step: int, val_loss: float | None, val_bpb: float | None = None,
                 tasks: dict[str, dict[str, float]] | None = None, core: float | None = None) -> None:
        """An evaluation: the validation loss, the task scores, or both (each has its own cadence)."""
        if val_loss is not None:
            del self.evals[bisect_left(self.evals, step, key=lambda e: e[0]):]
            self.evals.append((step, float(val_loss), val_bpb))
        for name, scores in (tasks or {}).items():
            points = self.tasks.setdefault(name, [])
            del points[bisect_left(points, step, key=lambda p: p[0]):]
            points.append((step, float(scores["accuracy"])))
            self.last_task_scores[name] = dict(scores)
        if core is not None:
            del self.core[bisect_left(self.core, step, key=lambda p: p[0]):]
            self.core.append((step, float(core)))

    def add_checkpoint(self, step: int, path: str) -> None:
        self.checkpoints.append((step, path))
        self.checkpoint_step = max(self.checkpoint_step, step)
        self._trim()

    def fold(self, row: dict[str, Any]) -> None:
        """A metrics.jsonl row, well formed (rows.well_formed)."""
        kind, step = row.get("kind"), row.get("step")
        if kind == "step":
            self.add_step(step, float(row["loss"]), float(row["lr"]), float(row.get("dt") or 0.0),
                          float(row.get("tokens_per_s") or 0.0))
            self._last = row  # as written: its grad norm, MFU and memory are what a panel shows of the last step
            if "parts" in row:
                self.anatomy.add(row["parts"], row.get("between"))
        elif kind == "end":
            self.anatomy.add(None, row.get("between"))
        elif kind == "eval":
            self.add_eval(step, row.get("val_loss"), row.get("val_bpb"), row.get("tasks") or {}, row.get("core"))
        elif kind == "checkpoint":
            self.add_checkpoint(step, row["path"])
        elif kind == "spike":
            self.spikes.append((step, float(row["loss"]), row["action"]))
        elif kind == "rollback":
            self.rollbacks.append((step, row["to_step"]))
        elif kind == "target":
            self.targets.append((step, row["what"], float(row["value"]), float(row["target"])))
        elif kind == "sample":
            self.samples.append((step, str(row.get("prompt", "")), str(row.get("text", ""))))
        elif kind == "profile":
            self.profile = rows.event_of(row)
        elif kind == "layers":
            self.layers.fold(row)

    def cut(self, step: int) -> bool:
        """Drop every step, evaluation, checkpoint, target, sample and layer record at or past `step`:
        the run went back and redoes them (spikes and rollbacks stay: they happened). False when rows at or past
        `step` had left the tail already: this history is then no longer the run's, and must be
        built again from the run's folder."""
        buckets, tail = self.buckets.buckets, self.tail
        k = len(buckets)
        while k and buckets[k - 1][MAX] >= step:
            k -= 1
        start = buckets[k][MIN] if k < len(buckets) else step
        # Exact when the tail holds every row of the buckets cut into (all rows, or from `start` on).
        exact = k == len(buckets) or len(tail) == self.count or bool(tail) and tail[0][0] <= start
        if k < len(buckets):
            del buckets[k:]
            self.buckets.generation += 1
        while tail and tail[-1][0] >= step:
            tail.pop()
        for row in tail:
            if row[0] >= start:
                self.buckets.add(row)
        self.count = sum(int(b[N]) for b in buckets)
        last = self.tail[-1] if self.tail else None
        self.time = last[1] if last else 0.0
        # The smoothed value as it stood: the bias-corrected value times the correction undone.
        self.ema_sum = last[3] * (1 - EMA_BETA ** self.count) if last else 0.0
        if last is None and not self.count:
            self.first_loss = None
        self._last = None  # its grad norm, MFU and memory are the next step's to say
        for points in (self.evals, self.core, self.checkpoints, self.targets, self.samples, *self.tasks.values()):
            del points[bisect_left(points, step, key=lambda p: p[0]):]
        self.checkpoint_step = self.checkpoints[-1][0] if self.checkpoints else -1
        self.layers.cut(step)
        return exact

    # -------------------------------------------------------------------------- reading
    @property
    def last_step(self) -> int:
        if self.tail:
            return int(self.tail[-1][0])
        return self.buckets.last_step or 0

    def recent(self) -> list[Row]:
        """The most recent rows, exact: every row of a run shorter than TAIL_MIN steps."""
        return list(self.tail)

    @property
    def loss(self) -> float | None:
        return self.tail[-1][2] if self.tail else None

    @property
    def ema(self) -> float | None:
        return self.tail[-1][3] if self.tail else None

    def time_at(self, step: int) -> float:
        """Training seconds through the last step at or before `step`: exact among the recent rows,
        else read off its bucket (its first and last rows' times, in proportion)."""
        tail = self.tail
        if tail and step >= tail[0].step:
            i = bisect_right(tail, step, key=lambda r: r.step)
            return tail[i - 1].time
        buckets = self.buckets.buckets
        i = bisect_left(buckets, step, key=lambda b: b[MAX])
        if i == len(buckets):
            return self.time
        b = buckets[i]
        if step < b[MIN]:  # between two buckets, or before the first
            return buckets[i - 1][MAX + 1] if i else 0.0
        span = b[MAX] - b[MIN]
        return b[MIN + 1] + (b[MAX + 1] - b[MIN + 1]) * ((step - b[MIN]) / span if span else 1.0)

    @property
    def width(self) -> int:
        """Steps per bucket at the finest resolution."""
        return self.buckets.width

    def resolution(self, m: int = 0) -> list[Point]:
        """The whole curve in buckets of width·2^m steps, the exact tail folded in as it would be."""
        settled, rest = self._settled(m)
        return [*settled, *(Point.of(b) for b in merged(rest, 2**m))]

    def points(self, most: int, lo: float | None = None, hi: float | None = None) -> list[Point]:
        """The curve between steps `lo` and `hi` (the whole of it by default) in at most about
        `most` points: the exact rows where they fit, else the finest resolution that fits. A
        bucket that straddles `lo` or `hi` is drawn whole."""
        if not self.count:
            return []
        first = self.buckets.buckets[0][MIN] if self.buckets.buckets else self.tail[0][0]
        lo = first if lo is None else max(lo, first)
        hi = self.last_step if hi is None else min(hi, self.last_step)
        if hi < lo:
            return []
        m = 0
        while (hi - lo) // (self.width * 2**m) + 1 > max(1, most):
            m += 1
        return [p for p in self.resolution(m) if p.last_step >= lo and p.first_step <= hi]

    def _settled(self, m: int) -> tuple[list[Point], list[list[float]]]:
        """The points of the bucketed rows at width·2^m that no new row can change, and the
        buckets after them. A chart redraws a few times a second: the first part, nearly all of
        it, is kept until the buckets are merged or cut."""
        buckets, factor = self.buckets.buckets, 2**m
        done = len(buckets)
        if buckets:  # the last bucket, and those that merge with it at this width, may still change
            last = int(buckets[-1][0]) // factor
            while done and int(buckets[done - 1][0]) // factor == last:
                done -= 1
        key = (self.buckets.width, self.buckets.generation, done)
        cached = self._cache.get(m)
        if cached is None or cached[0] != key:  # a chart and a sparkline each ask at a width of theirs
            cached = self._cache[m] = key, [Point.of(b) for b in merged(buckets[:done], factor)]
        return cached[1], buckets[done:]

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a run host hands its history to each viewer that joins) without the chart's
        cache of points, which the viewer's own charts fill at their widths."""
        return {**self.__dict__, "_cache": {}}

    # ---------------------------------------------------------------------------- saved
    def state(self) -> dict[str, Any]:
        return {"width": self.buckets.width, "buckets": self.buckets.buckets, "tail": [list(r) for r in self.tail],
                "ema_sum": self.ema_sum, "count": self.count, "time": self.time, "first_loss": self.first_loss,
                "last": rows.row_of(self.last, 0.0) if self.last else None, "checkpoint_step": self.checkpoint_step, "evals": self.evals, "tasks": self.tasks,
                "last_task_scores": self.last_task_scores, "core": self.core, "checkpoints": self.checkpoints,
                "spikes": self.spikes, "rollbacks": self.rollbacks, "targets": self.targets, "samples": self.samples,
                "anatomy": self.anatomy.state(), "profile": rows.row_of(self.profile, 0.0) if self.profile else None,
                "layers": self.layers.state()}

    @classmethod
    def from_state(cls, s: dict[str, Any]) -> History:
        """A history as `state` saved it; KeyError, TypeError or ValueError for anything else."""
        h = cls()
        h.buckets = Buckets(int(s["width"]), [[float(v) for v in b] for b in s["buckets"]])
        if (h.buckets.width < 1 or len(h.buckets.buckets) > CAP or any(len(b) != 2 + 3 * NF for b in h.buckets.buckets)
                or any(len(r) != NF for r in s["tail"])):
            raise ValueError("not a history's buckets")
        h.tail = deque(Row(int(r[0]), *(float(v) for v in r[1:])) for r in s["tail"])
        h.ema_sum, h.count, h.time = float(s["ema_sum"]), int(s["count"]), float(s["time"])
        h.first_loss = None if s["first_loss"] is None else float(s["first_loss"])
        h._last, h.checkpoint_step = s["last"] if isinstance(s["last"], dict) else None, int(s["checkpoint_step"])
        h.evals = [(int(a), None if b is None else float(b), None if c is None else float(c)) for a, b, c in s["evals"]]
        h.tasks = {str(k): [(int(a), float(b)) for a, b in v] for k, v in s["tasks"].items()}
        h.last_task_scores = {str(k): dict(v) for k, v in s["last_task_scores"].items()}
        h.core = [(int(a), float(b)) for a, b in s["core"]]
        h.checkpoints = [(int(a), str(b)) for a, b in s["checkpoints"]]
        h.spikes = [(int(a), float(b), str(c)) for a, b, c in s["spikes"]]
        h.rollbacks = [(int(a), int(b)) for a, b in s["rollbacks"]]
        h.targets = [(int(a), str(b), float(c), float(d)) for a, b, c, d in s["targets"]]
        h.samples = [(int(a), str(b), str(c)) for a, b, c in s["samples"]]
        h.anatomy = Anatomy.from_state(s.get("anatomy") or {})  # none in a summary from before steps had parts
        h.profile = rows.event_of(s.get("profile"))  # None: no profile, or a summary from before profiles
        h.layers = LayerWindow.from_state(s.get("layers") or [])  # none in a summary from before they were recorded
        return h


class ReadsHistory:
    """What a holder of a `history` (the cockpit's RunState, a compared run's RunCurves) shows of
    it by name: the evaluations as two lists, the task scores, CORE, the spikes."""
    history: History

    @property
    def val_steps(self) -> list[int]:
        return [e[0] for e in self.history.evals]

    @property
    def val_losses(self) -> list[float]:
        return [e[1] for e in self.history.evals]

    @property
    def tasks(self) -> dict[str, list[tuple[int, float]]]:
        """Each task's accuracy as (step, value): scored on a cadence of their own."""
        return self.history.tasks

    @property
    def core(self) -> list[tuple[int, float]]:
        return self.history.core

    @property
    def spikes(self) -> list[tuple[int, float, str]]:
        return self.history.spikes

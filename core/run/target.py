"""Time to target: when a run's validation loss should reach `training.target_val_loss`.

The evaluations so far are fitted with a saturating power law in tokens seen, L(D) = E + A·D^-alpha,
the form scaling-law work fits loss against data with: E is the floor the run tends to, and no
amount of training takes the loss below it. Solved for the target, the fit gives the step, and the
step gives the time (and with a price per hour, the money) still to spend.

A forecast is only as good as its fit, so it comes with a range: the floors the evaluations cannot
tell apart from the best one (a profile over E), widened by how much the answer moves when some
evaluations are left out (a jackknife). A curve that does not fall is said to be unreachable, too
few evaluations to be too few: `forecast` never raises on what a metrics log may hold.

Plain Python and `math`: a run has tens of evaluations, not millions. No torch, like all of core/run.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

STATUSES = ("reached", "expected", "beyond_budget", "unreachable", "too_few")

GRID = 48  # floors tried before the best is refined: enough to land in the right basin
REFINE = 60  # golden-section steps: the bracket shrinks to ~1e-13 of its width, past any noise
FIT_POINTS = 3  # E, A and alpha: fewer evaluations fit any curve exactly and say nothing
CHI2_95 = 3.84  # one parameter (E) profiled at 95%
# An evaluation on a few batches is never exact: a noise of at least 1e-4 of the loss is assumed, so
# an evaluation log that happens to fit perfectly still gets a range, not a single point.
NOISE_FLOOR = 1e-4
JACKKNIFE_GROUPS = 10  # leave-out refits at most: each is a whole fit, and a cockpit waits for them
JACKKNIFE_KEEP = 4  # evaluations each leave-out fit keeps: one more than the curve's parameters
STEP_HORIZON = 1e15  # past this many steps a forecast says nothing any run could use


@dataclass(frozen=True)
class Forecast:
    """When the target should be met. `step` is the fitted step, within [`step_low`, `step_high`]
    (`step_high` may be infinite: a plausible fit that never gets there); `seconds*` count from the
    last evaluation, None where the time per step is unknown; `at_step` is that evaluation's step.
    `floor` is the least loss the fitted curve reaches (E, but for a curve too flat to get near it;
    the lowest loss seen where no falling curve fits)."""
    status: str
    step: float | None = None
    step_low: float | None = None
    step_high: float | None = None
    seconds: float | None = None
    seconds_low: float | None = None
    seconds_high: float | None = None
    at_step: int | None = None
    target: float | None = None
    floor: float | None = None
    max_steps: int | None = None
    evals: int = 0  # the evaluations the fit could use
    min_evals: int = FIT_POINTS
    task: str = ""  # a task's accuracy aimed at: `target` and `floor` are then error rates, 1 - accuracy

    def aim(self) -> str:
        """What the run aims at, as a person names it: "val 3.20", "hellaswag 0.40" ("" unknown)."""
        if self.target is None:
            return ""
        return f"{self.task} {1 - self.target:.2f}" if self.task else f"val {self.target:.2f}"

    def short(self, cost_per_hour: float = 0.0) -> str:
        """One line for a person: what is aimed at, then where, when and (given a price per hour)
        at what cost; or that it is reached, or why it is not foreseen."""
        aim = f"{self.aim()} " if self.aim() else ""
        if self.status == "reached":
            return f"{aim}reached at step {self.at_step if self.step is None else round(self.step):,}"
        if self.status == "too_few":
            return f"{aim}foreseen after {self.min_evals} evaluations (has {self.evals})"
        if self.status == "unreachable":
            if self.floor is None:
                return f"{aim}not reachable by the fitted curve"
            return f"{aim}not reachable by the fitted curve" + (f" (ceiling {1 - self.floor:.2f})" if self.task
                                                                 else f" (floor {self.floor:.2f})")
        if self.status == "beyond_budget":
            return f"{aim}not within this run's budget (needs ~step {_steps(self.step)} of {self.max_steps:,})"
        return self._expected(cost_per_hour)

    def _expected(self, cost_per_hour: float) -> str:
        text = f"{self.aim()} at ~step {_steps(self.step)}"
        if self.step_low is not None and self.step_high is not None:
            text += f" ({_range(self.step_low, self.step_high)})"
        if self.seconds is not None:
            text += f", in {duration(self.seconds)}"
            if cost_per_hour > 0 and math.isfinite(cost_per_hour):
                text += f" ≈ ${self.seconds / 3600 * cost_per_hour:,.2f}"
        return text


def forecast_accuracy(task: str, scores: list[tuple[int, float]], target: float, tokens_per_step: int,
                      max_steps: int, seconds_per_step: float | None) -> Forecast:
    """The same for a task's accuracy rising to `target`: its error rate, 1 - accuracy, falls as a
    loss does, to a floor of its own (the items the model will not get right), and is fitted so."""
    ahead = forecast([(step, 1 - accuracy) for step, accuracy in scores], 1 - target, tokens_per_step, max_steps,
                     seconds_per_step)
    return dataclasses.replace(ahead, task=task)


def forecast_aim(target_val_loss: float, target_task: str, target_accuracy: float, values: list[tuple[int, float]],
                 tokens_per_step: int, max_steps: int, seconds_per_step: float | None) -> Forecast | None:
    """The forecast for what a run aims at (training.target_val_loss, or target_task's accuracy),
    from `values`, that aim's own evaluations (validation losses or accuracies), at most SPREAD of
    them fitted; None for a run that aims at nothing. What the cockpit and the run host both show."""
    if target_task:
        return forecast_accuracy(target_task, spread(values), target_accuracy, tokens_per_step, max_steps,
                                 seconds_per_step)
    if target_val_loss:
        return forecast(spread(values), target_val_loss, tokens_per_step, max_steps, seconds_per_step)
    return None


def forecast(evals: list[tuple[int, float]], target: float, tokens_per_step: int, max_steps: int,
             seconds_per_step: float | None, min_evals: int = 3) -> Forecast:
    """The forecast for `target` from `evals`, (step, val_loss) pairs in the order logged. Evaluations
    at step 0 (before any training: off any power law in tokens) and non-finite losses are left out;
    `min_evals` below the curve's three parameters counts as three."""
    points = _usable(evals)
    at_step = points[-1][0] if points else None
    said = {"at_step": at_step, "target": target, "max_steps": max_steps, "evals": len(points),
            "min_evals": max(min_evals, FIT_POINTS)}
    if points and points[-1][1] <= target:
        # The first evaluation at or under the target, as a person reading the log would name it.
        first = next(step for step, loss in points if loss <= target)
        return Forecast("reached", step=float(first), step_low=float(first), step_high=float(first), **said)
    if len(points) < said["min_evals"]:
        return Forecast("too_few", **said)

    tokens = max(tokens_per_step, 1)
    best = _fit(points, tokens)
    if best is None:  # nothing falling fits: flat or rising
        return Forecast("unreachable", floor=min(loss for _, loss in points), **said)
    step = best.step_for(target, tokens)
    if step is None:
        return Forecast("unreachable", floor=best.lowest(tokens), **said)

    low, high = _profile_range(points, tokens, best, target)
    jack_low, jack_high = _jackknife_range(points, tokens, target, step)
    # The run is not there yet (its last evaluation is above the target), so whatever the fit says,
    # the earliest it can be is now.
    step, low, high = (max(s, float(at_step)) for s in (step, min(low, jack_low, step), max(high, jack_high, step)))
    status = "beyond_budget" if 0 < max_steps < step else "expected"
    return Forecast(status, step=step, step_low=low, step_high=high, floor=best.floor,
                    seconds=_seconds(step, at_step, seconds_per_step),
                    seconds_low=_seconds(low, at_step, seconds_per_step),
                    seconds_high=_seconds(high, at_step, seconds_per_step), **said)


# --------------------------------------------------------------------------- the evaluations
def _usable(evals: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Finite (step, loss) pairs past step 0, in step order. A row whose step is not past the one
    before it cuts every row at or past its step: a run resumed from a checkpoint behind its last
    evaluation logs those steps again, and its later rows are the run as it stands (as in curves)."""
    kept: list[tuple[int, float]] = []
    for row in evals:
        try:
            step, loss = float(row[0]), float(row[1])
        except (TypeError, ValueError, IndexError, OverflowError):
            continue
        if not math.isfinite(step):
            continue
        while kept and kept[-1][0] >= step:
            kept.pop()
        if math.isfinite(loss) and step > 0:
            kept.append((int(step), loss))
    return kept


def _seconds(step: float, at_step: int, seconds_per_step: float | None) -> float | None:
    if seconds_per_step is None or not math.isfinite(seconds_per_step) or seconds_per_step <= 0:
        return None
    return (step - at_step) * seconds_per_step


# --------------------------------------------------------------------------- the fit
@dataclass(frozen=True)
class _Curve:
    """L(D) = floor + A·D^-alpha, A held as its log: D^-alpha is tiny where D is large."""
    floor: float
    log_a: float
    alpha: float
    sse: float  # squared error in loss space, the criterion floors are compared by

    def lowest(self, tokens_per_step: int) -> float:
        """The least loss any run could see on this curve: its value at STEP_HORIZON. That is E
        itself for a curve that bends, and more for one so flat that E is never in sight."""
        return self.floor + math.exp(self.log_a - self.alpha * math.log(STEP_HORIZON * tokens_per_step))

    def step_for(self, target: float, tokens_per_step: int) -> float | None:
        """The step where the curve meets `target`; None where no run could take it there."""
        if not target > self.lowest(tokens_per_step):
            return None
        log_tokens = (self.log_a - math.log(target - self.floor)) / self.alpha
        return math.exp(log_tokens) / tokens_per_step


def _fit_with_floor(points: list[tuple[int, float]], tokens: int, floor: float) -> _Curve | None:
    """The curve with this floor: log(L - E) = log A - alpha·log D by least squares, each point
    weighted by (L - E)², which makes the log-space fit approximate the fit in loss space (a
    small L - E would otherwise pull the line hard). None where the best line does not fall."""
    xs = [math.log(step * tokens) for step, _ in points]
    gaps = [loss - floor for _, loss in points]
    if min(gaps) <= 0:
        return None
    ys, ws = [math.log(g) for g in gaps], [g * g for g in gaps]
    total = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / total
    my = sum(w * y for w, y in zip(ws, ys)) / total
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    if sxx <= 0:
        return None
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sxx
    if not slope < 0:  # alpha > 0: a loss that falls with data
        return None
    log_a = my - slope * mx
    sse = sum((loss - floor - math.exp(log_a + slope * x)) ** 2 for (_, loss), x in zip(points, xs))
    return _Curve(floor, log_a, -slope, sse)


def _gap_grid(points: list[tuple[int, float]]) -> list[float]:
    """How far under the lowest loss the floors tried lie, spaced evenly in log: from a hair under
    it to a floor of 0 (a cross-entropy's least), so floors near and far are tried alike."""
    losses = [loss for _, loss in points]
    low, spread = min(losses), max(losses) - min(losses)
    widest = low if low > 0 else 10 * spread + 1.0
    narrowest = max(spread * 1e-4, abs(low) * 1e-6, 1e-12)
    if narrowest >= widest:
        narrowest = widest * 1e-4
    ratio = (widest / narrowest) ** (1 / (GRID - 1))
    return [narrowest * ratio**i for i in range(GRID)]


def _fit(points: list[tuple[int, float]], tokens: int) -> _Curve | None:
    """The best curve: the floor from a grid of gaps under the lowest loss, then refined by golden
    section between the best grid point's neighbours (in log gap, as the grid is spaced)."""
    low = min(loss for _, loss in points)
    grid = _gap_grid(points)
    curves = [_fit_with_floor(points, tokens, low - gap) for gap in grid]
    scored = [(c.sse, i) for i, c in enumerate(curves) if c is not None]
    if not scored:
        return None
    _, k = min(scored)
    lo, hi = math.log(grid[max(k - 1, 0)]), math.log(grid[min(k + 1, GRID - 1)])
    refined = _golden(lambda u: _fit_with_floor(points, tokens, low - math.exp(u)), lo, hi)
    return min((c for c in (refined, curves[k]) if c is not None), key=lambda c: c.sse)


def _golden(fit, lo: float, hi: float) -> _Curve | None:
    """The least-error curve of `fit(u)` for u in [lo, hi], by golden-section search."""
    inv_phi = (math.sqrt(5) - 1) / 2
    best: _Curve | None = None

    def error(u: float) -> float:
        nonlocal best
        curve = fit(u)
        if curve is None:
            return math.inf
        if best is None or curve.sse < best.sse:
            best = curve
        return curve.sse

    a, b = lo, hi
    c, d = b - inv_phi * (b - a), a + inv_phi * (b - a)
    fc, fd = error(c), error(d)
    for _ in range(REFINE):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - inv_phi * (b - a)
            fc = error(c)
        else:
            a, c, fc = c, d, fd
            d = a + inv_phi * (b - a)
            fd = error(d)
    return best


# --------------------------------------------------------------------------- the range
def _profile_range(points: list[tuple[int, float]], tokens: int, best: _Curve, target: float
                   ) -> tuple[float, float]:
    """The steps predicted by every floor whose error is within a 95% profile of the best one's:
    floors the evaluations cannot tell apart. Extrapolation hinges on E above all (a lower floor
    means a steeper fall to the target), so this is most of the uncertainty."""
    n = len(points)
    mean = sum(abs(loss) for _, loss in points) / n
    noise = max(best.sse / (n - FIT_POINTS) if n > FIT_POINTS else 0.0, (NOISE_FLOOR * mean) ** 2)
    limit = best.sse + CHI2_95 * noise
    low = min(loss for _, loss in points)

    def fit(u: float) -> _Curve | None:
        return _fit_with_floor(points, tokens, low - math.exp(u))

    def inside(curve: _Curve | None) -> bool:
        return curve is not None and curve.sse <= limit

    here = math.log(low - best.floor)
    logs = [math.log(g) for g in _gap_grid(points)]
    edges = [_edge(fit, inside, here, [u for u in reversed(logs) if u < here]),
             _edge(fit, inside, here, [u for u in logs if u > here])]
    plausible = [best, *(c for u in logs if edges[0] <= u <= edges[1] and inside(c := fit(u))),
                 *(c for u in edges if inside(c := fit(u)))]
    steps = [c.step_for(target, tokens) for c in plausible]
    reached = [s for s in steps if s is not None]
    return min(reached), (max(reached) if len(reached) == len(steps) else math.inf)


def _edge(fit, inside, here: float, outward: list[float]) -> float:
    """The last log gap, going `outward` from `here` (inside the profile), that is still inside:
    the first grid point outside it is found, then the edge between them by bisection."""
    last = here
    for u in outward:
        if not inside(fit(u)):
            break
        last = u
    else:
        return last
    a, b = last, u
    for _ in range(40):
        mid = (a + b) / 2
        a, b = (mid, b) if inside(fit(mid)) else (a, mid)
    return a


def _jackknife_range(points: list[tuple[int, float]], tokens: int, target: float, step: float
                     ) -> tuple[float, float]:
    """The fitted step ± two jackknife standard errors (in log step), from refits that each leave
    out every g-th evaluation. Infinite above where some refit never reaches the target: which
    evaluations a run happened to have should not decide that it will."""
    groups = min(len(points), JACKKNIFE_GROUPS)
    if len(points) - math.ceil(len(points) / groups) < JACKKNIFE_KEEP:
        return step, step
    logs = []
    for g in range(groups):
        curve = _fit([p for i, p in enumerate(points) if i % groups != g], tokens)
        left_out = curve.step_for(target, tokens) if curve is not None else None
        if left_out is None:
            return step, math.inf
        logs.append(math.log(left_out))
    mean = sum(logs) / groups
    se = math.sqrt((groups - 1) / groups * sum((x - mean) ** 2 for x in logs))
    return step * math.exp(-2 * se), step * math.exp(2 * se)


# --------------------------------------------------------------------------- the words
def _two_figures(x: float, rounding=round) -> float:
    """`x` to two significant figures, `rounding` deciding which way: a forecast is not exact."""
    if x <= 0 or not math.isfinite(x):
        return x
    unit = 10 ** max(math.floor(math.log10(x)) - 1, 0)
    return rounding(x / unit) * unit


def _steps(x: float | None, rounding=round) -> str:
    if x is None:
        return "?"
    if not math.isfinite(x):
        return "never"
    return f"{_two_figures(x, rounding):,.0f}"


def _range(low: float, high: float) -> str:
    """Low rounded down and high up, so the range as written still holds the step as written."""
    if not math.isfinite(high):
        return f"{_steps(low, math.floor)} or later"
    return f"{_steps(low, math.floor)}–{_steps(high, math.ceil)}"


def run_time(seconds: float) -> str:
    """A time gone by, to the second: "0:03:12", "26:04:09" (hours past a day stay hours). The
    engine's lines and every front-end's (tui.formatting.fmt_duration) write one this way."""
    whole = int(max(0, seconds))
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def duration(seconds: float) -> str:
    """A time to come, to the minute: "1 h 05 m", "12 m", "2 d 03 h"."""
    if not math.isfinite(seconds):
        return "never"
    if seconds < 60:
        return "under a minute"
    minutes = round(seconds / 60)
    days, hours, mins = minutes // 1440, minutes % 1440 // 60, minutes % 60
    if days:
        return f"{days} d {hours:02d} h"
    return f"{hours} h {mins:02d} m" if hours else f"{mins} m"


SPREAD = 60  # evaluations a fit is given at most: see spread()


def spread(evals: list[tuple[int, float]], most: int = SPREAD) -> list[tuple[int, float]]:
    """At most `most` of `evals`, evenly spread, the first and last among them: a fit costs a few
    milliseconds an evaluation (its range refits it several times), and a long run has hundreds."""
    n = len(evals)
    if n <= most:
        return list(evals)
    return [evals[i] for i in sorted({round(k * (n - 1) / (most - 1)) for k in range(most)})]


EVALS_KEPT = 1024  # evaluations a forecast in live.json is fitted from at most: see Evaluations


class Evaluations:
    """The (step, value) pairs a run's forecast is fitted from, in a memory that does not grow
    with the run: every one while there are at most `most`, then every `stride`-th and the latest,
    the stride doubling each time they would be more. A host serves runs of a million steps.

    target.spread fits at most SPREAD of them, evenly spread, the first and last among them: up to
    `most` evaluations it is given the very list the cockpit gives it (which keeps them all), so
    the forecasts are the same; past that, SPREAD points still evenly spread over the run, the
    same first and last, each within a stride and a half of one it would have picked from all."""

    def __init__(self, most: int = EVALS_KEPT):
        self.most = max(most, 2 * SPREAD)  # a thinning keeps half: never fewer than a fit takes
        self.kept: list[tuple[int, int, float]] = []  # (which evaluation, its step, its value)
        self.stride = 1
        self.count = 0  # evaluations so far: the next one's number

    def add(self, step: int, value: float) -> None:
        if self.kept and step <= self.kept[-1][1]:
            # A run rolled back (or resumed behind its last evaluation) evaluates those steps again:
            # its later values are the run as it stands, as target._usable reads a metrics log.
            # Those of the cut that were thinned away are not counted again.
            self.kept = [kept for kept in self.kept if kept[1] < step]
            self.count = self.kept[-1][0] + 1 if self.kept else 0
            if not self.kept:
                self.stride = 1
        elif self.kept and self.kept[-1][0] % self.stride:
            self.kept.pop()  # kept only as the latest, which it is no more
        self.kept.append((self.count, step, value))
        self.count += 1
        if len(self.kept) > self.most:
            self.stride *= 2
            self.kept = [kept for kept in self.kept[:-1] if kept[0] % self.stride == 0] + self.kept[-1:]

    def values(self) -> list[tuple[int, float]]:
        return [(step, value) for _, step, value in self.kept]

    def __len__(self) -> int:
        return len(self.kept)

"""Where the charts' x-axis ticks go and how they read: whole steps, `1.2M` tokens, `2h05`.

On each of the x axes the charts use (curves.AXES: step, tokens, time in seconds), ticks sit on
round values and are labelled the way a person would write them. Without this, plotext splits the
range evenly and prints `75187.5` as a step. No torch.

Ticks are multiples of one round spacing:
* step, tokens: 1, 2 or 5 × 10^k, never below 1, so a tick is always a whole number;
* time: 1, 2, 5, 10, 15, 30 s; 1, 2, 5, 10, 15, 30 min; 1, 2, 3, 6, 12 h; then 1, 2 or 5 × 10^k days.
The smallest spacing that puts no more than `most` ticks in [lo, hi] is used: no other would put
more. With `most` >= 5 (no spacing is more than 2.5 times the one before it), that gives at least
2 ticks whenever the range holds two whole values (whole seconds on the time axis).

Tick labels are exact, so neighbouring ticks never read alike:
* step, tokens: `0`, `950`, `12k`, `12.5k`, `300k`, `1.2M`, `1.5B`, `1T` (k, M, B, T, no trailing
  `.0`), or the number written out when that is no longer (`1001`, not `1.001k`);
* time: `0`, `45s`, `12m`, `1m30` (minutes, then zero-padded seconds), `2h`, `2h05` (hours, then
  minutes), `1d`, `1d04` (days, then hours). A finer part that a tick needs follows a colon
  (`1d00:15` is a day and 15 minutes; `2h00:30` two hours and 30 seconds); zero parts at the end
  are left off.

`label` reads one value rather than a tick, for a tooltip or a status line: on step and tokens
whole below 10,000 and three significant figures from there (`1234`, `75.2k`), a time by its two
leading parts (`12m30`, `2h05`, `1d04`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from itertools import count

TITLES = {"step": "step", "tokens": "tokens", "time": "training time"}
SUFFIXES = ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "k"))
MINUTE, HOUR, DAY = 60, 3600, 86400
TIME_SPACINGS = (1, 2, 5, 10, 15, 30,
                 MINUTE, 2 * MINUTE, 5 * MINUTE, 10 * MINUTE, 15 * MINUTE, 30 * MINUTE,
                 HOUR, 2 * HOUR, 3 * HOUR, 6 * HOUR, 12 * HOUR)


def axis_title(axis: str) -> str:
    """The axis's name under the chart: `step`, `tokens` or `training time` (no unit: the labels carry it)."""
    return TITLES[_checked(axis)]


def ticks(axis: str, lo: float, hi: float, most: int = 6) -> list[tuple[float, str]]:
    """(position, label) of each tick within [lo, hi], in increasing order.

    lo > hi is taken as the same range the other way round. lo below 0 is taken as 0 (every one
    of these axes starts at 0), so a range wholly below 0 has no ticks; nor has one with a NaN or
    infinite end. lo == hi gives that value as the one tick when it is whole (a whole second on
    the time axis), and no tick otherwise: a tick is never put where no value of its axis can be.
    Positions and labels are exact up to 2**53 (9e15), as far as floats hold whole numbers; past
    that a position is the float nearest its label, still within [lo, hi]."""
    _checked(axis)
    if most < 2:
        raise ValueError(f"most={most}: an axis needs room for at least 2 ticks")
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    lo, hi = sorted((lo, hi))
    lo = max(lo, 0.0)
    if lo > hi:
        return []
    for spacing in _spacings(axis):
        first = math.ceil(lo / spacing)
        n = math.floor(hi / spacing) - first + 1
        if n <= most:
            break
    values = [(first + i) * spacing for i in range(n)]
    # a float division may round across a multiple at either end
    return [(float(v), _exact(axis, v)) for v in values if lo <= v <= hi]


def label(axis: str, value: float) -> str:
    """One value as a person would write it: `75.2k` steps, `1.23B` tokens, `2h05` of training.

    Step and tokens: whole under 10,000, three significant figures from there (`1234`, `12.3k`).
    A time: its two leading parts, so to the second under an hour, the minute under a day, the
    hour beyond (`12m30`, `2h05`, `1d04`). A negative value reads with a `-`; NaN and infinities
    read `nan`, `inf`, `-inf`."""
    _checked(axis)
    if not math.isfinite(value):
        return str(value)
    size = abs(value)
    if axis == "time":
        resolution = HOUR if size >= DAY else MINUTE if size >= HOUR else 1
    else:
        resolution = 10 ** (math.floor(math.log10(size)) - 2) if size >= 10_000 else 1
    # rounded before it is written, so that 59m59.6s reads `1h` and 999,999 steps `1M`
    text = _exact(axis, round(size / resolution) * resolution)
    return "-" + text if value < 0 and text != "0" else text


def _checked(axis: str) -> str:
    if axis not in TITLES:
        raise ValueError(f"axis {axis!r}: expected one of {', '.join(TITLES)}")
    return axis


def _spacings(axis: str) -> Iterator[int]:
    """The axis's round spacings, smallest first, without end."""
    unit = 1
    if axis == "time":
        yield from TIME_SPACINGS
        unit = DAY
    for k in count():
        for m in (1, 2, 5):
            yield m * 10**k * unit


def _exact(axis: str, n: int) -> str:
    """A whole number of steps, tokens or seconds, written exactly."""
    if n == 0:
        return "0"
    if axis == "time":
        parts = [n // DAY, n % DAY // HOUR, n % HOUR // MINUTE, n % MINUTE]
        nonzero = [i for i, part in enumerate(parts) if part]
        lead, last = nonzero[0], nonzero[-1]
        return f"{parts[lead]}{'dhms'[lead]}" + ":".join(f"{part:02d}" for part in parts[lead + 1:last + 1])
    plain = str(n)
    for unit, suffix in SUFFIXES:
        if n >= unit:
            whole, rest = divmod(n, unit)
            decimals = str(rest).rjust(len(str(unit)) - 1, "0").rstrip("0")
            short = f"{whole}.{decimals}{suffix}" if decimals else f"{whole}{suffix}"
            return short if len(short) <= len(plain) else plain
    return plain

"""The charts' x-axis ticks: round positions inside the range, labelled as a person writes them."""

import math
import random
import re
import sys

import pytest

from lmcockpit.core.run.ticks import axis_title, label, ticks

NAN, INF = float("nan"), float("inf")
SUFFIX = {"": 1, "k": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
UNIT = {"d": 86400, "h": 3600, "m": 60, "s": 1}
NEXT = {"d": 3600, "h": 60, "m": 1}  # what a zero-padded part after each unit counts
ROUND = {"step": [m * 10**k for k in range(16) for m in (1, 2, 5)],
         "time": [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200]
         + [m * 10**k * 86400 for k in range(12) for m in (1, 2, 5)]}
ROUND["tokens"] = ROUND["step"]


def read_back(axis: str, text: str) -> int:
    """The value a label says, as a reader would take it; fails on any form the module should not write."""
    if text == "0":
        return 0
    if axis == "time":
        m = re.fullmatch(r"([1-9]\d*)([dhms])((?:\d\d)(?::\d\d)*)?", text)
        assert m, f"{text!r} is not a time label"
        value, unit = int(m[1]), m[2]
        assert unit == "d" or value < {"h": 24, "m": 60, "s": 60}[unit], f"{text!r}: a part past its unit"
        seconds = value * UNIT[unit]
        step = NEXT.get(unit, 0)
        for part in m[3].split(":") if m[3] else []:
            assert step, f"{text!r}: nothing comes after seconds"
            assert int(part) < (24 if step == 3600 else 60), f"{text!r}: a part past its unit"
            seconds += int(part) * step
            step = NEXT.get({3600: "h", 60: "m", 1: "s"}[step], 0)
        return seconds
    m = re.fullmatch(r"([1-9]\d*|0)(?:\.(\d*[1-9]))?([kMBT]?)", text)
    assert m, f"{text!r} is not a count label (no trailing .0, no fraction without a suffix)"
    assert m[2] is None or m[3], f"{text!r}: a fraction of a step"
    frac = m[2] or ""
    return (int(m[1] + frac) * SUFFIX[m[3]]) // 10 ** len(frac)


# ------------------------------------------------------------------ the ranges the charts meet
@pytest.mark.parametrize("axis, lo, hi, expected", [
    # a run of 150,375 steps: plotext's own ticks split it into 75187.5
    ("step", 0, 150375, [(0, "0"), (50_000, "50k"), (100_000, "100k"), (150_000, "150k")]),
    ("step", 0, 1.2e6, [(0, "0"), (500_000, "500k"), (1_000_000, "1M")]),
    ("step", 0, 3, [(0, "0"), (1, "1"), (2, "2"), (3, "3")]),
    ("step", 0, 2000, [(0, "0"), (500, "500"), (1000, "1k"), (1500, "1.5k"), (2000, "2k")]),
    ("step", 900, 1000, [(900, "900"), (920, "920"), (940, "940"), (960, "960"), (980, "980"), (1000, "1k")]),
    ("step", 1001, 1006, [(v, str(v)) for v in range(1001, 1007)]),  # written out: shorter than 1.001k
    ("step", 11_000, 13_500, [(11_000, "11k"), (11_500, "11.5k"), (12_000, "12k"), (12_500, "12.5k"),
                              (13_000, "13k"), (13_500, "13.5k")]),
    ("step", 0, 1e12, [(0, "0"), (2e11, "200B"), (4e11, "400B"), (6e11, "600B"), (8e11, "800B"), (1e12, "1T")]),
    ("tokens", 0, 2.5e9, [(0, "0"), (5e8, "500M"), (1e9, "1B"), (1.5e9, "1.5B"), (2e9, "2B"), (2.5e9, "2.5B")]),
    ("tokens", 0, 1.3e6, [(0, "0"), (5e5, "500k"), (1e6, "1M")]),
    ("tokens", 1.1e6, 1.35e6, [(1.1e6, "1.1M"), (1.15e6, "1.15M"), (1.2e6, "1.2M"), (1.25e6, "1.25M"),
                               (1.3e6, "1.3M"), (1.35e6, "1.35M")]),
    ("time", 0, 50, [(0, "0"), (10, "10s"), (20, "20s"), (30, "30s"), (40, "40s"), (50, "50s")]),
    ("time", 0, 150, [(0, "0"), (30, "30s"), (60, "1m"), (90, "1m30"), (120, "2m"), (150, "2m30")]),
    ("time", 0, 3000, [(0, "0"), (600, "10m"), (1200, "20m"), (1800, "30m"), (2400, "40m"), (3000, "50m")]),
    ("time", 0, 7500, [(0, "0"), (1800, "30m"), (3600, "1h"), (5400, "1h30"), (7200, "2h")]),
    ("time", 7200, 8100, [(7200, "2h"), (7500, "2h05"), (7800, "2h10"), (8100, "2h15")]),
    ("time", 3600, 3700, [(3600, "1h"), (3630, "1h00:30"), (3660, "1h01"), (3690, "1h01:30")]),
    ("time", 0, 200_000, [(0, "0"), (43200, "12h"), (86400, "1d"), (129600, "1d12"), (172800, "2d")]),
    ("time", 86400, 108000, [(86400, "1d"), (93600, "1d02"), (100800, "1d04"), (108000, "1d06")]),
    ("time", 86000, 90000, [(86400, "1d"), (87300, "1d00:15"), (88200, "1d00:30"), (89100, "1d00:45"),
                            (90000, "1d01")]),
    ("time", 0, 25 * 86400, [(0, "0"), (5 * 86400, "5d"), (10 * 86400, "10d"), (15 * 86400, "15d"),
                             (20 * 86400, "20d"), (25 * 86400, "25d")]),
])
def test_ticks_on_the_ranges_the_charts_meet(axis, lo, hi, expected):
    assert ticks(axis, lo, hi) == [(float(v), text) for v, text in expected]


def test_a_long_run_has_no_fractional_step():
    assert all(v == int(v) and "." not in text for v, text in ticks("step", 0, 150375))
    assert not any(v == 75187.5 for v, _ in ticks("step", 0, 150375, most=20))


# ------------------------------------------------------------------ what holds of every range
def ranges():
    rng = random.Random(43)
    fixed = [(0, 1), (0, 2), (0, 5), (0, 7), (3, 4), (0, 99), (1, 1e3), (0, 150375), (1e5, 1e5 + 17),
             (0, 1e12), (123_456, 7_654_321), (999_999, 1_000_001), (0, 9e15)]
    scaled = [(lo, lo + rng.uniform(0, 10) * 10 ** rng.randint(0, 12))
              for lo in (rng.choice([0, rng.uniform(0, 1e9)]) for _ in range(150))]
    return fixed + scaled


@pytest.mark.parametrize("most", [2, 3, 4, 5, 6, 8, 12])
@pytest.mark.parametrize("axis", ["step", "tokens", "time"])
def test_ticks_are_round_whole_inside_and_read_back_in_order(axis, most):
    for lo, hi in ranges():
        got = ticks(axis, lo, hi, most)
        where = f"{axis} {lo}..{hi} most={most}: {got}"
        values = [v for v, _ in got]
        assert all(lo <= v <= hi for v in values), where
        assert all(v == int(v) for v in values), where  # a whole step, token or second
        assert len(got) <= most, where
        whole = math.floor(hi) - math.ceil(lo) + 1
        if most >= 5 and whole >= 2:
            assert len(got) >= 2, where
        assert len(got) >= 1 or whole == 0, where
        if len(values) >= 2:
            gaps = {b - a for a, b in zip(values, values[1:])}
            assert len(gaps) == 1 and gaps.pop() in ROUND[axis], where  # one round spacing
            assert all(v % (values[1] - values[0]) == 0 for v in values), where  # on its multiples
        labels = [text for _, text in got]
        assert [read_back(axis, text) for text in labels] == values, where  # exact, so distinct and increasing
        assert len(set(labels)) == len(labels), where


@pytest.mark.parametrize("axis", ["step", "tokens", "time"])
def test_the_most_ticks_that_fit_are_used(axis):
    """No other round spacing would put more ticks in the range without going past `most`."""
    for lo, hi in ranges()[:60]:
        for most in (2, 6):
            n = len(ticks(axis, lo, hi, most))
            for spacing in ROUND[axis]:
                fits = math.floor(hi / spacing) - math.ceil(lo / spacing) + 1
                assert fits <= n or fits > most, f"{axis} {lo}..{hi} most={most}: {spacing} gives {fits} > {n}"


# ------------------------------------------------------------------ edges
@pytest.mark.parametrize("axis", ["step", "tokens", "time"])
@pytest.mark.parametrize("lo, hi, expected", [
    (0, 0, [0]),  # one value: one tick
    (7, 7, [7]),
    (7.5, 7.5, []),  # no whole value to tick
    (0, 0.5, [0]),  # never 0.5
    (0.2, 0.8, []),
    (0.5, 1.5, [1]),
    (3, 0, [0, 1, 2, 3]),  # lo > hi: the same range the other way round
    (-50, 3, [0, 1, 2, 3]),  # the axis starts at 0
    (-5, -1, []),
    (0, NAN, []),
    (NAN, 3, []),
    (0, INF, []),
    (-INF, 3, []),
])
def test_edges_of_the_range(axis, lo, hi, expected):
    assert [v for v, _ in ticks(axis, lo, hi)] == expected


def test_the_largest_float_does_not_break_the_spacing():
    got = ticks("tokens", 0, sys.float_info.max)
    assert 2 <= len(got) <= 6 and got[0] == (0.0, "0")
    assert all(0 <= v <= sys.float_info.max for v, _ in got)
    assert ticks("step", sys.float_info.max, sys.float_info.max) != []  # every float that large is whole


def test_an_end_one_float_past_a_multiple_keeps_its_ticks_inside():
    lo = 6.890832180000001e21  # 689083218 × 10^13 and one float more: lo / 10^13 rounds to the multiple
    got = ticks("tokens", lo, lo + 5e13)
    assert len(got) >= 2 and all(lo <= v <= lo + 5e13 for v, _ in got)


def test_an_axis_or_a_count_it_does_not_know_is_refused():
    with pytest.raises(ValueError, match="axis 'loss'"):
        ticks("loss", 0, 1)
    with pytest.raises(ValueError, match="axis 'loss'"):
        label("loss", 1)
    with pytest.raises(ValueError, match="axis 'loss'"):
        axis_title("loss")
    with pytest.raises(ValueError, match="most=1"):
        ticks("step", 0, 10, most=1)


# ------------------------------------------------------------------ one value
@pytest.mark.parametrize("axis, value, expected", [
    ("step", 0, "0"),
    ("step", 0.4, "0"),
    ("step", 950, "950"),
    ("step", 1000, "1k"),
    ("step", 1200, "1.2k"),
    ("step", 1234, "1234"),  # under 10k, to the step
    ("step", 9999.5, "10k"),
    ("step", 12_345, "12.3k"),
    ("step", 99_950, "100k"),  # rounded up into the next digit
    ("step", 12_000, "12k"),
    ("step", 12_500, "12.5k"),
    ("step", 75187.5, "75.2k"),
    ("step", 300_000, "300k"),
    ("step", 999_999, "1M"),
    ("step", 1_200_000, "1.2M"),
    ("step", 1_234_567, "1.23M"),
    ("step", -1200, "-1.2k"),
    ("step", -0.2, "0"),
    ("tokens", 1.5e9, "1.5B"),
    ("tokens", 2_097_152, "2.1M"),
    ("tokens", 3.2e12, "3.2T"),
    ("time", 0, "0"),
    ("time", 0.3, "0"),
    ("time", 45, "45s"),
    ("time", 59.6, "1m"),
    ("time", 90, "1m30"),
    ("time", 720, "12m"),
    ("time", 3599.6, "1h"),
    ("time", 7500, "2h05"),
    ("time", 7532.7, "2h06"),  # two parts: to the minute
    ("time", 86399, "1d"),
    ("time", 100_800, "1d04"),
    ("time", 101_000, "1d04"),
    ("time", 1_000_000, "11d14"),
    ("time", NAN, "nan"),
    ("time", INF, "inf"),
    ("step", -INF, "-inf"),
])
def test_one_value_as_a_person_writes_it(axis, value, expected):
    assert label(axis, value) == expected


@pytest.mark.parametrize("axis, title", [("step", "step"), ("tokens", "tokens"), ("time", "training time")])
def test_axis_titles_carry_no_unit(axis, title):
    assert axis_title(axis) == title

"""How a figure is written wherever the front-end shows one: counts, durations, bars, the dash.

The dashboard, the headless line, the launch screen and the commands' tables share these, so a
figure reads the same everywhere.
"""

from __future__ import annotations

from ..core.run.target import run_time

DASH = "–"


def fmt_count(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


fmt_duration = run_time  # as the engine writes a time gone by


def bar(fraction: float, width: int = 20) -> str:
    eighths = " ▏▎▍▌▋▊▉█"
    filled = max(0.0, min(1.0, fraction)) * width
    full = int(filled)
    part = eighths[int((filled - full) * 8)] if full < width else ""
    return ("█" * full + part).ljust(width)

"""The dashboard's one-line readings: fitted to any width, and the CPU run's load read from the
run's real processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.hardware.telemetry import GPUReading, Telemetry
from lmcockpit.core.run.state import RunState
from lmcockpit.tui.widgets.glance import fit, gpu_cell, step_text

GiB = 2**30


def test_fit_drops_the_least_useful_fields_first_and_keeps_their_order():
    fields = [(0, "loss 3.1"), (2, "ETA 0:01:00"), (1, "5.0k tok/s"), (3, "")]
    assert fit(fields, 80) == "loss 3.1 · ETA 0:01:00 · 5.0k tok/s"
    assert fit(fields, 25) == "loss 3.1 · 5.0k tok/s"
    assert fit(fields, 3) == ""


def test_the_step_line_keeps_step_loss_and_speed_on_a_narrow_terminal():
    v = RunState(clock=lambda: 0.0)
    v.apply(P.RunStarted("r", {}, 1, "cuda:0", "bf16", 0, 400, 4096))
    v.apply(P.StateChanged(P.RUNNING))
    for step in (1, 2, 3):
        v.apply(P.StepMetrics(step, 3.5, 1e-3, 1.0, 8192.0, 0.4, 0.5, step * 4096))
    wide, narrow = step_text(v, 120).plain, step_text(v, 50).plain
    for part in ("step 3/400", "loss 3.5000", "8.2k tok/s", "MFU 40.0%", "ETA 0:03:18", "%"):
        assert part in wide, (part, wide)
    assert "step 3/400" in narrow and "loss 3.5000" in narrow and len(narrow) <= 50
    assert "▏" not in narrow and "█" not in narrow  # no room for a bar: no bar


def test_a_gpu_cell_gives_up_extras_then_bars_before_its_figures():
    g = GPUReading(3, "NVIDIA H100 80GB HBM3", 87.0, 40.0, int(61.3 * GiB), 80 * GiB, 64.0, 512.0, 1980)
    cells = {w: gpu_cell(3, g, w).plain for w in (110, 50, 30, 18)}
    assert "NVIDIA H100" in cells[110] and "512W" in cells[110] and "64°C" in cells[110]
    assert "64°C" in cells[50] and "NVIDIA" not in cells[50]
    for w, cell in cells.items():
        assert len(cell) <= w and "GPU3" in cell and "87%" in cell, (w, cell)
    assert "61.3/80G" in cells[30]


@pytest.mark.slow
def test_the_cpu_load_is_the_runs_whole_process_tree():
    """A run's host and every process under it: a grandchild holding 200 MiB and spinning shows
    in the parent's load."""
    import psutil

    # the child spins for at most a minute, so nothing is left running if the test dies
    code = ("import time; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True)\n"
            "end = time.monotonic() + 60\nwhile time.monotonic() < end: pass")
    for _ in range(2):  # a grandchild, as torchrun's workers are the run host's
        code = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {code!r}]).wait()"
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        telemetry = Telemetry()
        first = telemetry.process_load(parent.pid)
        assert first is not None and first.rss >= 200 * 2**20 and first.cores == os.cpu_count()
        # psutil's CPU share is since the previous reading: read until it has seen the child spin
        loads = [telemetry.process_load(parent.pid) for _ in range(2000)]
        assert max(load.cpu_percent for load in loads) > 10
        assert loads[-1].rss >= 200 * 2**20
    finally:
        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait()
    assert Telemetry().process_load(parent.pid) is None
    assert telemetry.process_load(parent.pid) is None  # gone from a tree listed moments ago too


def test_the_run_view_keeps_the_loss_ema_a_step_at_a_time():
    """The chart draws the RunState's EMA rather than recomputing it over the whole history on
    every redraw: the two must be the same numbers."""
    import math

    from .helpers import ema

    v = RunState(clock=lambda: 0.0)
    losses = [5 + math.sin(i / 3) + 3 * math.exp(-i / 50) for i in range(500)]
    for step, loss in enumerate(losses, 1):
        v.apply(P.StepMetrics(step, loss, 1e-3, 1.0, 1.0, None, 0.1, step))
    assert [r.ema for r in v.history.recent()] == ema(losses)

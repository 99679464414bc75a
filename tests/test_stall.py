"""A run that stops moving: the stall watch on a clock the test turns, then a real detached run
whose engine is stopped with SIGSTOP: `lmcockpit ps` says stalled within the stated time, and
running again after SIGCONT, and train.log says both."""

from __future__ import annotations

import signal
import time

import psutil

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.process import live
from lmcockpit.core.process.stall import STEP_TIMES, StallWatch
from lmcockpit.core.run.state import RunState
from lmcockpit.core.run.folder import read_metrics
from tests.helpers import cli, detached, last_step, stop, wait_until


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def step(n: int, dt: float) -> P.StepMetrics:
    return P.StepMetrics(n, 3.0, 1e-3, 1.0, 1000.0, None, dt, n * 512, {})


def heard(watch: StallWatch, event: object) -> str | None:
    """As the owner of an engine does: the event folded into the run's state, the watch told."""
    said = watch.heard()
    watch.run.apply(event)
    return said


def test_silence_longer_than_the_limit_while_training_is_a_stall_until_the_engine_speaks():
    clock = Clock()
    watch = StallWatch(stall_after=60, run=RunState(), clock=clock)
    clock.now += 3600
    assert watch.check() is None  # preparing data: as long as the corpus takes
    for event in (P.StateChanged(P.RUNNING), step(1, 0.5), step(2, 0.5), step(3, 0.5)):
        assert heard(watch, event) is None
    assert watch.limit == 60  # 20 steps of 0.5 s is less than stall_after
    clock.now += 59
    assert watch.check() is None and not watch.stalled
    clock.now += 2
    line = watch.check()
    assert line.startswith("stalled: no word from the engine for 61 s while running; its steps take 0.5 s")
    assert watch.stalled and watch.detail == "no word for 61 s" and watch.check() is None  # said once
    clock.now += 100
    assert heard(watch, step(4, 0.5)) == "training again after 2 min without a word from the engine"
    assert not watch.stalled and watch.state == P.RUNNING


def test_slow_steps_raise_the_limit_and_a_pause_is_never_a_stall():
    clock = Clock()
    watch = StallWatch(stall_after=60, run=RunState(), clock=clock)
    heard(watch, P.StateChanged(P.RUNNING))
    for n in range(1, 4):
        heard(watch, step(n, 30.0))  # a large model: 30 s a step
    assert watch.limit == STEP_TIMES * 30.0
    clock.now += STEP_TIMES * 30.0 - 1
    assert watch.check() is None
    heard(watch, P.StateChanged(P.PAUSED))
    clock.now += 10 * 3600
    assert watch.check() is None


def ps_state(run) -> str | None:
    out = cli("ps", timeout=60).stdout
    rows = [line.split("\t") for line in out.splitlines() if line.startswith(str(run))]
    return rows[0][-1] if rows else None


@pytest.mark.slow
def test_a_stopped_engine_is_stalled_in_ps_and_running_again_when_it_goes_on(tmp_path):
    run = detached(tmp_path, "run", "notify.stall_after=2")
    engine = []
    try:
        wait_until(lambda: last_step(run) >= 3, what="training to start")
        # live.json is rewritten at most once a second: it may say "preparing data" a moment longer
        wait_until(lambda: ps_state(run) == "running", timeout=30, what="ps to say running")
        engine = psutil.Process(live.LiveRecord.read(run).pid).children(recursive=True)
        for process in engine:
            process.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        # The limit the host works to: stall_after, or 20 of the run's steps if that is longer.
        limit = max(2.0, STEP_TIMES * max(row["dt"] for row in read_metrics(run, "step")[1:]))
        wait_until(lambda: ps_state(run) == "stalled", timeout=60, what="ps to say stalled")
        assert time.monotonic() - stopped_at < limit + 3  # live.json is rewritten at once; ps takes a moment
        step_then = last_step(run)
        for process in engine:
            process.send_signal(signal.SIGCONT)
        wait_until(lambda: ps_state(run) == "running", timeout=30, what="ps to say running again")
        wait_until(lambda: last_step(run) > step_then, what="steps after the stall")
        log = (run / "train.log").read_text()
        assert "host: stalled: no word from the engine for" in log and "while running" in log
        assert "host: training again after" in log
    finally:
        for process in engine:  # a failed assertion must not leave an engine stopped for good
            process.send_signal(signal.SIGCONT)
        stop(run)


def test_the_watch_goes_by_the_run_s_pace_the_figure_every_view_shows():
    """Not its own average: the first step of a start (compilation) is left out, and steps a
    rollback undid no longer count (state.Pace), so the limit is the one ps and the dashboard imply."""
    watch = StallWatch(stall_after=1, run=RunState(), clock=Clock())
    heard(watch, P.RunStarted("run", {}, 1, "cpu", "fp32", 0, 100, 512))
    heard(watch, step(1, 100.0))  # compiling
    heard(watch, step(2, 1.0))
    assert watch.step_time == 1.0 and watch.limit == STEP_TIMES * 1.0
    for n in (3, 4, 5):
        heard(watch, step(n, 30.0))
    assert watch.step_time > 1.0
    heard(watch, P.RolledBack(5, 2, 3, 1, 0.5, 100))
    assert watch.step_time == 1.0

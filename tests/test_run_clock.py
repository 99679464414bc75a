"""A run's elapsed time and ETA, one figure in every view of it (issue #51, 5).

Elapsed is the run's own: counted from when the run began (for a run a host serves, the host's
start, as live.json records it), never from when a viewer attached. The ETA is one function of the
same inputs everywhere: the run host folds the steps for live.json (`ps`, the launch screen) as each
front-end's RunState folds them (the dashboard, `--run`'s line), and a viewer that attaches late
rebuilds the same step time from the run folder."""

from __future__ import annotations

import random
import time

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.process import host, live
from lmcockpit.core.run.history import History
from lmcockpit.tui.app import CockpitApp
from lmcockpit.tui.commands import ps
from lmcockpit.tui.formatting import DASH, fmt_duration
from lmcockpit.tui.headless import progress_line
from lmcockpit.core.run.state import RunState

from .helpers import cli, dashboard, detached, last_step, stop, wait_for, wait_until

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MAX_STEPS = 1000


def step(n: int, dt: float) -> P.StepMetrics:
    return P.StepMetrics(n, 5.0 - n / 1000, 1e-3, 1.0, 4096 / dt, None, dt, n * 4096)


def ps_eta(summary: host.Summary) -> str:
    """The ETA column `lmcockpit ps` prints for the run this summary is of."""
    [row] = ps.rows([live.LiveRun(summary.record, True)])
    return row[4]


def test_ps_and_the_dashboard_give_one_eta_for_the_same_steps(tmp_path):
    """A run whose steps vary (a compiled first step, then noise), rolled back once, and resumed:
    after every event the host's live.json ETA (what `ps` prints) is the RunState's (what the
    dashboard and the headless line print), and a viewer attaching midway, whose steps so far come
    from the run folder's history, has it too."""
    rng = random.Random(51)
    hosted = RunState()  # the run host's fold, which its live.json summary reads
    summary = host.Summary(live.LiveRecord(str(tmp_path), 1, "here", "sock"), hosted)
    watching = RunState()  # a cockpit that started the run: every event
    late: RunState | None = None  # a viewer that attaches at step 150

    def apply(event: object) -> None:
        for view in (hosted, summary, watching, *([late] if late else [])):
            view.apply(event)
        if isinstance(event, (P.StepMetrics, P.RolledBack)):
            assert summary.record.eta_s == watching.eta, event
            if late is not None:
                assert late.eta == pytest.approx(summary.record.eta_s, rel=1e-9), event
            shown = fmt_duration(watching.eta) if watching.eta is not None else DASH
            assert ps_eta(summary) == shown
            assert f"ETA {shown}" in progress_line(watching, None, None)

    apply(P.RunStarted("run", {}, 1000, "cpu", "fp32", 0, MAX_STEPS, 4096))
    apply(P.StateChanged(P.RUNNING))
    apply(step(1, 30.0))  # compiling: no rate yet, anywhere
    assert summary.record.eta_s is None and watching.eta is None
    for n in range(2, 121):
        apply(step(n, rng.uniform(0.05, 0.5)))
    apply(P.RolledBack(120, 100, 20, 1, 0.5, 100))
    assert summary.record.step == watching.step == 100
    for n in range(101, 151):
        apply(step(n, rng.uniform(0.05, 0.5)))

    # A viewer attaching now: the snapshot's RunStarted, then the run's history as the folder holds it.
    late = RunState()
    late.apply(P.RunStarted("run", {}, 1000, "cpu", "fp32", 0, MAX_STEPS, 4096))
    late.apply(P.HistoryRead(History.from_state(watching.history.state())))
    assert late.eta == pytest.approx(summary.record.eta_s, rel=1e-9)
    for n in range(151, 201):
        apply(step(n, rng.uniform(0.05, 0.5)))
    apply(P.StateChanged(P.PAUSED))
    assert summary.record.eta_s == watching.eta is not None  # a pause changes no figure

    # Resumed from step 200: the new start's first step compiles again, and is left out everywhere.
    late = None
    apply(P.RunStarted("run", {}, 1000, "cpu", "fp32", 200, MAX_STEPS, 4096))
    apply(step(201, 40.0))
    assert summary.record.eta_s is None and watching.eta is None
    apply(step(202, 0.25))
    assert watching.eta == summary.record.eta_s == 0.25 * (MAX_STEPS - 202)
    apply(P.StateChanged(P.ABORTED))
    assert summary.record.eta_s is None and watching.eta is None  # nothing more is coming


def ps_row(run) -> dict[str, str]:
    proc = cli("ps")
    assert proc.returncode == 0, proc.stderr
    header, *lines = [line.split("\t") for line in proc.stdout.splitlines()]  # piped: tab-separated
    return dict(zip(header, next(line for line in lines if line[0] == str(run.resolve()))))


@pytest.mark.slow
async def test_every_viewer_of_a_detached_run_shows_its_elapsed_time_and_ps_s_eta(tmp_path):
    """A run that trains in the background, watched by two cockpits one after the other, each
    attaching well after the run began: each shows the time since the run began, the same start
    within a second, and, with the run paused, the ETA `ps` prints."""
    before = time.time()
    run = detached(tmp_path, "run")
    served = time.time()  # the host serves: the run began between `before` and now
    try:
        wait_until(lambda: last_step(run) >= 5, what="training to be under way")
        starts = []
        for viewer in ("first", "second"):
            app = CockpitApp(attach=run, telemetry=False)
            async with app.run_test(size=(120, 40)) as pilot:
                dash = dashboard(app)
                await wait_for(pilot, lambda: dash.view.step >= 5, what=f"the {viewer} cockpit to catch up")
                now, elapsed = time.time(), dash.view.elapsed
                assert now - served <= elapsed <= now - before + 0.5, (viewer, elapsed, now - served)
                starts.append(now - elapsed)
                if viewer == "first":
                    await pilot.press("p")
                    await wait_for(pilot, lambda: dash.view.state == P.PAUSED, what="the pause")
                # live.json rewritten after the last step: ps reads the run where this cockpit sees it
                wait_until(lambda: (r := live.LiveRecord.read(run)) is not None and r.state == P.PAUSED
                           and r.step == dash.view.step, what="live.json at the paused step")
                row = ps_row(run)
                assert row["step"] == f"{dash.view.step}/100000"
                assert row["ETA"] == fmt_duration(dash.view.eta), (row["ETA"], dash.view.eta)
        assert abs(starts[0] - starts[1]) < 1.0, starts
    finally:
        stop(run)

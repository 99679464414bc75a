"""Runs started apart from their cockpit, or left by it: detached from the cockpit, a hang-up, a
host that dies, `--detach`. Kept apart from tests/test_attach.py, whose module-wide background
run would train on both cores beside every one of these (they took twice as long next to it).

The waits poll the state they wait for (metrics.jsonl, a pid), with deadlines."""

from __future__ import annotations

import json
import os
import signal

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.process import live
from lmcockpit.core.process.viewer import NotLive, RunViewer
from lmcockpit.core.run.folder import read_metrics
from lmcockpit.tui.app import CockpitApp

from .helpers import cli, dashboard, detached, last_step, request, stop, wait_for, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


# ----------------------------------------------------------------- detaching from the cockpit
async def test_a_run_detached_from_the_cockpit_trains_on_and_attaching_shows_it_all(tmp_path):
    plan = request(tmp_path, "training.max_steps=100000", "training.log_every=1")
    run = plan.run_dir
    try:
        app = CockpitApp(plan, telemetry=False)
        async with app.run_test(size=(120, 40)) as pilot:
            dash = dashboard(app)
            await wait_for(pilot, lambda: dash.view.step >= 3, what="training to start")
            await pilot.press("d")
            await wait_for(pilot, lambda: not app.is_running, what="the cockpit to close")
        detached_at = dash.view.step
        assert f"lmcockpit attach {dash.engine.run_dir}" in app.run_report()
        wait_until(lambda: last_step(run) >= detached_at + 5, what="steps after the cockpit closed")

        second = CockpitApp(attach=run, telemetry=False)
        async with second.run_test(size=(120, 40)) as pilot:
            dash = dashboard(second)
            target = last_step(run) + 3
            await wait_for(pilot, lambda: dash.view.step >= target, what="live steps in the attached cockpit")
            steps = [r.step for r in dash.view.history.recent()]
            assert steps[:detached_at] == list(range(1, detached_at + 1))  # the history, from step 1
            assert steps == list(range(1, dash.view.step + 1))
            await pilot.press("p")  # the controls work on an attached run
            await wait_for(pilot, lambda: dash.view.state == P.PAUSED, what="the pause")
            await pilot.press("q")
            await pilot.press("enter")  # stop it (with a checkpoint) and quit
            await wait_for(pilot, lambda: not second.is_running, timeout=120, what="the cockpit to quit")
        dash.engine.join(timeout=60)
        assert not dash.engine.host_alive
        assert all(r.run_dir != run.resolve() for r in live.live_runs())  # an ended run is listed no more
        assert read_metrics(run, "checkpoint")  # stopped with a checkpoint
    finally:
        stop(run)


def test_a_hang_up_closes_the_cockpit_and_leaves_the_run_training(tmp_path, terminal):
    out = tmp_path / "run"
    term = terminal("debug", "--set", "training.max_steps=100000", "--set", "training.log_every=1",
                    "--set", "eval.every=0", "--set", "sample.prompts=[]", "--out", str(out), size=(100, 30))
    try:
        wait_until(lambda: last_step(out) >= 2, what="the cockpit's run to train")
        os.kill(term.pid, signal.SIGHUP)  # the SSH connection drops
        term.end()
        at = last_step(out)
        wait_until(lambda: last_step(out) >= at + 5, what="steps after the hang-up")
        running = [r for r in live.live_runs() if r.run_dir == out.resolve()]
        assert running and running[0].live
    finally:
        stop(out)


# ------------------------------------------------------------------------------ dead runs
def test_a_run_whose_host_died_is_listed_dead_with_its_resume_command(tmp_path):
    run = detached(tmp_path, "run", "checkpoint.every=5")
    wait_until(lambda: last_step(run) >= 6, what="a checkpoint's worth of steps")
    record = live.LiveRecord.read(run)
    os.kill(record.pid, signal.SIGKILL)  # the host, and with it the engine's parent
    wait_until(lambda: not live.alive(record.pid), what="the host to die")
    (dead,) = [r for r in live.live_runs() if r.run_dir == run.resolve()]
    assert not dead.live and dead.resume_command == f"lmcockpit --run --resume {run.resolve()}"
    proc = cli("ps")
    assert f"\tdead: lmcockpit --run --resume {run.resolve()}\n" in proc.stdout
    with pytest.raises(NotLive, match="died at step .* resume it with: lmcockpit --run --resume"):
        RunViewer(run)
    attach = cli("attach", str(run))
    assert attach.returncode == 2 and "resume it with" in attach.stderr
    live.forget(run)  # listed no more, as a resume would leave it: the next tests' launch screens


def test_detach_starts_a_run_with_no_cockpit_and_prints_how_to_attach(tmp_path):
    out = tmp_path / "run"
    proc = cli("debug", "--detach", "--set", "training.max_steps=100000", "--set", "eval.every=0",
               "--set", "sample.prompts=[]", "--out", str(out), timeout=60)
    try:
        assert proc.returncode == 0, proc.stderr
        assert f"lmcockpit attach {out}" in proc.stdout
        wait_until(lambda: last_step(out) >= 2, what="the detached run to train")
        assert json.loads((out / live.RECORD).read_text())["run_dir"] == str(out.resolve())
    finally:
        stop(out)
    assert cli("--run", "debug", "--detach").returncode == 2  # one of the two, not both

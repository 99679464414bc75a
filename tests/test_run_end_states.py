"""One name for each way a run ends, the engine's own: a run aborted, interrupted, stopped at its
target or finished is called by its final state in run_summary (the launch screen's runs table),
in `lmcockpit compare` and in the dashboard's baseline list, as the dashboard and the exit line
call it. Real tiny runs by the real engine process; the screens through App.run_test()."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.run.folder import METRICS, read_metrics, run_summary, well_formed
from lmcockpit.core.run.resume import plan_resume
from lmcockpit.tui.app import CockpitApp

from .helpers import cli, drive_engine, shown_in, tiny_config, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def stop_at_step(step: int, command: P.Abort):
    """on_event for drive_engine: `command` once the run has trained `step` steps."""
    sent = []

    def on_event(engine, event):
        if isinstance(event, P.StepMetrics) and event.step >= step and not sent:
            engine.send(command)
            sent.append(event.step)
    return on_event


# name → (overrides, on_event); each ends as the engine's final state recorded in `runs`
ENDINGS = {
    "finished": ((), None),
    # the first evaluation (step 6 of 12) is under a validation loss of 100
    "at-target": (("training.target_val_loss=100.0", "training.stop_at_target=true"), None),
    "aborted": ((), stop_at_step(3, P.Abort(save=True))),  # the dialog's Enter
    "interrupted": ((), stop_at_step(3, P.Abort(save=True, interrupted=True))),  # Ctrl-C, a lost front-end
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The four ways under one runs/ folder: (its path, run name → the engine's final state)."""
    root = tmp_path_factory.mktemp("endings") / "runs"
    final = {}
    for name, (overrides, on_event) in ENDINGS.items():
        engine, _ = drive_engine(tiny_config(*overrides), root / name, on_event=on_event)
        assert engine.failure is None, engine.failure
        final[name] = engine.final_state
    assert final == {"finished": P.FINISHED, "at-target": P.FINISHED, "aborted": P.ABORTED,
                     "interrupted": P.INTERRUPTED}
    return root, final


def test_run_summary_calls_a_run_by_the_engines_final_state(runs):
    root, final = runs
    for name, state in final.items():
        summary = run_summary(root / name)
        assert summary["status"] == state, (name, summary)
    # stopped at its target and aborted both end short of max_steps: only the end row tells them apart
    assert run_summary(root / "at-target")["step"] == 6 and run_summary(root / "aborted")["step"] < 12
    assert [r["state"] for r in read_metrics(root / "aborted", "end")] == [P.ABORTED]


def test_compare_calls_each_run_by_its_final_state(runs):
    root, final = runs
    proc = cli("compare", *(str(root / name) for name in final))
    assert proc.returncode == 0, proc.stderr
    state = next(line.split("\t") for line in proc.stdout.splitlines() if line.startswith("state\t"))
    assert state[1:] == list(final.values()), proc.stdout


async def test_the_launch_screen_and_the_baseline_list_call_each_run_by_its_final_state(runs):
    from textual.widgets import OptionList

    from .helpers import FedDashboard

    root, final = runs
    app = CockpitApp(runs_root=root, telemetry=False)
    async with app.run_test(size=(120, 40)) as pilot:
        table = app.screen.query_one("#runs")
        await wait_for(pilot, lambda: table.row_count == len(final), what="the past runs")
        shown = shown_in(app, table)
        for name, state in final.items():
            assert [line for line in shown if f" {name} " in f" {line} " and f" {state} " in line], (name, shown)

    app = FedDashboard()
    app.runs_root = root
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        await pilot.press("b")
        options = app.screen.query_one(OptionList)
        listed = {Path(o.id).name: str(o.prompt) for o in (options.get_option_at_index(i)
                                                           for i in range(options.option_count))}
        assert {name: prompt.split()[1] for name, prompt in listed.items()} == final, listed


def test_a_run_resumed_after_an_abort_is_called_by_how_its_new_training_ended(runs, tmp_path):
    """The aborted run's end row stays in metrics.jsonl when it is resumed in place; the training
    after it decides its state."""
    import shutil

    root, _ = runs
    run = tmp_path / "aborted"
    shutil.copytree(root / "aborted", run)
    plan = plan_resume(str(run), [], None)
    engine, _ = drive_engine(None, None, resume=plan)
    assert engine.final_state == P.FINISHED, engine.failure
    assert [r["state"] for r in read_metrics(run, "end")] == [P.ABORTED, P.FINISHED]
    assert run_summary(run)["status"] == P.FINISHED


@pytest.mark.parametrize("row", [
    {"kind": "end", "time": 1.0, "step": 3, "state": "stopped"},  # not one of the engine's end states
    {"kind": "end", "time": 1.0, "step": 3},
    {"kind": "end", "time": 1.0, "step": -1, "state": "aborted"},
])
def test_an_end_row_the_engine_would_not_write_makes_the_run_unreadable(runs, tmp_path, row):
    import shutil

    root, _ = runs
    run = tmp_path / "run"
    shutil.copytree(root / "aborted", run)
    assert well_formed(read_metrics(run, "end")[-1])
    with open(run / METRICS, "a") as fh:
        fh.write(json.dumps(row) + "\n")
    assert not well_formed(row) and run_summary(run)["status"] == "unreadable"

"""Where a run's time goes (#53): each step's parts measured at its boundaries, the work between
steps, their fold (run/anatomy.py) through a folder's history and a live run's state, and what
`--run` and `compare` say of them."""

from __future__ import annotations

import json
import time

import pytest
import torch

from lmcockpit.core import protocol as P
from lmcockpit.core.run import history_file
from lmcockpit.core.run.anatomy import OUTSIDE, STEP_PARTS, Anatomy, pct
from lmcockpit.core.run.folder import METRICS, read_metrics
from lmcockpit.core.run.history import History
from lmcockpit.core.run.state import RunState
from lmcockpit.core.train.step_clock import Between, StepClock


# ------------------------------------------------------------------------------- measuring
def test_a_step_s_parts_cover_it_from_its_first_boundary_to_its_last():
    clock = StepClock(torch.device("cpu"))
    t0 = time.perf_counter()
    clock.start()
    a = torch.randn(200, 200)
    for _ in range(2):  # a part that comes back (a micro-batch each) adds up
        b = a @ a
        clock.mark("data")
        b.sum().item()
        clock.mark("compute")
    clock.mark("optimizer")
    span = time.perf_counter() - t0
    parts = clock.read()
    assert list(parts) == ["data", "compute", "optimizer"]
    assert all(v >= 0 for v in parts.values())
    assert 0 < sum(parts.values()) <= span
    assert sum(parts.values()) == pytest.approx(span, rel=0.05, abs=1e-4)
    clock.start()  # a new step starts from nothing
    clock.mark("data")
    assert list(clock.read()) == ["data"]


def test_work_between_steps_is_taken_once_by_the_next_row():
    between = Between()
    with between.timing("evaluation"):
        sum(range(10_000))
    between.add("checkpoints", 0.25)
    between.add("checkpoints", 0.25)
    between.add("compile", 0.0)  # nothing spent: not a key in the row
    taken = between.take()
    assert set(taken) == {"evaluation", "checkpoints"} and taken["checkpoints"] == 0.5 and taken["evaluation"] > 0
    assert between.take() == {}


# ------------------------------------------------------------------------------- folding
def test_the_fold_sums_every_step_and_smooths_the_recent_split():
    a = Anatomy()
    a.add({"data": 0.1, "compute": 0.6, "sync": 0.1, "optimizer": 0.2})
    a.add({"data": 0.1, "compute": 0.6, "sync": 0.1, "optimizer": 0.2}, {"evaluation": 1.0, "checkpoints": 0.5})
    a.add({}, {"compile": 2.0})  # the step that compiled: no parts of its own
    assert a.steps == pytest.approx(2.0) and a.wall == pytest.approx(5.5)
    shares = a.shares()
    assert [n for n, _ in shares] == ["data", "compute", "sync", "optimizer", "compile", "evaluation", "checkpoints"]
    assert sum(s for _, s in shares) == pytest.approx(1.0)
    assert dict(shares)["compile"] == pytest.approx(2.0 / 5.5)
    assert a.compute_share() == pytest.approx(0.6)
    a.add({"data": 0.5, "compute": 0.5})  # a step all data and compute: the recent split moves a tenth
    assert a.recent["data"] == pytest.approx(0.9 * 0.1 + 0.1 * 0.5)
    assert a.line().startswith("steps ") and "compile " in a.line() and "; " in a.line()
    assert Anatomy.from_state(json.loads(json.dumps(a.state()))).state() == a.state()


def test_shares_read_as_percentages_down_to_a_trace():
    assert [pct(s) for s in (0, 0.0004, 0.0123, 0.5, 1.0)] == ["0%", "<0.1%", "1.2%", "50%", "100%"]


def test_a_rollback_cuts_the_curve_but_not_the_time_spent():
    h = History()
    for step in range(1, 6):
        h.add(P.StepMetrics(step, 5.0, 1e-3, 1.0, 100.0, None, 1.0, step * 10, {}, {"compute": 1.0}, {}))
    h.cut(3)
    h.add(P.StepMetrics(3, 4.0, 1e-3, 1.0, 100.0, None, 1.0, 30, {}, {"compute": 1.0}, {}))
    assert h.last_step == 3 and h.anatomy.parts == {"compute": 6.0}


def test_an_older_row_without_parts_adds_nothing():
    h = History()
    h.fold({"kind": "step", "step": 1, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 9.0, "mfu": None,
            "dt": 1.0, "tokens_seen": 10, "mem": {}})
    assert not h.anatomy and h.anatomy.line() == "" and h.count == 1


# ------------------------------------------------------------------------------- a real run
def test_a_run_s_rows_say_where_each_step_and_the_time_between_went(trained_run):
    """The shrunk cpu preset (compiled), 12 steps, evaluated and checkpointed at 6 and 12, task
    scored, a sample at the end."""
    run, proc = trained_run
    steps = read_metrics(run, "step")
    first, rest = steps[0], steps[1:]
    assert first["parts"] == {} and first["between"]["compile"] == pytest.approx(first["dt"], rel=1e-3)
    for row in rest:
        assert list(row["parts"]) == list(STEP_PARTS), row
        assert sum(row["parts"].values()) == pytest.approx(row["dt"], rel=0.05), row
    after = next(r for r in steps if r["step"] == 7)["between"]  # step 6's evaluation, tasks and checkpoint
    assert set(after) == {"evaluation", "tasks", "checkpoints"} and all(v > 0 for v in after.values())
    assert all(r["between"] == {} for r in steps if r["step"] not in (1, 7))
    end = read_metrics(run, "end")[0]["between"]  # step 12's, and the sample after the last step
    assert set(end) == {"evaluation", "tasks", "checkpoints", "samples"}
    # The folder's fold holds all of it, and --run's last lines say it as that fold does.
    history = history_file.load(run, write=False)[0]
    assert set(history.anatomy.between) == set(OUTSIDE) - {"profile"}  # no profile asked for
    assert history.anatomy.wall == pytest.approx(sum(sum(r["parts"].values()) + sum(r["between"].values())
                                                     for r in steps) + sum(end.values()))
    said = [line for line in proc.stdout.splitlines() if line.startswith("time: ")]
    assert said == [f"time: {history.anatomy.line()}"]


def test_a_live_state_folds_the_end_row_as_the_folder_does(trained_run):
    run, _ = trained_run
    live = RunState()
    for line in (run / METRICS).read_text().splitlines():
        row = json.loads(line)
        if row["kind"] == "step":
            live.apply(P.StepMetrics(**{k: v for k, v in row.items() if k not in ("kind", "time")}))
        elif row["kind"] == "end":
            live.apply(P.Ended(row["step"], row["state"], row["between"]))
    assert live.history.anatomy.state() == history_file.load(run, write=False)[0].anatomy.state()

"""train.log holds what the engine says, evaluations and pauses included (issue #51, 7): each
evaluation's line as `--run` prints it, the `tasks:` line, and a line when training pauses and
when it goes on. Real runs: the engine driven through its queues, and `lmcockpit --run` piped."""

from __future__ import annotations

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.process.child import eval_line

from .helpers import TINY, as_flags, cli, drive_engine, tiny_config

pytestmark = pytest.mark.slow


def test_evaluations_and_a_pause_are_in_train_log_and_the_log_events(tmp_path):
    paused = []

    def steer(engine, ev) -> None:
        if isinstance(ev, P.StepMetrics) and ev.step == 3:
            engine.send(P.Pause())
        elif isinstance(ev, P.StateChanged) and ev.state == P.PAUSED and not paused:
            paused.append(True)
            engine.send(P.Resume())

    cfg = tiny_config("eval.every=6", 'eval.tasks=["python-functions"]', "eval.max_per_task=8")
    engine, events = drive_engine(cfg, tmp_path / "run", on_event=steer)
    assert engine.final_state == P.FINISHED
    evals = [eval_line(e) for e in events if isinstance(e, P.EvalMetrics)]
    assert [line.split(" | ")[0] for line in evals] == ["eval step 6", "eval step 12"]
    assert all(" | val loss " in line and " | python-functions " in line for line in evals), evals

    log = (tmp_path / "run" / "train.log").read_text().splitlines()
    assert [line for line in log if line.startswith("eval step")] == evals
    tasks = [i for i, line in enumerate(log) if line.startswith("tasks: step ")]
    assert [log[i].split(" scored")[0] for i in tasks] == ["tasks: step 6", "tasks: step 12"]
    assert all(log[i + 1] == line for i, line in zip(tasks, evals))  # each evaluation's line after its tasks
    # paused between two steps, at the first the engine took the command after: the step last shown
    at = [e.step for e in events[:events.index(P.StateChanged(P.PAUSED))] if isinstance(e, P.StepMetrics)][-1]
    pause = log.index(f"training paused at step {at}")
    assert f"training resumed at step {at}" in log[pause + 1:]

    # The front-ends' log: each line once, an evaluation's right after its EvalMetrics.
    said = [e.text for e in events if isinstance(e, P.LogLine)]
    assert [line for line in said if line.startswith("eval step")] == evals
    assert said.count(f"training paused at step {at}") == said.count(f"training resumed at step {at}") == 1
    # Right after it, as sent: lines the engine printed (a `tasks:` line) reach the queue through
    # the log pump's thread, and one may land between the two.
    after = [next(e for e in events[i + 1:] if not (isinstance(e, P.LogLine) and e.text.startswith("tasks: ")))
             for i, e in enumerate(events) if isinstance(e, P.EvalMetrics)]
    assert after == [P.LogLine(line) for line in evals]


def test_a_headless_run_prints_each_evaluation_once_as_train_log_holds_it(tmp_path):
    r = cli("--run", "debug", *as_flags(TINY), "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    printed = [line for line in r.stdout.splitlines() if line.startswith("eval step")]
    assert [line.split(" | ")[0] for line in printed] == ["eval step 6", "eval step 12"]
    logged = [line for line in (tmp_path / "run" / "train.log").read_text().splitlines() if line.startswith("eval step")]
    assert logged == printed

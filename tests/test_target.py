"""Time to target: the power-law fit on curves whose answer is known, its words, and a real run's log."""

from __future__ import annotations

import math
import random

import pytest

from lmcockpit.core.run.folder import read_metrics
from lmcockpit.core.run.target import Forecast, forecast, run_time

# L(D) = E + A·D^-alpha in tokens seen, evaluated every 100 steps to step 1,000 (loss 2.84 → 2.42).
E, A, ALPHA, TOKENS = 2.0, 50.0, 0.3, 8192
STEPS = range(100, 1001, 100)


def loss_at(step: float) -> float:
    return E + A * (step * TOKENS) ** -ALPHA


def step_for(target: float) -> float:
    """The curve solved for the target by hand: D = (A / (target - E))^(1/alpha)."""
    return (A / (target - E)) ** (1 / ALPHA) / TOKENS


def exact() -> list[tuple[int, float]]:
    return [(s, loss_at(s)) for s in STEPS]


def noisy() -> list[tuple[int, float]]:
    rng = random.Random(0)
    return [(s, loss_at(s) * (1 + rng.uniform(-0.003, 0.003))) for s in STEPS]


@pytest.mark.parametrize("target", [2.4, 2.3, 2.2])
def test_an_exact_power_law_gives_back_its_own_step(target):
    # A step-0 evaluation (before any training, off any power law in tokens) is left out.
    fc = forecast([(0, 10.8), *exact()], target, TOKENS, max_steps=1_000_000, seconds_per_step=0.25)
    truth = step_for(target)
    assert fc.status == "expected" and fc.at_step == 1000 and fc.evals == 10
    assert fc.step == pytest.approx(truth, rel=0.02)
    assert fc.step_low <= truth <= fc.step_high and fc.step_low <= fc.step <= fc.step_high
    assert fc.floor == pytest.approx(E, abs=0.01)
    assert fc.seconds == pytest.approx((fc.step - 1000) * 0.25)
    assert fc.seconds_low == pytest.approx((fc.step_low - 1000) * 0.25)
    assert fc.seconds_high == pytest.approx((fc.step_high - 1000) * 0.25)


def test_without_a_time_per_step_there_is_a_step_and_no_time():
    fc = forecast(exact(), 2.3, TOKENS, max_steps=1_000_000, seconds_per_step=None)
    assert fc.status == "expected" and fc.step == pytest.approx(step_for(2.3), rel=0.02)
    assert fc.seconds is fc.seconds_low is fc.seconds_high is None
    assert "step 3,100" in fc.short() and " in " not in fc.short()


@pytest.mark.parametrize("target", [2.38, 2.35, 2.3])
def test_noisy_evaluations_keep_the_answer_inside_the_range(target):
    fc = forecast(noisy(), target, TOKENS, max_steps=1_000_000, seconds_per_step=0.25)
    truth = step_for(target)
    assert fc.status == "expected"
    assert fc.step_low <= truth <= fc.step_high
    assert fc.step == pytest.approx(truth, rel=0.10)
    # Noise widens the range beyond what the exact curve gets.
    clean = forecast(exact(), target, TOKENS, max_steps=1_000_000, seconds_per_step=0.25)
    assert fc.step_high - fc.step_low > clean.step_high - clean.step_low


@pytest.mark.slow
def test_the_range_holds_the_answer_about_as_often_as_it_claims():
    """Forty draws of the noise: a 95% range should miss a few of them, not one in six (as the
    profile over E alone does here, 33 of 40: the jackknife's refits make up the rest)."""
    truth, held = step_for(2.35), 0
    for seed in range(40):
        rng = random.Random(seed)
        evals = [(s, loss_at(s) * (1 + rng.uniform(-0.003, 0.003))) for s in STEPS]
        fc = forecast(evals, 2.35, TOKENS, max_steps=1_000_000, seconds_per_step=None)
        held += fc.status == "expected" and fc.step_low <= truth <= fc.step_high
    assert held >= 36


def test_a_target_already_passed_is_reached_at_the_first_evaluation_under_it():
    # The noisy curve is 2.519 at step 500 and 2.490 at 600: 2.5 is first met at 600, and the last
    # evaluation (2.42) is under it.
    fc = forecast(noisy(), 2.5, TOKENS, max_steps=5000, seconds_per_step=0.25)
    first = next(s for s, loss in noisy() if loss <= 2.5)
    assert fc.status == "reached" and fc.step == first == 600
    # A noisy dip under the target that the last evaluation is back above is not "reached".
    dipped = [(100, 3.0), (200, 2.6), (300, 2.49), (400, 2.52)]
    assert forecast(dipped, 2.5, TOKENS, max_steps=5000, seconds_per_step=None).status != "reached"


def test_a_last_evaluation_back_above_the_target_is_due_now_not_in_the_past():
    """The fit meets 2.5 at step ~370, but the run's last evaluation (step 500) is above it: the
    target is due from now on, never at a step already behind the run."""
    evals = [(100, 3.0), (200, 2.6), (300, 2.45), (400, 2.42), (500, 2.51)]
    fc = forecast(evals, 2.5, TOKENS, max_steps=5000, seconds_per_step=0.25)
    assert fc.status == "expected" and fc.step == fc.step_low == 500 < fc.step_high
    assert fc.seconds == fc.seconds_low == 0 < fc.seconds_high
    assert "in under a minute" in fc.short()


def test_reached_needs_no_fit():
    fc = forecast([(50, 3.1)], 3.2, TOKENS, max_steps=5000, seconds_per_step=0.25)
    assert fc.status == "reached" and fc.step == 50


def test_a_target_under_the_floor_is_unreachable():
    fc = forecast(exact(), 1.9, TOKENS, max_steps=1_000_000, seconds_per_step=0.25)
    assert fc.status == "unreachable" and fc.step is None and fc.seconds is None
    assert fc.floor == pytest.approx(E, abs=0.01)


def test_a_target_past_max_steps_is_beyond_the_budget():
    fc = forecast(exact(), 2.2, TOKENS, max_steps=5000, seconds_per_step=0.25)
    assert fc.status == "beyond_budget"
    assert fc.step > 5000 and fc.step == pytest.approx(step_for(2.2), rel=0.02)
    # No budget said (0): the same forecast is only expected.
    assert forecast(exact(), 2.2, TOKENS, max_steps=0, seconds_per_step=0.25).status == "expected"


def test_two_evaluations_are_too_few():
    fc = forecast(exact()[:2], 2.3, TOKENS, max_steps=5000, seconds_per_step=0.25)
    assert fc.status == "too_few" and fc.evals == 2 and fc.min_evals == 3 and fc.at_step == 200
    assert fc.step is None and fc.seconds is None
    assert forecast(exact()[:4], 2.3, TOKENS, 5000, 0.25, min_evals=5).status == "too_few"
    assert forecast([], 2.3, TOKENS, 5000, 0.25).status == "too_few"


@pytest.mark.parametrize("losses", [
    [3.0] * 10,  # flat
    [3.0 + i * 0.01 for i in range(10)],  # rising
    [3.0 + (0.01 if i % 2 else -0.01) for i in range(10)],  # flat, with noise
])
def test_a_curve_that_does_not_fall_never_reaches_a_target_under_it(losses):
    fc = forecast(list(zip(STEPS, losses)), 2.5, TOKENS, max_steps=5000, seconds_per_step=0.25)
    assert fc.status == "unreachable" and fc.step is None
    # The floor said is one the run has been near, not where a curve fitted rising would go.
    assert 2.5 < fc.floor <= max(losses) and "not reachable" in fc.short()


@pytest.mark.parametrize("evals, target", [
    ([(s, 0.0) for s in STEPS], 1.0),
    ([(s, -1.0 - s / 1000) for s in STEPS], -5.0),
    ([(s, 3.0) for s in STEPS], float("nan")),
    ([(10**12, 3.0), (2 * 10**12, 2.99), (3 * 10**12, 2.985)], 2.5),
    ([(None, 1.0), ("x", "y"), (5,), (10, float("inf")), (20, 3.0), (30, 2.9), (40, 2.85)], 2.8),
])
def test_odd_inputs_give_a_status_and_a_line(evals, target):
    for tokens, max_steps, per_step in ((TOKENS, 5000, 0.25), (0, 0, None), (-1, -1, float("nan"))):
        fc = forecast(evals, target, tokens, max_steps, per_step)
        assert fc.status in ("reached", "expected", "beyond_budget", "unreachable", "too_few")
        assert fc.short(cost_per_hour=2.0)


def test_nan_and_infinite_losses_are_skipped():
    holed = [*exact()[:4], (450, math.nan), *exact()[4:7], (750, math.inf), *exact()[7:]]
    fc, clean = (forecast(e, 2.3, TOKENS, 1_000_000, 0.25) for e in (holed, exact()))
    assert fc == clean and fc.evals == 10
    assert forecast([(100, math.nan), (200, math.nan), *exact()[2:4]], 2.3, TOKENS, 5000, 0.25).evals == 2


def test_a_resumed_runs_later_rows_replace_the_steps_it_went_back_over():
    """A run that evaluated at 600 and 700, then was resumed from its checkpoint at 500, logs 600
    and 700 again: the later rows are the run as it stands, the earlier ones are no part of it."""
    clean = forecast(exact(), 2.3, TOKENS, 1_000_000, 0.25)
    resumed = [*exact()[:5], (600, 9.0), (700, 9.0), *exact()[5:]]
    assert forecast(resumed, 2.3, TOKENS, 1_000_000, 0.25) == clean
    twice = [*exact()[:5], (500, 9.0), *exact()[4:]]  # a step logged twice
    assert forecast(twice, 2.3, TOKENS, 1_000_000, 0.25) == clean


# --------------------------------------------------------------------------- the words
def test_the_expected_line_gives_the_target_step_range_time_and_money():
    fc = Forecast("expected", step=4837, step_low=4120, step_high=5880, seconds=3900, at_step=1000, target=3.2)
    assert fc.short() == "val 3.20 at ~step 4,800 (4,100–5,900), in 1 h 05 m"
    assert fc.short(cost_per_hour=1.94) == "val 3.20 at ~step 4,800 (4,100–5,900), in 1 h 05 m ≈ $2.10"
    days = Forecast("expected", step=123_456, step_low=100_001, step_high=math.inf, seconds=2 * 86400 + 3 * 3600 + 10,
                    at_step=1000, target=2.5)
    assert days.short() == "val 2.50 at ~step 120,000 (100,000 or later), in 2 d 03 h"
    soon = Forecast("expected", step=1010, step_low=1000, step_high=1100, seconds=20, at_step=1000, target=2.5)
    assert soon.short() == "val 2.50 at ~step 1,000 (1,000–1,100), in under a minute"


def test_a_forecast_writes_its_own_numbers():
    fc = forecast(exact(), 2.3, TOKENS, max_steps=1_000_000, seconds_per_step=0.25)
    text = fc.short(cost_per_hour=3.6)
    # 3,110 steps: ~2,110 steps more at 0.25 s = 8.8 minutes; 3.6 $/h for them ≈ $0.53.
    assert text.startswith("val 2.30 at ~step 3,100 (3,000–3,200), in 9 m")
    assert text.endswith(f"≈ ${fc.seconds / 3600 * 3.6:.2f}") and "$0.53" in text


def test_the_other_lines():
    assert Forecast("reached", step=300.0, at_step=900).short(cost_per_hour=5) == "reached at step 300"
    assert (Forecast("beyond_budget", step=12_345, max_steps=5000).short()
            == "not within this run's budget (needs ~step 12,000 of 5,000)")
    assert Forecast("unreachable", floor=3.412).short() == "not reachable by the fitted curve (floor 3.41)"
    assert Forecast("too_few", evals=2, min_evals=3).short() == "foreseen after 3 evaluations (has 2)"
    # The same words from forecasts made, not built: each names the target it is about (#51)
    assert forecast(noisy(), 2.5, TOKENS, 5000, 0.25).short() == "val 2.50 reached at step 600"
    assert (forecast(exact(), 2.2, TOKENS, 5000, 0.25).short()
            == "val 2.20 not within this run's budget (needs ~step 12,000 of 5,000)")
    assert forecast(exact(), 1.9, TOKENS, 5000, 0.25).short() == "val 1.90 not reachable by the fitted curve (floor 2.00)"
    assert forecast(exact()[:2], 2.3, TOKENS, 5000, 0.25).short() == "val 2.30 foreseen after 3 evaluations (has 2)"


# --------------------------------------------------------------------------- a real run
def test_a_real_runs_two_evaluations_are_too_few(trained_run):
    run_dir, done = trained_run
    assert done.returncode == 0, done.stderr
    evals = [(r["step"], r["val_loss"]) for r in read_metrics(run_dir, "eval") if r.get("val_loss") is not None]
    assert [step for step, _ in evals] == [6, 12] and all(math.isfinite(loss) for _, loss in evals)
    fc = forecast(evals, target=0.5, tokens_per_step=8 * 64, max_steps=12, seconds_per_step=0.1)
    assert fc.status == "too_few" and fc.evals == 2 and fc.at_step == 12
    assert fc.short() == "val 0.50 foreseen after 3 evaluations (has 2)"


@pytest.mark.slow
def test_a_run_says_when_it_will_get_there_and_stops_at_its_target(tmp_path):
    """The same run twice (CPU training repeats itself exactly): once to learn its validation
    losses, then with the one at step 30 as its target and stop_at_target: each evaluation line
    says how far the target is, and the run ends at step 30 with a checkpoint."""
    from tests.helpers import SHRINK_CPU, TINY, as_flags, cli

    flags = as_flags([*SHRINK_CPU, *TINY, "training.compile=false", "training.max_steps=50", "eval.every=10"])
    first = cli("--run", "cpu", *flags, "--out", str(tmp_path / "first"))
    assert first.returncode == 0, first.stderr
    losses = {row["step"]: row["val_loss"] for row in read_metrics(tmp_path / "first", "eval")}
    assert losses[30] < losses[20]  # the run is learning: a target it meets at 30, not before

    run = tmp_path / "aimed"
    r = cli("--run", "cpu", *flags, *as_flags([f"training.target_val_loss={losses[30]!r}", "training.stop_at_target=true",
                                                "hardware.cost_per_hour=2.5"]), "--out", str(run))
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("eval step")]
    aim = f"val {losses[30]:.2f}"
    assert [line.split(" | target ")[1] for line in lines] == [
        f"{aim} foreseen after 3 evaluations (has 1)", f"{aim} foreseen after 3 evaluations (has 2)",
        f"{aim} reached at step 30"]
    [row] = read_metrics(run, "target")
    assert {k: v for k, v in row.items() if k not in ("time", "seconds")} == {
        "kind": "target", "step": 30, "what": "val_loss", "value": losses[30], "target": losses[30]}
    # the run's training time when it got there: its 30 steps' (#51, 11), in the log line as well
    trained = sum(r["dt"] for r in read_metrics(run, "step"))
    assert row["seconds"] == pytest.approx(trained)
    assert f"at step 30, after {run_time(trained)} of training" in (run / "train.log").read_text()
    # and the last line says what the run was aimed at and how it ended
    [last] = [line for line in r.stdout.splitlines() if line.startswith("finished ")]
    assert last.endswith(f"; target {aim} reached at step 30"), last
    assert [row["step"] for row in read_metrics(run, "eval")] == [10, 20, 30]  # not evaluated twice at 30
    assert (run / "checkpoints" / "step_000030" / "state.json").is_file()
    assert "the run ends here (training.stop_at_target)" in (run / "train.log").read_text()


def test_the_dashboard_shows_the_forecast_in_time_and_money():
    """The throughput panel's target row, from the evaluations a cockpit has seen (here made up
    on a known power law, as above)."""
    from lmcockpit.core import protocol as P
    from lmcockpit.core.run.state import RunState
    from lmcockpit.tui.widgets.panels import throughput_rows

    view = RunState()
    view.apply(P.RunStarted("run", {"training": {"target_val_loss": 2.3}, "hardware": {"cost_per_hour": 3.0}},
                            1000, "cpu", "fp32", 0, 100_000, TOKENS))
    assert dict(throughput_rows(view))["target"] == "val 2.30 foreseen after 3 evaluations (has 0)"
    for step in (1, 2):  # the first step's time is compilation's: the second sets the step time
        view.apply(P.StepMetrics(step, 9.0, 1e-3, 1.0, 1000.0, None, 0.5, step * TOKENS, {}))
    for step in range(100, 1001, 100):
        view.apply(P.EvalMetrics(step, loss_at(step), 1.0))
    ahead = forecast([(s, loss_at(s)) for s in range(100, 1001, 100)], 2.3, TOKENS, 100_000, 0.5)
    assert dict(throughput_rows(view))["target"] == ahead.short(3.0) and "$" in ahead.short(3.0)


@pytest.mark.slow
def test_ps_says_when_a_background_run_should_reach_its_target(tmp_path):
    """The run host refits the forecast at each evaluation into live.json, where ps reads it."""
    from tests.helpers import cli, detached, stop, wait_until

    run = detached(tmp_path, "run", "eval.every=3", "training.target_val_loss=0.5")

    def target() -> str | None:
        out = cli("ps", timeout=60).stdout
        header, *lines = [line.split("\t") for line in out.splitlines()]
        row = next((dict(zip(header, line)) for line in lines if line[0] == str(run.resolve())), None)
        return row and row["target"]

    try:
        # 0.5 is far below what a 2-layer model of 64 wide reaches: the fit says so once it has three
        # evaluations (before, "needs 3 evaluations"; they come a second apart, too fast to catch)
        final = wait_until(lambda: (t := target()) not in (None, "–") and "foreseen after" not in t and t,
                           what="a fitted forecast")
        assert final.startswith(("val 0.50 not reachable by the fitted curve", "val 0.50 not within this run's budget",
                                 "val 0.50 at"))
    finally:
        stop(run)


def test_a_task_s_accuracy_is_forecast_through_its_error_rate():
    """Accuracy rising as 1 - (E + A·D^-alpha): the step for a target accuracy comes back as for
    a loss, and the lines speak of the task and its accuracy."""
    from lmcockpit.core.run.target import forecast_accuracy

    scores = [(s, 1 - loss_at(s) / 4) for s in STEPS]  # the same curve, as an error rate from 0.71 down to 0.60
    ahead = forecast_accuracy("hellaswag", scores, 1 - 2.3 / 4, TOKENS, 100_000, 0.5)
    assert ahead.status == "expected" and ahead.step == pytest.approx(step_for(2.3), rel=0.02)
    assert ahead.short().startswith(f"hellaswag {1 - 2.3 / 4:.2f} at ~step ")
    never = forecast_accuracy("hellaswag", scores, 0.9, TOKENS, 100_000, 0.5)  # above the ceiling, 1 - 2.0 / 4
    assert never.status == "unreachable" and never.short().startswith(
        "hellaswag 0.90 not reachable by the fitted curve (ceiling 0.5")
    assert forecast_accuracy("hellaswag", scores, 0.25, TOKENS, 100_000, 0.5).short() == "hellaswag 0.25 reached at step 100"


@pytest.mark.slow
def test_a_run_aimed_at_a_task_s_accuracy_stops_where_it_first_gets_there(tmp_path):
    """The run twice again: its python-functions accuracy at step 30 as the target, then the run
    stops at the first scoring that reaches it, the evaluation lines saying how far it is."""
    from tests.helpers import SHRINK_CPU, TINY, as_flags, cli

    flags = as_flags([*SHRINK_CPU, *TINY, "training.compile=false", "training.max_steps=50", "eval.every=10",
                      'eval.tasks=["python-functions"]', "eval.max_per_task=24"])
    first = cli("--run", "cpu", *flags, "--out", str(tmp_path / "first"))
    assert first.returncode == 0, first.stderr
    accuracy = {row["step"]: row["tasks"]["python-functions"]["accuracy"] for row in read_metrics(tmp_path / "first", "eval")}
    aim = max(accuracy[30], 1 / 24)  # above 0: a target of no items right is no target
    stop = next(step for step in sorted(accuracy) if accuracy[step] >= aim)

    run = tmp_path / "aimed"
    r = cli("--run", "cpu", *flags, *as_flags(['training.target_task="python-functions"', f"training.target_accuracy={aim!r}",
                                                "training.stop_at_target=true"]), "--out", str(run))
    assert r.returncode == 0, r.stderr
    [row] = read_metrics(run, "target")
    assert (row["step"], row["what"], row["value"], row["target"]) == (stop, "python-functions", accuracy[stop], aim)
    assert [row["step"] for row in read_metrics(run, "eval")] == [s for s in sorted(accuracy) if s <= stop]
    lines = [line for line in r.stdout.splitlines() if line.startswith("eval step")]
    assert lines[-1].endswith(f" | target python-functions {aim:.2f} reached at step {stop}")


@pytest.mark.slow
@pytest.mark.parametrize("sets, message", [
    (['eval.tasks=["python-functions"]', 'training.target_task="hellaswag"', "training.target_accuracy=0.3"],
     "training.target_task = 'hellaswag': not a task of eval.tasks (its tasks: python-functions)"),
    (["training.target_accuracy=0.3"], "training.target_accuracy = 0.3 needs training.target_task"),
    (['eval.tasks=["python-functions"]', 'training.target_task="python-functions"', "training.target_accuracy=0.3",
      "training.target_val_loss=3.0"], "one target at a time"),
])
def test_a_target_that_cannot_be_aimed_at_is_one_error_line(tmp_path, sets, message):
    from tests.helpers import as_flags, cli

    r = cli("--run", "cpu", *as_flags(sets), "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    [line] = r.stderr.strip().splitlines()
    assert line.startswith("error: ") and message in line
    assert not (tmp_path / "run").exists()

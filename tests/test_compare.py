"""Comparing runs: run folders the real engine wrote, read into curves and a summary; the launch
screen's marks and compare view through App.run_test(); `lmcockpit compare` as a user runs it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.config import ConfigError
from lmcockpit.core.run.curves import differing_settings, load_run
from lmcockpit.core.run.folder import METRICS, read_metrics
from lmcockpit.tui.app import CockpitApp
from lmcockpit.tui.formatting import DASH
from lmcockpit.tui.screens.side_by_side import CompareScreen
from lmcockpit.tui.screens.launch import LaunchScreen
from lmcockpit.tui.widgets.compare_chart import CompareChart

from .helpers import cli, drive_engine, ema, shown_in, tiny_config, wait_for

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Two tiny finished runs, alike but for the AdamW learning rate: runs/lr-high, runs/lr-low."""
    root = tmp_path_factory.mktemp("compare") / "runs"
    for name, lr in (("lr-high", "0.01"), ("lr-low", "0.001")):
        engine, _ = drive_engine(tiny_config(f"optimizer.lr={lr}"), root / name)
        assert engine.final_state == P.FINISHED, engine.failure
    return root


# ------------------------------------------------------------------------------ loading
def test_a_run_folder_reads_into_its_curves_and_summary(runs):
    run = load_run(runs / "lr-high")
    steps = read_metrics(runs / "lr-high", "step")
    evals = read_metrics(runs / "lr-high", "eval")
    assert run.name == "lr-high" and run.status == "finished"
    assert [(r.step, r.loss) for r in run.history.recent()] == [(r["step"], r["loss"]) for r in steps]
    assert (run.val_steps, run.val_losses) == ([6, 12], [r["val_loss"] for r in evals])
    assert run.final_loss == steps[-1]["loss"]
    best = min(evals, key=lambda r: r["val_loss"])
    assert run.best_val == (best["val_loss"], best["step"])
    rates = sorted(r["tokens_per_s"] for r in steps[1:])  # the first step's warm-up left out
    assert run.median_tokens_per_s == pytest.approx((rates[5] + rates[6]) / 2 if len(rates) % 2 == 0 else rates[5])
    assert run.train_time == pytest.approx(sum(r["dt"] for r in steps))
    tokens_per_step = 8 * 1 * 64  # debug: micro-batch 8, no accumulation, 64 tokens a sequence
    assert run.curve("tokens", 100)[0] == [s * tokens_per_step for s in range(1, 13)]
    times = run.curve("time", 100)[0]
    assert times[-1] == pytest.approx(run.train_time)
    # an evaluation sits at the training time its step had reached
    assert run.val_x("time") == [times[5], times[11]]


def test_a_run_continued_from_an_earlier_step_reads_as_it_stands(runs, tmp_path):
    """A file that holds steps 7-12 twice (a run that went past step 6, then was continued from
    its step-6 checkpoint with another learning rate, its file not cut back): the later rows are
    the run. Stitched from the two real runs' files: lr-high's whole history, then lr-low's from
    step 7."""
    first = (runs / "lr-high" / METRICS).read_text().splitlines()
    again = [line for line in (runs / "lr-low" / METRICS).read_text().splitlines()
             if json.loads(line).get("step", 0) > 6]
    stitched = tmp_path / "stitched"
    stitched.mkdir()
    shutil.copy(runs / "lr-high" / "config.toml", stitched / "config.toml")
    (stitched / METRICS).write_text("\n".join(first + again) + "\n")

    run = load_run(stitched)
    high, low = load_run(runs / "lr-high"), load_run(runs / "lr-low")
    def losses(r):
        return [row.loss for row in r.history.recent()]
    assert [row.step for row in run.history.recent()] == list(range(1, 13))
    assert losses(run) == losses(high)[:6] + losses(low)[6:]
    assert run.val_steps == [6, 12] and run.val_losses == [high.val_losses[0], low.val_losses[1]]
    # the time the run as it stands took: the abandoned steps 7-12 left out
    high_rows, low_rows = read_metrics(runs / "lr-high", "step"), read_metrics(runs / "lr-low", "step")
    assert run.train_time == pytest.approx(sum(r["dt"] for r in high_rows[:6]) + sum(r["dt"] for r in low_rows[6:]))


SCORES = {"python-functions": {"accuracy": 0.3, "centered": 0.1, "items": 111}}
LATER = {"python-functions": {"accuracy": 0.43, "centered": 0.24, "items": 111},
         "arc-easy": {"accuracy": 0.5, "centered": 0.33, "items": 40}}


def scored(runs: Path, where: Path) -> Path:
    """lr-high's folder as a run that scored tasks writes it: a task-only evaluation at step 6
    after its validation, and its step-12 evaluation holding the scores and CORE beside the loss."""
    shutil.copytree(runs / "lr-high", where)
    lines = []
    for line in (runs / "lr-high" / METRICS).read_text().splitlines():
        row = json.loads(line)
        if row["kind"] == "eval" and row["step"] == 12:
            row.update(tasks=LATER, core=0.12)
        lines.append(json.dumps(row))
        if row["kind"] == "eval" and row["step"] == 6:
            lines.append(json.dumps({"kind": "eval", "time": row["time"], "step": 6, "tasks": SCORES}))
    (where / METRICS).write_text("\n".join(lines) + "\n")
    return where


def test_a_run_s_task_scores_read_into_curves_of_their_own(runs, tmp_path):
    run, high = load_run(scored(runs, tmp_path / "scored")), load_run(runs / "lr-high")
    assert (run.val_steps, run.val_losses) == (high.val_steps, high.val_losses)  # a task-only row adds no point
    assert run.tasks == {"python-functions": [(6, 0.3), (12, 0.43)], "arc-easy": [(12, 0.5)]}
    assert run.core == [(12, 0.12)]
    assert run.last_tasks == {"python-functions": 0.43, "arc-easy": 0.5} and run.last_core == 0.12
    assert (high.tasks, high.core, high.last_tasks, high.last_core) == ({}, [], {}, None)
    # continued from step 7: the scores at step 12 were the abandoned run's
    steps = [line for line in (runs / "lr-low" / METRICS).read_text().splitlines() if json.loads(line).get("step") == 7]
    with open(tmp_path / "scored" / METRICS, "a") as fh:
        fh.write(steps[0] + "\n")
    run = load_run(tmp_path / "scored")
    assert run.tasks == {"python-functions": [(6, 0.3)], "arc-easy": []} and run.core == []
    assert run.last_tasks == {"python-functions": 0.3} and run.last_core is None


def test_the_differing_settings_are_exactly_those_that_differ(runs, tmp_path):
    high, low = load_run(runs / "lr-high"), load_run(runs / "lr-low")
    assert differing_settings([high, low]) == ["optimizer.lr"]
    assert (high.config["optimizer.lr"], low.config["optimizer.lr"]) == (0.01, 0.001)
    assert differing_settings([high, load_run(runs / "lr-high")]) == []
    # a key one config lacks (written by another version) differs from any value
    older = tmp_path / "older"
    older.mkdir()
    text = (runs / "lr-high" / "config.toml").read_text()
    (older / "config.toml").write_text("\n".join(line for line in text.splitlines() if not line.startswith("max_nan_skips")))
    assert differing_settings([high, load_run(older)]) == ["training.max_nan_skips"]


def test_a_folder_that_is_not_a_run_is_named_in_the_error(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path}: not a run folder \\(expected config.toml"):
        load_run(tmp_path)
    with pytest.raises(ConfigError, match="nowhere: no such run folder"):
        load_run(tmp_path / "nowhere")


def with_notify(runs: Path, root: Path) -> list[Path]:
    """Copies of lr-high and lr-low whose [notify] sections name other URLs, tokens and all: they
    differ in those as well as in the learning rate."""
    copies = []
    for name, secret in (("lr-high", "SECRET-A"), ("lr-low", "SECRET-B")):
        copy = root / f"{name}-notified"
        shutil.copytree(runs / name, copy, ignore=shutil.ignore_patterns("checkpoints"))
        text = (copy / "config.toml").read_text()
        for blank, value in (('webhook = ""', f'webhook = "https://alice:{secret}-PASS@hooks.example.com/{secret}-HOOK"'),
                             ('ntfy = ""', f'ntfy = "https://ntfy.sh/{secret}-TOPIC"'),
                             ('apprise = []', f'apprise = ["discord://1/{secret}-TOKEN"]')):
            assert text.count(blank) == 1, blank
            text = text.replace(blank, value)
        (copy / "config.toml").write_text(text)
        copies.append(copy)
    return copies


def test_notification_urls_are_no_setting_compared(runs, tmp_path):
    a, b = (load_run(p) for p in with_notify(runs, tmp_path))
    assert differing_settings([a, b]) == ["optimizer.lr"]
    assert not [key for key in a.config if key.startswith("notify.")]


def named_as_the_cockpit_names(runs: Path, root: Path) -> list[Path]:
    """Copies of lr-high, lr-low and lr-high again named as the cockpit names its runs (the preset,
    then the time); the third also trained longer with activation checkpointing, so the settings
    they differ in include the longest key."""
    copies = []
    for n, (name, changes) in enumerate([("lr-high", {}), ("lr-low", {}),
                                         ("lr-high", {"max_steps = 12": "max_steps = 1000",
                                                      "activation_checkpointing = false": "activation_checkpointing = true"})]):
        copy = root / f"gpt2-fineweb-20261123-12{n:02d}00"
        shutil.copytree(runs / name, copy, ignore=shutil.ignore_patterns("checkpoints"))
        text = (copy / "config.toml").read_text()
        for before, after in changes.items():
            assert text.count(before) == 1, before
            text = text.replace(before, after)
        (copy / "config.toml").write_text(text)
        copies.append(copy)
    return copies


# ---------------------------------------------------------------------------- the cockpit
async def test_marking_a_run_leaves_every_run_s_loss_in_view(runs, tmp_path):
    """At 120x40 a marked run's "● " pushed the loss column past the runs table's edge; the loss
    now comes before the status, the column a narrow table cuts."""
    root = tmp_path / "runs"
    copies = named_as_the_cockpit_names(runs, root)
    app = CockpitApp(runs_root=root, telemetry=False)
    async with app.run_test(size=(120, 40)) as pilot:
        launch = app.screen
        table = launch.query_one("#runs")
        table.focus()
        for copy in copies:
            table.move_cursor(row=table.get_row_index(str(copy)))
            await pilot.press("space")
        await pilot.pause()
        shown = shown_in(app, table)
        for copy in copies:
            loss = f"{load_run(copy).final_loss:.3f}"
            assert any(re.search(rf"│ ● {copy.name} +12/\d+ +{re.escape(loss)} ", line) for line in shown), (loss, shown)


@pytest.mark.slow
async def test_marked_runs_open_side_by_side_and_come_back_marked(runs):
    app = CockpitApp(runs_root=runs, telemetry=False)
    async with app.run_test(size=(120, 40)) as pilot:
        launch = app.screen
        assert isinstance(launch, LaunchScreen)
        table = launch.query_one("#runs")
        table.focus()
        await pilot.press("c")  # nothing marked: says what to do, stays
        assert app.screen is launch
        assert any("space on each" in n.message for n in app._notifications)
        for name in ("lr-high", "lr-low"):
            table.move_cursor(row=table.get_row_index(str(runs / name)))
            await pilot.press("space")
        assert launch.marked == [str(runs / "lr-high"), str(runs / "lr-low")]
        launch.refresh_runs()  # what the 2-second refresh does: the marks stay drawn
        await pilot.pause()
        shown = "\n".join(shown_in(app, table))
        assert "● lr-high" in shown and "● lr-low" in shown and "2 marked · c compares" in shown

        await pilot.press("c")  # the runs are read in a thread
        await wait_for(pilot, lambda: isinstance(app.screen, CompareScreen), what="the compare view")
        screen = app.screen
        chart = screen.query_one(CompareChart)

        def drawn() -> str:  # the chart as the terminal shows it
            return "\n".join(shown_in(app, chart))

        await wait_for(pilot, lambda: "loss by step" in drawn(), what="the chart")
        assert chart.error == "" and chart.legend == ["lr-high", "lr-low"]
        assert "lr-high" in drawn() and "lr-low" in drawn()
        compare_table = screen.query_one("#compare-table")
        assert [str(c) for c in compare_table.get_row("optimizer.lr")[1:]] == ["0.01", "0.001"]
        assert "finished" in compare_table.get_row("state")

        await pilot.press("x")
        await wait_for(pilot, lambda: "loss by tokens" in drawn(), what="the tokens axis")
        await pilot.press("x")
        await wait_for(pilot, lambda: "loss by training time" in drawn(), what="the time axis")
        await pilot.press("l")
        await wait_for(pilot, lambda: "(log scale)" in drawn(), what="the log scale")
        assert chart.error == ""

        await pilot.press("escape")
        assert app.screen is launch
        assert launch.marked == [str(runs / "lr-high"), str(runs / "lr-low")]
        table.move_cursor(row=table.get_row_index(str(runs / "lr-low")))
        await pilot.press("space")  # unmarked again
        assert launch.marked == [str(runs / "lr-high")]
        assert "● lr-low" not in "\n".join(shown_in(app, table))


async def test_the_compare_view_keeps_the_chart_big_at_80x24(runs):
    app = CockpitApp(runs_root=runs, telemetry=False)
    async with app.run_test(size=(80, 24)) as pilot:
        launch = app.screen
        launch.marked = [str(runs / "lr-high"), str(runs / "lr-low")]
        await pilot.press("c")
        await wait_for(pilot, lambda: isinstance(app.screen, CompareScreen), what="the compare view")
        screen = app.screen
        await pilot.pause()
        chart, table = screen.query_one(CompareChart), screen.query_one("#compare-table")
        assert chart.size.height >= 12 and chart.error == ""  # at least half of 24 rows
        shown = "\n".join(shown_in(app, table))
        assert "optimizer.lr" in shown and "0.001" in shown
        await pilot.press("q")
        assert app.screen is launch


@pytest.mark.slow
async def test_the_compare_view_never_shows_a_notification_url(runs, tmp_path):
    root = tmp_path / "runs"
    notified = with_notify(runs, root)
    app = CockpitApp(runs_root=root, telemetry=False)
    async with app.run_test(size=(160, 40)) as pilot:
        launch = app.screen
        launch.marked = [str(p) for p in notified]
        await pilot.press("c")
        await wait_for(pilot, lambda: isinstance(app.screen, CompareScreen), what="the compare view")
        await pilot.pause()
        table = app.screen.query_one("#compare-table")
        rows = [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]
        assert rows[0] == ["optimizer.lr", "0.01", "0.001"]
        assert not [row for row in rows if row[0].startswith("notify")]
        assert "SECRET" not in repr(rows) and "SECRET" not in "\n".join(shown_in(app, table))


# ------------------------------------------------------------------------------- the CLI
@pytest.mark.slow
def test_compare_prints_the_differing_setting_and_writes_a_png(runs, tmp_path):
    from matplotlib.image import imread

    out = tmp_path / "out.png"
    proc = cli("compare", str(runs / "lr-high"), str(runs / "lr-low"), "--png", str(out), "--x", "tokens", "--log")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "\tlr-high\tlr-low"
    assert lines[1] == "optimizer.lr\t0.01\t0.001"  # piped: tab-separated, the settings first
    assert any(line.startswith("best val loss\t") for line in lines)
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    height, width, _ = imread(out).shape
    assert (width, height) == (1000, 600)


@pytest.mark.slow
def test_compare_prints_each_task_s_last_score_and_a_dash_where_a_run_has_none(runs, tmp_path):
    plain = cli("compare", str(runs / "lr-high"), str(runs / "lr-low"))
    assert plain.returncode == 0, plain.stderr
    # runs that scored no task: the rows they always had, and no others
    assert [line.split("\t")[0] for line in plain.stdout.splitlines()] == [
        "", "optimizer.lr", "final loss (ema)", "final loss", "best val loss", "tokens/s", "time",
        "  data", "  forward+backward", "  sync", "  optimizer", "  validation", "  checkpoints", "steps", "state"]
    proc = cli("compare", str(scored(runs, tmp_path / "scored")), str(runs / "lr-low"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    rows = [line.split("\t")[0] for line in lines]
    added = ["python-functions accuracy", "arc-easy accuracy", "CORE"]
    assert rows[rows.index("best val loss") + 1:rows.index("tokens/s")] == added
    assert f"python-functions accuracy\t0.430\t{DASH}" in lines
    assert f"arc-easy accuracy\t0.500\t{DASH}" in lines and f"CORE\t0.120\t{DASH}" in lines
    # the rest as plain's: the task rows are all that was added
    assert [line for line in lines if line.split("\t")[0] not in added] == [
        line.replace("lr-high", "scored") for line in plain.stdout.splitlines()]


def test_a_fine_tuning_run_and_its_base_share_the_task_line_with_the_gain_and_say_where_it_came_from(tmp_path):
    """compare BASE FINETUNED: the fine-tuning run's step-0 score (its base's weights) and its last,
    with the gain; the base, never scored on that task itself, shows that step-0 score as its own;
    and a row naming the base run and step."""
    from lmcockpit.core.run.curves import RunCurves
    from lmcockpit.tui.rows import result_rows

    base = RunCurves(tmp_path / "cpu-1", "cpu-1", {"training.from_checkpoint": ""}, 4096, "finished")
    base.history.add_eval(300, 4.0, tasks={"python-functions": {"accuracy": 0.43}})
    tuned = RunCurves(tmp_path / "chat-1", "chat-1", {"training.from_checkpoint": str(tmp_path / "cpu-1" / "checkpoints"
                                                      / "step_000300"), "training.from_step": 300}, 4096, "finished")
    for step, accuracy in ((0, 0.25), (40, 0.3), (120, 0.375)):
        tuned.history.add_eval(step, 3.0, tasks={"python-functions-chat": {"accuracy": accuracy}})
    rows = dict(result_rows([base, tuned]))
    assert rows["fine-tuned from"] == [DASH, "cpu-1 at step 300"]
    assert rows["python-functions-chat accuracy"] == ["0.250 (step 0 of chat-1)", "0.250 → 0.375 (+0.125)"]
    assert rows["python-functions accuracy"] == ["0.430", DASH]
    assert list(rows)[0] == "fine-tuned from"
    assert "fine-tuned from" not in dict(result_rows([base, base]))  # runs that start from nothing: no such row


def test_compare_puts_where_each_run_s_time_went_side_by_side(runs, tmp_path):
    """A share of each run's time per part of a step and per kind of work between steps; a dash
    for a run from before steps said them (its rows without parts)."""
    old = tmp_path / "old"
    shutil.copytree(runs / "lr-low", old)
    rows = [json.loads(line) for line in (old / METRICS).read_text().splitlines()]
    for row in rows:
        row.pop("parts", None), row.pop("between", None)
    (old / METRICS).write_text("".join(json.dumps(row) + "\n" for row in rows))
    (old / "history.json").unlink(missing_ok=True)
    proc = cli("compare", str(runs / "lr-high"), str(old))
    assert proc.returncode == 0, proc.stderr
    cells = {line.split("\t")[0]: line.split("\t")[1:] for line in proc.stdout.splitlines()}
    named = ["  data", "  forward+backward", "  sync", "  optimizer", "  validation", "  checkpoints"]
    assert [what for what in cells if what.startswith("  ")] == named
    shares = [float(cells[what][0].rstrip("%").lstrip("<")) for what in named]
    assert all(cells[what][1] == DASH for what in named)
    assert 90 <= sum(shares) <= 110  # each rounded; together the run's whole time
    assert max(named, key=lambda what: float(cells[what][0].rstrip("%").lstrip("<"))) == "  forward+backward"


@pytest.mark.slow
def test_compare_on_an_80_column_terminal_keeps_each_setting_s_name_whole(runs, tmp_path, terminal):
    """Three runs side by side at 80 columns broke the settings' names mid-word (`training.max_s`
    over `teps`): each name is now on one line, whole, and the runs' columns share the rest."""
    copies = named_as_the_cockpit_names(runs, tmp_path)
    code, out = terminal("compare", *map(str, copies), size=(80, 24)).end()
    assert code == 0, out
    lines = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line).rstrip() for line in out.splitlines()]
    for key in ("optimizer.lr", "training.max_steps", "training.activation_checkpointing", "final loss (ema)",
                "best val loss"):
        assert any(re.match(rf" {re.escape(key)}  ", line) for line in lines), (key, lines)
    assert all(len(line) <= 80 for line in lines)


@pytest.mark.slow
def test_compare_never_prints_a_notification_url(runs, tmp_path):
    proc = cli("compare", *map(str, with_notify(runs, tmp_path)))
    assert proc.returncode == 0, proc.stderr
    assert [line.split("\t")[0] for line in proc.stdout.splitlines()][:3] == ["", "optimizer.lr", "final loss (ema)"]
    assert "SECRET" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_compare_refuses_a_missing_folder_and_a_single_run(runs, tmp_path):
    proc = cli("compare", str(runs / "lr-high"), str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and f"{tmp_path / 'nowhere'}: no such run folder" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    proc = cli("compare", str(runs / "lr-high"))
    assert proc.returncode == 2 and "two or more run folders" in proc.stderr


@pytest.mark.slow
def test_compare_png_without_matplotlib_says_what_to_install(runs, tmp_path):
    stub = tmp_path / "stub" / "matplotlib"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    out = tmp_path / "out.png"
    proc = cli("compare", str(runs / "lr-high"), str(runs / "lr-low"), "--png", str(out),
               env={"PYTHONPATH": str(stub.parent)})
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'lmcockpit[plot]'" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


# ---------------------------------------------------------------- a baseline on the live chart
@pytest.mark.slow
async def test_b_draws_a_finished_run_under_the_live_curves_and_takes_it_away(runs):
    """On a live dashboard, b lists the finished runs; the one picked is drawn under the live
    curves (its smoothed loss and validation points), and b again offers to remove it."""
    from textual.widgets import OptionList

    from lmcockpit.tui.screens.dialogs import BaselinePicker
    from lmcockpit.tui.widgets.charts import LossChart

    from .helpers import FedDashboard

    app = FedDashboard()
    app.runs_root = runs
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        dash = app.screen
        chart = dash.query_one("#loss", LossChart)
        await pilot.press("b")
        picker = app.screen
        assert isinstance(picker, BaselinePicker)
        options = picker.query_one(OptionList)
        ids = [options.get_option_at_index(i).id for i in range(options.option_count)]
        assert sorted(Path(i).name for i in ids) == ["lr-high", "lr-low"]  # no "no baseline" yet
        options.highlighted = ids.index(str(runs / "lr-low"))
        await pilot.press("enter")
        await wait_for(pilot, lambda: chart.baseline is not None, what="the baseline to load")
        low = load_run(runs / "lr-low")
        drawn = chart.baseline.history.recent()
        assert chart.baseline.name == "lr-low" and [r.step for r in drawn] == list(range(1, 13))
        assert [r.ema for r in drawn] == ema([r.loss for r in low.history.recent()])
        assert chart.baseline.history.evals == low.history.evals
        await pilot.pause()
        shown = chart.render().plain
        assert "base lr-low" in shown and "ema" in shown and chart.error == ""
        await pilot.press("l")  # log scale takes the baseline's values into its range too
        await pilot.pause()
        assert chart.error == "" and "log scale" in chart.render().plain
        await pilot.press("b")
        options = app.screen.query_one(OptionList)
        assert options.get_option_at_index(0).id == ""  # "no baseline" comes first
        options.highlighted = 0
        await pilot.press("enter")
        await pilot.pause()
        assert chart.baseline is None and "base" not in chart.render().plain

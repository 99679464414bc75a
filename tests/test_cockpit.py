"""The cockpit through `App.run_test()` and Pilot, against the real engine process."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.run.folder import latest_checkpoint, read_metrics
from lmcockpit.tui.app import CockpitApp
from lmcockpit.tui.screens.dashboard import DashboardScreen
from lmcockpit.tui.screens.dialogs import AbortDialog
from lmcockpit.tui.screens.launch import COUNTING, LaunchScreen

from .helpers import (
    SHRINK_CPU, TINY, budget_counted, cli, dashboard, request, screen_lines, shown_in, shrunk_cpu, wait_for,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def screen_text(renderable) -> str:
    from rich.console import Console

    console = Console(width=120, record=True, file=open("/dev/null", "w"))
    console.print(renderable)
    return console.export_text()


def footer_keys(app) -> str:
    return screen_lines(app)[-1]


async def prepared(app, pilot) -> None:
    """Until the run launched or resumed is checked and started, or refused (app.preparing, a
    thread: the checks may fetch from the Hub)."""
    await app.preparing.wait()
    await pilot.pause()


@contextlib.asynccontextmanager
async def training_cockpit(tmp_path: Path, size=(120, 40), *extra: str):
    """The cockpit on a long shrunk-cpu run, yielded once training is under way: (app, pilot, dashboard)."""
    app = CockpitApp(request(tmp_path, "training.max_steps=100000", *extra), telemetry=False)
    try:
        async with app.run_test(size=size) as pilot:
            dash = dashboard(app)
            await wait_for(pilot, lambda: dash.view.step >= 2, what="training to start")
            yield app, pilot, dash
    finally:
        app.stop_runs(timeout=60)  # leaving the cockpit leaves a run training: the test's must stop


@pytest.mark.slow
async def test_pause_checkpoint_resume(tmp_path):
    # checkpoint.every=0: a slow machine's run passes step 150 before the abort, and its
    # periodic checkpoint is not the one this test looks for
    async with training_cockpit(tmp_path, (120, 40), "checkpoint.every=0") as (app, pilot, dash):
        await pilot.press("p")
        await wait_for(pilot, lambda: dash.view.state == P.PAUSED, what="paused")
        paused_at = dash.view.step
        await pilot.press("c")  # a command answered while paused proves the engine is listening
        ckpt = tmp_path / "run" / "checkpoints" / f"step_{paused_at:06d}"
        await wait_for(pilot, ckpt.is_dir, what="checkpoint folder")
        assert dash.view.step == paused_at, "the step counter moved while paused"
        await pilot.press("p")
        await wait_for(pilot, lambda: dash.view.step >= paused_at + 2, what="steps after resume")
        assert dash.view.state == P.RUNNING
        await pilot.press("a")
        assert isinstance(app.screen, AbortDialog)
        await pilot.press("escape")  # Esc cancels: it runs on
        assert app.screen is dash
        step = dash.view.step
        await wait_for(pilot, lambda: dash.view.step >= step + 2, what="steps after cancelled abort")
        await pilot.press("a")
        assert isinstance(app.screen, AbortDialog)
        await pilot.press("d")  # d: stop without saving
        assert app.screen is dash
        await wait_for(pilot, lambda: dash.view.state == P.ABORTED, what="the run to end as aborted")
        dash.engine.join(timeout=30)
        assert not dash.engine.host_alive and dash.engine.exitcode == 0
        assert dash.view.step >= paused_at + 4
        # the checkpoint asked for with c is still the only one: the stop wrote none
        checkpoints = tmp_path / "run" / "checkpoints"
        assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", f"step_{paused_at:06d}"]
        assert [r["step"] for r in read_metrics(tmp_path / "run", "checkpoint")] == [paused_at]


def test_paused_holds_through_a_checkpoint_or_evaluation_taken_while_paused():
    """"p" must resume a run paused then asked for a checkpoint, whatever state it reports meanwhile."""
    from lmcockpit.core.run.state import RunState

    view = RunState()
    for state, paused in [(P.RUNNING, False), (P.PAUSED, True), (P.CHECKPOINTING, True), (P.EVALUATING, True),
                          (P.PAUSED, True), (P.RUNNING, False), (P.CHECKPOINTING, False), (P.PAUSED, True),
                          (P.INTERRUPTED, False)]:
        view.apply(P.StateChanged(state))
        assert view.paused is paused, state


@pytest.mark.slow
async def test_quit_with_a_run_going_asks_then_stops_it_with_a_checkpoint(tmp_path):
    async with training_cockpit(tmp_path, (80, 24)) as (app, pilot, dash):
        await pilot.press("q")
        assert app.screen.__class__.__name__ == "QuitDialog"
        await pilot.press("escape")  # stay
        assert app.screen is dash and dash.running
        await pilot.press("q")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.is_running, what="the app to exit")
    dash.engine.join(timeout=30)
    assert dash.engine.exitcode == 0
    assert latest_checkpoint(tmp_path / "run") is not None


@pytest.mark.slow
async def test_a_failing_engine_shows_the_failure_panel_and_the_cockpit_stays_usable(tmp_path):
    app = CockpitApp(request(tmp_path, "optimizer.lr=1e30", "optimizer.muon_lr=1e30", "training.grad_clip=0"),
                     telemetry=False)
    async with app.run_test(size=(120, 40)) as pilot:
        dash = dashboard(app)
        await wait_for(pilot, lambda: dash.has_class("failed"), what="failure panel")
        text = str(dash.query_one("#failure").render())
        assert "RUN FAILED" in text and "non-finite" in text and str(tmp_path / "run") in text
        assert dash.query_one("#failure").display
        await pilot.press("question_mark")  # still usable: help opens and closes
        assert app.screen.__class__.__name__ == "HelpScreen"
        await pilot.press("escape")
        assert app.screen is dash
        await pilot.press("q")  # nothing running: q quits at once
    assert app.return_code == 0


@pytest.mark.slow
async def test_launch_screen_selects_edits_validates_and_saves(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = CockpitApp(runs_root=tmp_path / "runs", telemetry=False)
    async with app.run_test(size=(120, 40)) as pilot:
        launch = app.screen
        assert isinstance(launch, LaunchScreen)
        presets = launch.query_one("#presets")
        assert [r.value for r in presets.rows][:2] == ["debug", "cpu"]  # smallest first
        assert launch.preset_name == "cpu"  # the embedded default is selected
        await pilot.press("up")
        assert launch.preset_name == "debug"
        settings = launch.query_one("#settings")
        settings.focus()
        row = [r.value for r in settings.rows].index("training.max_steps")
        settings.move_cursor(row=row)
        await pilot.press("e")
        edit = launch.query_one("#edit")
        status = launch.query_one("#edit-status")
        edit.value = "-3"
        await pilot.pause()
        assert "must be a positive integer" in str(status.render()) and edit.has_class("invalid")
        await pilot.press("enter")  # refused: nothing applied
        assert "training.max_steps" not in launch.overrides
        edit.value = "4"
        await pilot.pause()
        assert "valid" in str(status.render())
        await pilot.press("enter")
        assert launch.overrides == {"training.max_steps": "4"}
        await pilot.press("s")
        launch.query_one("#saveas").value = str(tmp_path / "mine.toml")
        await pilot.press("enter")
        await pilot.pause()
    saved = tmp_path / "mine.toml"
    assert "max_steps = 4" in saved.read_text()
    proc = cli("--run", str(saved), "--set", "training.log_every=1", "--out", str(tmp_path / "fromsaved"))
    assert proc.returncode == 0, proc.stderr
    assert "step 4/4" in proc.stdout


def preset_line(name: str, params: str, memory: str, verdict: str) -> re.Pattern:
    """A presets row as shown: the columns a preset is picked by, whole and in this order."""
    return re.compile(rf"│ {re.escape(name)} +{re.escape(params)} +{re.escape(memory)} +{re.escape(verdict)}( |$)")


@pytest.mark.slow
@pytest.mark.parametrize("size", [(80, 24), (100, 30), (120, 40), (170, 45)], ids=lambda s: f"{s[0]}x{s[1]}")
async def test_the_launch_screen_shows_every_presets_fit_and_the_settings_values(tmp_path, size):
    """At 80 columns the settings showed only their keys and the presets stopped at "tok…"; at
    120 the fit column was cut. What is asserted is what the screen shows inside each table."""
    from lmcockpit.tui.rows import preset_rows
    from lmcockpit.tui.screens.launch import flatten

    app = CockpitApp(runs_root=tmp_path / "runs", telemetry=False)
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        launch = app.screen
        presets, settings, runs = (launch.query_one(f"#{name}") for name in ("presets", "settings", "runs"))
        shown = shown_in(app, presets)
        # the fit column shows at its full width, the longest verdict ("does not fit") included
        assert re.search(r" fit {9,}", shown[1]), shown[1]
        chosen = launch.preset_name
        for i, (name, _, params, _, memory, verdict) in enumerate(preset_rows(None)):
            presets.move_cursor(row=i)  # at 24 rows they scroll, the runs keeping a row: each in view when chosen
            await pilot.pause()
            shown = shown_in(app, presets)
            assert any(preset_line(name, params, memory, verdict).search(line) for line in shown), (name, shown)
        presets.move_cursor(row=presets.get_row_index(chosen))  # back to the one chosen
        await pilot.pause()

        values = dict(flatten(launch.current_config()))
        settings.focus()
        for key in ["model.n_layer", "training.activation_checkpointing", "optimizer.lr", "optimizer.kind"]:  # the longest key too
            settings.move_cursor(row=settings.get_row_index(key))
            await pilot.pause()
            assert any(re.search(rf"│ {re.escape(key)} +{re.escape(values[key])} ", line)
                       for line in shown_in(app, settings)), (key, shown_in(app, settings))
        # on a short screen the presets give the focused settings the height, the selected preset still in view
        shown = shown_in(app, presets)
        assert any(preset_line("cpu", "6.0M", "0.5 GiB RAM", "–").search(line) for line in shown), shown
        assert len(shown_in(app, settings)) >= 8

        await pilot.press("tab")  # the recent runs: reached with Tab, with room to show some
        assert app.focused is runs
        await pilot.pause()
        assert runs.region.height >= 5 and "run  step  loss  status" in shown_in(app, runs)[1]
        assert runs.region.bottom <= app.screen.region.bottom - 1  # above the footer
        assert "Resume" in footer_keys(app) and "Quit" in footer_keys(app)


@pytest.mark.parametrize("size", [(120, 40), (170, 45)], ids=lambda s: f"{s[0]}x{s[1]}")
async def test_the_launch_screen_shows_every_preset_column_from_120_columns(tmp_path, size):
    """At 120x40 the presets lost their tokens/step and GPU class (the settings beside them took
    the width): each row now shows every column, whole, with the settings' values still beside
    their keys."""
    from lmcockpit.tui.rows import preset_rows
    from lmcockpit.tui.screens.launch import flatten

    app = CockpitApp(runs_root=tmp_path / "runs", telemetry=False)
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        launch = app.screen
        shown = shown_in(app, launch.query_one("#presets"))
        assert re.search(r"│ preset +params +est\. memory +fit +tokens/step +GPU class ", shown[1]), shown[1]
        for name, gpu_class, params, tokens, memory, verdict in preset_rows(None):
            cells = [name, params, memory, verdict, tokens, gpu_class]
            assert any(re.search(r"│ " + " +".join(map(re.escape, cells)) + "( |$)", line) for line in shown), (name, shown)
        settings = launch.query_one("#settings")
        values = dict(flatten(launch.current_config()))
        key = "training.activation_checkpointing"  # the longest key
        settings.move_cursor(row=settings.get_row_index(key))
        await pilot.pause()
        assert any(re.search(rf"│ {key} +{values[key]} ", line) for line in shown_in(app, settings))


@pytest.mark.slow
async def test_the_launch_screen_shows_each_mixture_part_s_tokens_and_epochs(tmp_path, monkeypatch):
    """A mixture typed in for data.sources at 80×24: a row per part under it (its share, train
    tokens and epochs), every part's epochs on the settings' border; `e` on a part edits them all."""
    from lmcockpit.core.data import budget

    from .helpers import records, write_jsonl

    monkeypatch.chdir(tmp_path)
    apples = write_jsonl(tmp_path / "apples.jsonl", records(600, seed=1))
    zebras = write_jsonl(tmp_path / "zebras.jsonl", records(150, seed=2))  # a quarter of the text, 3x the weight
    mixture = f'[{{source="{apples}", weight=1}}, {{source="{zebras}", weight=3}}]'
    app = CockpitApp(runs_root=tmp_path / "runs", telemetry=False)
    async with app.run_test(size=(80, 24)) as pilot:
        launch = app.screen
        settings = launch.query_one("#settings")
        settings.focus()
        settings.move_cursor(row=settings.get_row_index("data.sources"))
        await pilot.press("e")
        launch.query_one("#edit").value = mixture
        await pilot.press("enter")
        await budget_counted(launch)
        await pilot.pause()

        parts = budget.parts(launch.current_config())
        epochs = [p.budget.epoch_figure() for p in parts]
        assert parts[1].budget.epochs > 10 * parts[0].budget.epochs  # 4x less text, 3x the draws
        shown = shown_in(app, settings)
        for part, name, share in zip(parts, ("apples.jsonl", "zebras.jsonl"), ("25%", "75%")):
            row = rf"│  └ {name} +{share}: {re.escape(part.budget.epoch_figure())} epochs of "
            assert any(re.search(row + rf"≈{re.escape(budget._count(part.budget.source_tokens))} tokens ", line)
                       for line in shown), "\n".join(shown)
        assert f" epochs by part: {epochs[0]}, {epochs[1]} · " in shown[-1], shown[-1]

        await pilot.press("down", "e")  # on apples' row: the edit is data.sources, the whole list
        assert launch.editing == "data.sources" and "zebras.jsonl" in launch.query_one("#edit").value


async def test_the_launch_screen_draws_and_counts_its_settings_once_at_start_up(tmp_path, monkeypatch):
    """The presets table's first rows highlight row 0 before the cursor goes to the default, and
    those events arrive after it: taken at their word, they switched the settings to `debug` and
    back, and counted the source three times at start-up, in three threads at once."""
    drawn = []
    draw = LaunchScreen.show_settings
    monkeypatch.setattr(LaunchScreen, "show_settings", lambda self: (drawn.append(self.preset_name), draw(self)))
    app = CockpitApp(runs_root=tmp_path / "runs", telemetry=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await budget_counted(app.screen)
        await pilot.pause()
        assert drawn == ["cpu"]
        await pilot.press("up")  # a real move still switches
        assert drawn == ["cpu", "debug"] and app.screen.preset_name == "debug"


async def test_the_launch_screen_counts_a_source_s_tokens_in_a_thread_and_shows_the_latest(tmp_path, monkeypatch):
    """A source is listed and its text estimated off the UI thread (a folder of 100k files takes
    seconds): the settings are there at once, the border says the count is coming; a change of
    source before it lands shows the new source's count, never the one it replaced."""
    from lmcockpit.core.data import budget

    from .helpers import records, write_jsonl

    monkeypatch.chdir(tmp_path)
    small = write_jsonl(tmp_path / "small.jsonl", records(50, seed=1))
    large = write_jsonl(tmp_path / "large.jsonl", records(900, seed=2))
    app = CockpitApp(runs_root=tmp_path / "runs", telemetry=False)
    async with app.run_test(size=(120, 40)) as pilot:
        launch = app.screen
        await budget_counted(launch)
        settings = launch.query_one("#settings")
        assert settings.border_subtitle == budget.estimate(launch.current_config()).short()
        launch.overrides = {"data.source": f'"{small}"'}
        launch.show_settings()
        replaced = launch.shown
        assert settings.border_subtitle == COUNTING  # nothing waited for the count ...
        assert str(settings.get_row("data.source")[1]) == f'"{small}"'  # ... to show the settings
        launch.overrides = {"data.source": f'"{large}"'}
        launch.show_settings()
        await budget_counted(launch)
        await pilot.pause()
        counts = {path: budget.estimate(launch.current_config({"data.source": f'"{path}"'})).short()
                  for path in (small, large)}
        assert counts[small] != counts[large]
        assert counts[large] in settings.border_subtitle  # in yellow: past MANY_EPOCHS
        assert counts[large] in shown_in(app, settings)[-1]
        launch.show_budget(replaced, budget.parts(replaced))  # its count, landing late: dropped
        assert counts[large] in settings.border_subtitle
        launch.show_budget(launch.shown, RuntimeError("a defect in the count"))  # said; the screen goes on
        await pilot.pause()
        assert "the token count failed" in settings.border_subtitle
        await pilot.press("up")
        assert launch.preset_name == "debug"


@pytest.mark.slow
async def test_after_a_run_ends_n_goes_back_to_the_launch_screen_which_lists_it(tmp_path):
    """The run's controls leave the footer when it ends, n takes their place and returns to the
    launch screen it was launched from, whose recent runs now hold it; q still quits."""
    app = CockpitApp(runs_root=tmp_path / "runs", telemetry=False)
    async with app.run_test(size=(80, 24)) as pilot:
        launch = app.screen
        assert isinstance(launch, LaunchScreen)
        # as if typed in with e, in an order each stays valid in
        launch.overrides = dict(s.split("=", 1) for s in [*SHRINK_CPU, *TINY, "training.compile=false",
                                                           "eval.every=0", "training.max_steps=100000"])
        launch.show_settings()
        await pilot.press("enter")  # the presets have the focus: Enter launches
        await prepared(app, pilot)
        dash = dashboard(app)
        await wait_for(pilot, lambda: dash.view.step >= 2, what="training to start")
        keys = footer_keys(app)
        assert "Pause" in keys and "Abort" in keys and "Back" not in keys
        await pilot.press("n")  # nothing while it runs
        assert app.screen is dash
        await pilot.press("a")
        assert isinstance(app.screen, AbortDialog)
        await pilot.press("enter")  # Enter: checkpoint, then stop
        await wait_for(pilot, lambda: dash.view.state == P.ABORTED, what="the run to end as aborted")
        last = latest_checkpoint(dash.engine.run_dir)
        assert last is not None and last.name == f"step_{dash.view.step:06d}"
        await pilot.pause()
        keys = footer_keys(app)
        assert "n New run" in keys and "q Quit" in keys, keys
        assert not {"Pause", "Checkpoint", "Abort"} & set(keys.split()), keys
        await pilot.press("n")
        assert app.screen is launch
        await pilot.pause()
        run_dir = dash.engine.run_dir
        assert run_dir.parent == tmp_path / "runs"
        runs = launch.query_one("#runs")
        assert [row.value for row in runs.rows] == [str(run_dir)]
        # as the dashboard said; the host may still be closing (its live row, refreshed every 2 s)
        await wait_for(pilot, lambda: any(run_dir.name in line and "aborted" in line for line in shown_in(app, runs)),
                       what="the run listed as aborted")
        await pilot.press("q")
    assert app.return_code == 0
    dash.engine.join(timeout=30)
    assert dash.engine.exitcode == 0


@pytest.mark.slow
async def test_n_takes_the_run_s_notice_away_with_its_dashboard(tmp_path):
    """A finished run's notice ("run finished at step N: n goes back…") stayed over the launch
    screen's runs for its ten seconds after n had gone back there."""
    from .helpers import fixed_events

    app = CockpitApp(runs_root=tmp_path / "runs", telemetry=False)
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        launch = app.screen
        dash = DashboardScreen(None, "cpu", clock=lambda: 1000.0)
        await app.push_screen(dash)
        dash.apply_events([*fixed_events(), P.StateChanged(P.FINISHED)])
        await pilot.pause()
        assert [n.message for n in app._notifications] == ["run finished at step 240: n goes back to the launch screen"]
        await wait_for(pilot, lambda: any("run finished at step 240" in line for line in screen_lines(app)),
                       timeout=10, what="the notice on screen")
        await pilot.press("n")
        await pilot.pause()
        assert app.screen is launch and not app._notifications
        assert not any("run finished" in line for line in screen_lines(app))


async def test_ctrl_c_on_the_launch_screen_quits():
    """Ctrl-C showed Textual's "Press ctrl+q to quit the app"; it quits, as q does."""
    app = CockpitApp(telemetry=False)
    async with app.run_test(size=(80, 24)) as pilot:
        assert isinstance(app.screen, LaunchScreen)
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert not app.is_running and not app._notifications
    assert app.return_code == 0


@pytest.mark.slow
async def test_ctrl_c_with_a_run_going_asks_as_q_does(tmp_path):
    """From the dashboard, or a dialog over it: the quit dialog (Enter stops the run, d leaves
    it training); a second Ctrl-C while it asks changes nothing."""
    from lmcockpit.tui.screens.dialogs import HelpScreen, QuitDialog

    async with training_cockpit(tmp_path, (80, 24)) as (app, pilot, dash):
        await pilot.press("ctrl+c")
        assert isinstance(app.screen, QuitDialog)
        await pilot.press("ctrl+c")
        assert isinstance(app.screen, QuitDialog) and len(app.screen_stack) == 3
        await pilot.press("escape")  # stay
        assert app.screen is dash and dash.running
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("ctrl+c")
        assert isinstance(app.screen, QuitDialog) and not app._notifications
        await pilot.press("d")  # leave it training and quit
        await wait_for(pilot, lambda: not app.is_running, what="the app to exit")
        assert dash.engine.host_alive  # left training: the fixture stops it


@pytest.mark.slow
def test_started_on_a_run_n_opens_the_launch_screen_and_the_exit_prints_the_run_folder(tmp_path, capsys):
    """`lmcockpit PRESET`: when the run ends, n puts a launch screen in the dashboard's place
    (listing the run, though its folder is not under runs/); after q the terminal gets the folder."""
    app = CockpitApp(request(tmp_path, "training.max_steps=3"), runs_root=tmp_path / "runs", telemetry=False)
    seen: dict[str, object] = {}

    async def user(pilot) -> None:
        dash = dashboard(app)
        await wait_for(pilot, lambda: dash.view.state == P.FINISHED, what="the run to finish")
        await pilot.pause()
        seen["footer"] = footer_keys(app)
        await pilot.press("n")
        await pilot.pause()
        seen["screens"] = [type(s).__name__ for s in app.screen_stack]
        seen["runs"] = [row.value for row in app.screen.query_one("#runs").rows]
        await pilot.press("q")

    app.run(headless=True, size=(80, 24), auto_pilot=user)
    app.stop_runs(timeout=30)
    assert "n New run" in seen["footer"], seen
    assert seen["screens"][1:] == ["LaunchScreen"], seen  # the dashboard closed, not left under it
    assert seen["runs"] == [str(tmp_path / "run")]
    assert f"run folder: {tmp_path / 'run'} (finished at step 3)" in capsys.readouterr().out


@pytest.mark.slow
def test_starting_the_cockpit_never_imports_torch(tmp_path):
    """The front-end process stays torch-free even while a run is training under it."""
    script = f"""
import asyncio, sys, time
from lmcockpit.core.config import load_config
from lmcockpit.core.run.folder import create_run_dir
from lmcockpit.tui.app import CockpitApp
from lmcockpit.tui.runplan import RunPlan
from tests.helpers import shrunk_cpu

cfg = shrunk_cpu("training.max_steps=4")
req = RunPlan(cfg, create_run_dir(cfg, "cpu", {str(tmp_path / 'run')!r}), None, "cpu")

async def main():
    app = CockpitApp(req, telemetry=True)
    async with app.run_test(size=(80, 24)) as pilot:
        deadline = time.monotonic() + 120
        # the end as the screen applied it: every step's event before it applied too (engine.done
        # turns true when the front-end reads the end, maybe before the screen took the last steps)
        while not app.screen.ended and time.monotonic() < deadline:
            await pilot.pause(0.05)
        print("steps", app.screen.view.step)
    print("torch imported:", "torch" in sys.modules)
asyncio.run(main())
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                          cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps 4" in proc.stdout
    assert "torch imported: False" in proc.stdout


@pytest.mark.slow
async def test_chat_pane_samples_the_live_model_while_it_trains(tmp_path):
    from lmcockpit.tui.widgets.chat_pane import ChatPane

    async with training_cockpit(tmp_path, (120, 40)) as (app, pilot, dash):
        await pilot.press("t")
        pane = dash.query_one(ChatPane)
        assert pane.display and app.focused.id == "chat-input"
        await pilot.press(*"/set top_p 2", "enter")  # refused, settings unchanged
        assert pane.settings["top_p"] == 1.0
        await pilot.press(*"/set num_samples 2", "enter")
        assert pane.settings["num_samples"] == 2
        await pilot.press(*"def ", "enter")
        await wait_for(pilot, lambda: pane.history and all(e.done for e in pane.history.values()), what="the samples")
        (exchange,) = pane.history.values()
        assert exchange.prompt == "def " and sorted(exchange.rows) == [0, 1] and exchange.step >= 2
        shown = screen_text(pane.query_one("#chat-output").content)
        assert "» def" in shown and "[2]" in shown
        step = dash.view.step
        await wait_for(pilot, lambda: dash.view.step > step, what="training to go on after sampling")


@pytest.mark.slow
async def test_launch_screen_opens_a_past_run_in_chat(trained_run, monkeypatch):
    """`o` opens the run in chat; `/greedy` and `/set temperature` change what the chat engine
    samples: each answer is the text this process computes from the same checkpoint with the
    settings the pane should have sent (the run's [sample] ones: 16 new tokens, temperature
    0.8, top-k 50; the seed counting up from 0 with each request)."""
    from lmcockpit.core.infer.load import load
    from lmcockpit.core.run.checkpoint_folder import find_checkpoint
    from lmcockpit.tui.screens.checkpoint_chat import ChatScreen
    from lmcockpit.tui.widgets.chat_pane import ChatPane

    run, _ = trained_run
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the chat engine samples on the CPU, as this process does
    loaded = load(find_checkpoint(str(run)), "cpu")

    def expected(**settings) -> str:
        [text] = loaded.answer(P.Sample("x", "import", max_new_tokens=16, **settings), lambda e: None, print)
        return text

    app = CockpitApp(runs_root=run.parent, telemetry=False)
    async with app.run_test(size=(100, 30)) as pilot:
        launch = app.screen
        launch.query_one("#runs").focus()
        await pilot.press("o")
        chat = app.screen
        assert isinstance(chat, ChatScreen)
        await wait_for(pilot, lambda: chat.engine.loaded is not None, what="the checkpoint to load")
        assert chat.engine.loaded.start_step == 12
        pane = chat.query_one(ChatPane)

        async def answer(*keys: str) -> str:
            asked = len(pane.history)
            await pilot.press(*keys, "enter")
            await wait_for(pilot, lambda: len(pane.history) > asked and all(e.done for e in pane.history.values()),
                           what="a sample")
            return list(pane.history.values())[-1].rows[0]

        greedy = expected(greedy=True)
        sampled = expected(temperature=2.0, top_k=0, seed=2)
        assert sampled != greedy and sampled != expected(top_k=0, seed=2)  # so the answers below can tell
        assert await answer(*"/greedy import") == greedy
        await pilot.press(*"/set temperature 0", "enter")  # 0: greedy
        assert await answer(*"import") == greedy
        await pilot.press(*"/set temperature 2", "enter", *"/set top_k 0", "enter")
        assert await answer(*"import") == sampled
        await pilot.press("escape")
        assert app.screen is launch
        # the screen's closer thread reaps the process; a second join here could race it
        await wait_for(pilot, lambda: chat.engine.process.exitcode is not None, what="the chat engine to exit")
        assert chat.engine.process.exitcode == 0


@pytest.mark.slow
async def test_r_on_the_launch_screen_resumes_a_stopped_run_in_place(trained_run, tmp_path):
    """r continues the selected run from its latest checkpoint, in its own folder, on a dashboard;
    a run already at its step budget is refused with the reason, and nothing starts."""
    import shutil

    run, _ = trained_run
    runs = tmp_path / "runs"
    finished, stopped = runs / "finished", runs / "stopped"
    shutil.copytree(run, finished)
    shutil.copytree(run, stopped)
    shutil.rmtree(stopped / "checkpoints" / "step_000012")  # as if it had stopped before its last checkpoint
    app = CockpitApp(runs_root=runs, telemetry=False)
    async with app.run_test(size=(120, 40)) as pilot:
        launch = app.screen
        table = launch.query_one("#runs")
        table.focus()
        table.move_cursor(row=table.get_row_index(str(finished)))
        await pilot.press("r")
        await prepared(app, pilot)
        assert app.screen is launch and not app.engines
        assert any("training.max_steps is 12" in n.message for n in app._notifications)
        table.move_cursor(row=table.get_row_index(str(stopped)))
        await pilot.press("r")
        await prepared(app, pilot)
        dash = dashboard(app)
        await wait_for(pilot, lambda: dash.view.state in P.TERMINAL_STATES, timeout=180, what="the run to end")
        assert dash.view.state == P.FINISHED, dash.engine.failure
        # The whole run's curve: steps 1-6 from its folder's metrics, 7-12 trained now.
        assert dash.view.start_step == 6 and [r.step for r in dash.view.history.recent()] == list(range(1, 13))
        dash.engine.join(timeout=30)
        assert dash.engine.exitcode == 0 and dash.engine.run_dir == stopped
    assert [r["step"] for r in read_metrics(stopped, "step")] == list(range(1, 13))
    assert latest_checkpoint(stopped).name == "step_000012"


async def test_launching_several_machines_from_the_cockpit_says_what_is_missing(tmp_path):
    """The launch screen has no rendezvous endpoint to give: the run is refused with a notice,
    before any run folder or engine exists."""
    app = CockpitApp(runs_root=tmp_path / "runs", telemetry=False)
    async with app.run_test() as pilot:
        app.new_run(shrunk_cpu("distributed.nnodes=2"), "cpu")
        await prepared(app, pilot)
        assert not app.engines and not (tmp_path / "runs").exists()
        assert any("--rdzv-endpoint" in n.message for n in app._notifications)


@pytest.mark.slow
async def test_a_cuda_graph_mode_launches_from_the_cockpit_in_one_process(tmp_path):
    """Only torchrun's runs refuse the CUDA-graph compile modes: one process launches as any run,
    and trains, compiled, to its end in the engine process alone (no torchrun, no ranks)."""
    app = CockpitApp(runs_root=tmp_path / "runs", telemetry=False)
    async with app.run_test() as pilot:
        app.new_run(shrunk_cpu("training.compile=true", "training.compile_mode=\"reduce-overhead\""), "cpu")
        await prepared(app, pilot)
        assert not [n.message for n in app._notifications if n.severity == "error"]
        assert len(app.engines) == 1 and (tmp_path / "runs").exists()
        dash = dashboard(app)
        await wait_for(pilot, lambda: dash.view.state in P.TERMINAL_STATES, timeout=180, what="the run to end")
        assert dash.view.state == P.FINISHED and dash.view.step == 12, dash.engine.failure
        dash.engine.join(timeout=30)
        assert dash.engine.exitcode == 0
    log = (dash.engine.run_dir / "train.log").read_text()
    assert re.search(r"^model: .*, compile on, [\d,]+ tokens/step$", log, re.M), log  # one process says no "N processes"
    assert not re.search(r"^(rank\d+|launcher): ", log, re.M)


@pytest.mark.slow
async def test_the_cockpit_keeps_answering_while_a_launch_is_checked(tmp_path, monkeypatch):
    """A launch's checks run in a thread (a first Hub task fetch takes minutes): while the check
    waits (here held at a gate until the test opens it; it then runs as ever, on a real task file),
    the launch returns at once, a second one is refused meanwhile, and the run starts once the check
    is done. (A FIFO as the task file held it once; a FIFO is now refused as a task file, #50.)"""
    import json
    import threading

    import lmcockpit.tui.app as app_module

    late = tmp_path / "late.jsonl"
    late.write_text("".join(json.dumps(r) + "\n" for r in (
        {"context": "import", "choices": [" os\n", " the\n"], "gold": 0},
        {"context": "def f():\n", "choices": ["    return 1\n", "    x x x\n"], "gold": 0})))
    gate, checked = threading.Event(), threading.Event()
    real_check = app_module.check_before_start

    def held_check(cfg):
        # Only if the launch blocks the cockpit (the defect) does the gate stay shut until then:
        # the test fails instead of hanging.
        gate.wait(60)
        real_check(cfg)
        checked.set()

    monkeypatch.setattr(app_module, "check_before_start", held_check)
    cfg = shrunk_cpu(f"eval.tasks=[{json.dumps(str(late))}]", "eval.tasks_every=6")
    app = CockpitApp(runs_root=tmp_path / "runs", telemetry=False)
    async with app.run_test() as pilot:
        worker = app.new_run(cfg, "cpu")
        assert worker is not None and not checked.is_set()  # back at once, the check not done
        assert app.new_run(cfg, "cpu") is None
        await pilot.pause()
        assert isinstance(app.screen, LaunchScreen) and not app.engines
        assert any("being prepared: one at a time" in n.message for n in app._notifications)
        gate.set()
        await prepared(app, pilot)
        dash = dashboard(app)
        await wait_for(pilot, lambda: dash.view.state in P.TERMINAL_STATES, timeout=180, what="the run to end")
        assert dash.view.state == P.FINISHED, dash.engine.failure
        dash.engine.join(timeout=30)
    scored = [r for r in read_metrics(dash.engine.run_dir, "eval") if r["tasks"]]
    assert [r["step"] for r in scored] == [6, 12] and all(r["tasks"]["late"]["items"] == 2 for r in scored)


# ------------------------------------------------------------------ the dashboard fed events
# The dashboard with no engine, fed the snapshot tests' fixed event stream: what it does with
# keys and resizes does not need a training run.

@pytest.mark.slow
async def test_the_log_scale_chart_survives_a_resize_and_the_chat_pane():
    """plotext's own log axis took log10 of its stored data again on every build, so a repaint
    without fresh data (a resize, the chat pane narrowing the chart) crashed the cockpit."""
    from lmcockpit.tui.widgets.charts import LossChart

    from .helpers import FedDashboard

    app = FedDashboard()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        dash = dashboard(app)
        chart = dash.query_one("#loss", LossChart)
        await pilot.press("l")
        await pilot.pause()
        for size in [(100, 30), (140, 45), (80, 24), (120, 40)]:
            await pilot.resize_terminal(*size)
            await pilot.pause()
            assert chart.size.width > 0 and chart.error == "", (size, chart.error)
        before = chart.size
        await pilot.press("t")  # the chat pane (under the chart, at 120 columns) takes its height: a repaint on old data
        await pilot.pause()
        assert dash.has_class("chatting") and chart.size.height < before.height
        await pilot.resize_terminal(130, 40)
        await pilot.pause()
        assert app.is_running and chart.error == ""
        shown = chart.render().plain
        assert "loss (log scale)" in shown and "4┤" in shown  # tick labels in loss units, not log10
        await pilot.press("escape", "l")  # back to linear, still drawing
        await pilot.pause()
        assert "log scale" not in chart.render().plain and chart.error == ""
    assert app.return_code in (None, 0)


@pytest.mark.slow
async def test_escape_leaves_the_chat_prompt_then_closes_the_pane():
    from .helpers import FedDashboard

    app = FedDashboard()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        dash = dashboard(app)
        chat = dash.query_one("#chat")
        assert "Esc" in chat.border_title and "t closes" in chat.border_title
        await pilot.press("t")
        assert dash.has_class("chatting") and app.focused.id == "chat-input"
        await pilot.press("t")  # typed into the prompt, as a prompt may begin with t
        assert dash.has_class("chatting") and app.focused.value == "t"
        await pilot.press("escape")  # out of the prompt: the cockpit's keys work again
        assert dash.has_class("chatting") and app.focused is None
        await pilot.press("t")
        assert not dash.has_class("chatting")
        await pilot.press("t", "escape", "escape")  # or Esc twice
        assert not dash.has_class("chatting") and app.focused is None
        await pilot.press("question_mark")
        assert "Esc" in screen_text(app.screen.query_one("Static").render())
        await pilot.press("escape")
        assert app.screen is dash


def test_the_rates_shown_follow_one_smoothed_step_time():
    """tokens/s, steps/s, MFU and the ETA all come from the same smoothed step time, on the
    dashboard and on the headless progress line alike."""
    from lmcockpit.tui.headless import progress_line
    from lmcockpit.tui.formatting import fmt_count
    from lmcockpit.core.run.state import RunState
    from lmcockpit.tui.widgets.panels import throughput_rows

    view = RunState()
    view.apply(P.RunStarted("run", {}, 1000, "cpu", "fp32", 0, 100, 4096))
    view.apply(P.StateChanged(P.RUNNING))
    for step, dt in enumerate([30.0, 1.0, 1.0, 1.0, 1.0, 0.25], 1):  # compile, then steady, then a fast step
        view.apply(P.StepMetrics(step, 5.0, 1e-3, 1.0, 4096 / dt, 0.4 / dt, dt, step * 4096))
    steps_per_s = view.steps_per_s
    assert steps_per_s == pytest.approx(1 / (0.9 + 0.1 * 0.25))
    assert view.tokens_per_s == pytest.approx(4096 * steps_per_s)  # not the last step's 16384
    assert view.mfu == pytest.approx(0.4 * steps_per_s)
    assert view.eta == pytest.approx((100 - 6) / steps_per_s)
    rows = dict(throughput_rows(view))
    assert rows["tokens/s"] == fmt_count(4096 * steps_per_s) == "4.4k" and rows["steps/s"] == f"{steps_per_s:.2f}"
    assert rows["MFU"] == f"{100 * 0.4 * steps_per_s:.1f}%"
    assert "4.4k tok/s" in progress_line(view, None, None) and f"{steps_per_s:.2f} step/s" in progress_line(view, None, None)


@pytest.mark.parametrize("end", sorted(P.TERMINAL_STATES))
def test_elapsed_stops_when_the_run_ends(end):
    from lmcockpit.core.run.state import RunState

    now = [100.0]
    view = RunState(clock=lambda: now[0])
    view.apply(P.StateChanged(P.RUNNING))
    now[0] = 130.0
    view.apply(P.StateChanged(P.PAUSED))
    now[0] = 160.0
    assert view.elapsed == 60.0  # wall time: a pause is part of it
    view.apply(P.StateChanged(P.RUNNING))
    now[0] = 190.0
    view.apply(P.StateChanged(end))
    now[0] = 1000.0
    assert view.elapsed == 90.0
    view.apply(P.StateChanged(end))  # a repeated end does not restart it
    assert view.elapsed == 90.0


def test_an_ended_run_has_no_time_left():
    from lmcockpit.core.run.state import RunState

    view = RunState()
    view.apply(P.RunStarted("run", {}, 1, "cpu", "fp32", 0, 100, 512))
    for step in (1, 2, 3):
        view.apply(P.StepMetrics(step, 5.0, 1e-3, 1.0, 1000.0, None, 0.5, 512 * step))
    assert view.eta == 0.5 * 97
    view.apply(P.StateChanged(P.ABORTED))
    assert view.eta is None


async def test_spikes_stalls_and_the_target_are_announced_and_spikes_marked():
    """What happened live is a toast (and in a real terminal its notification escape and bell);
    a spike read back from the folder by an attaching viewer is marked on the chart, not announced."""
    from lmcockpit.tui.widgets.charts import LossChart

    from .helpers import FedDashboard

    app = FedDashboard(then=[P.SpikeSeen(30, 41.5, "rollback", 3.0, 40.0, 1.0, None, live=False),
                             P.SpikeSeen(60, 88.0, "skip", 3.0, 90.0, 1.0, None),
                             P.StateChanged(P.STALLED, "no word for 11 min"), P.StateChanged(P.RUNNING),
                             P.TargetReached(70, "val_loss", 3.1, 3.2, 192.5)])
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        dash = dashboard(app)
        said = [n.message for n in app._notifications]
        assert said == ["loss spike at step 60: 88 (skip)", f"run stalled at step {dash.view.step}: no word for 11 min",
                        "target val loss 3.2 reached at step 70 after 0:03:12 of training"]
        chart = dash.query_one("#loss", LossChart)
        assert [s for s, _, _ in chart.history.spikes] == [30, 60] and "spike" in chart.render().plain
        assert chart.error == ""


async def test_the_launch_screen_says_how_long_a_gpu_preset_should_train(tmp_path):
    """On a machine without a GPU, each preset's time on the card it was sized for, beside its
    token budget; a CPU preset has none."""
    from lmcockpit.core.hardware.compute_estimate import training_time

    app = CockpitApp(runs_root=tmp_path / "runs", telemetry=False)
    async with app.run_test(size=(120, 40)) as pilot:
        launch = app.screen
        await budget_counted(launch)
        settings = launch.query_one("#settings")
        assert " on " not in str(settings.border_subtitle)  # the cpu preset
        presets = launch.query_one("#presets")
        launch.counted.clear()
        presets.move_cursor(row=presets.get_row_index("4090"))
        await wait_for(pilot, lambda: launch.preset_name == "4090", what="the 4090 preset shown")
        await budget_counted(launch)
        took = training_time(launch.current_config(), "RTX 4090")
        assert str(settings.border_subtitle).startswith(f"{took.short()} on 4090 · ")

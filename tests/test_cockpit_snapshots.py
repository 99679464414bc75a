"""Snapshots of the launch screen and of the dashboard fed a fixed event stream, at 80×24, 100×30
and 120×40, for a CPU run and a GPU run. Update them after an intended change with
`pytest --snapshot-update` and review the SVGs.

The GPU run's events are what an engine on one H100 sends (device cuda:0, bf16, MFU, allocator
figures); its NVML readings are stand-ins, as NVML cannot run here. Each dashboard snapshot also
asserts that the chart, the step line and the GPU (or CPU) bars are on screen, unscrolled."""

from __future__ import annotations

import re

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.tui.app import CockpitApp
from lmcockpit.tui.screens.dashboard import DashboardScreen
from lmcockpit.tui.widgets.charts import LossChart

from .helpers import FedDashboard, budget_counted, fixed_last_step, shown_in, task_scores

SIZES = [(80, 24), (100, 30), (120, 40)]
LAUNCH_SIZES = [(80, 24), (120, 40)]


def on_screen(dash: DashboardScreen, selector: str):
    """The widget, asserted to lie wholly inside the terminal with some room to show."""
    widget = dash.query_one(selector)
    assert widget.region.area > 0 and dash.region.contains_region(widget.region), (selector, widget.region)
    return widget


async def assert_at_a_glance(pilot) -> None:
    """The chart (half the width or more), the step line, the device bars and the log tail are on
    screen; the side column needs no scrolling."""
    await pilot.pause()
    dash = pilot.app.screen
    dash.redraw()
    await pilot.pause()
    width = dash.size.width
    chart = on_screen(dash, "#loss")
    assert chart.region.width >= width / 2 and chart.region.height >= 6
    step = on_screen(dash, "#stepline").render().plain
    assert f"step {fixed_last_step(pilot.app.tasks)}/400" in step and "loss 3." in step and "tok/s" in step and "ETA" in step
    devices = on_screen(dash, "#devices").render().plain
    if dash.devices[0].startswith("cuda"):
        assert "MFU 41.0%" in step
        assert "GPU0" in devices and "87%" in devices and "61.3/80G" in devices
        if width >= 100:
            assert "64°C" in devices and "512W" in devices
    else:
        assert "engine CPU" in devices and "180% of 2 cores" in devices and "1.4G/32.0G" in devices
    assert on_screen(dash, "#log").region.height >= 5
    assert dash.query_one("#side").max_scroll_y == 0


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("device", ["cpu", "cuda:0"], ids=["cpu", "gpu"])
def test_dashboard_snapshot(snap_compare, size, device):
    app = FedDashboard(device=device, gpus=1 if device != "cpu" else 0)
    assert snap_compare(app, terminal_size=size, run_before=assert_at_a_glance)


# A run folder as `lmcockpit attach` names it (absolute), longer than a side panel is wide.
LONG_RUN = "/home/someone/projects/lm-experiments/runs/h100-20261123-120000"


def panel_lines(app, panel) -> list[str]:
    """What the screen shows of an open panel inside its border: a string per line."""
    return [line.strip(" │") for line in shown_in(app, panel)[1:-1]]


def squeezed(text: str) -> str:
    return re.sub(r"\s", "", text)


async def assert_panels_whole(pilot) -> None:
    """At a glance, and every side panel, opened in turn with e, shows each of its labels whole
    and each value whole, wrapped under its label where it is long (of a long path, its end: the
    run's folder); no figure ends in an ellipsis. The target's panel is the one open at first, its
    forecast whole."""
    from lmcockpit.tui.widgets.panels import Panel

    await assert_at_a_glance(pilot)
    app, dash = pilot.app, pilot.app.screen
    side = dash.query_one("#side")
    forecast = dash.view.forecast.short(dash.view.cost_per_hour)
    assert forecast.startswith("val 3.10 at ~step") and "$" in forecast
    assert squeezed(forecast) in squeezed("".join(line.strip(" │") for line in shown_in(app, side)))
    target = on_screen(dash, "#target")
    assert not target.collapsed and squeezed(forecast) == squeezed("".join(panel_lines(app, target)))
    seen = set()
    for _ in side.groups():
        for panel in (p for p in dash.query(Panel) if p.display and not p.collapsed):
            lines = panel_lines(app, panel)
            assert not any(re.search(r"…(?!/)", line) for line in lines), (panel.border_title, lines)
            for label, value in panel.rows or []:
                assert not label or any(line.startswith(f"{label} ") for line in lines), (label, lines)
                whole = value.rsplit("/", 1)[-1] if value.startswith("/") else value  # a path: its folder
                assert squeezed(whole) in squeezed("".join(lines)), (value, lines)
            seen.add(panel.id or "gpu")
        await pilot.press("e")
        app.clear_notifications()  # "… panel open": a toast over the column
        await pilot.pause()
    assert side.chosen == "target"  # round again, as the snapshot shows it
    # At 80x24 a GPU run's seven panels take seven lines collapsed, and the throughput panel nine
    # more: too many beside the target's (its figures are on the step line there).
    assert seen == {"state", "target", "throughput", "anatomy", "gpu", "memory", "host"} - (
        {"throughput"} if dash.size.height < 30 else set())


@pytest.mark.slow
@pytest.mark.parametrize("size", LAUNCH_SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_target_dashboard_snapshot(snap_compare, size):
    """A run with a target (training.target_val_loss) attached from elsewhere (its folder
    absolute): the side panels cut their labels (`devi…`, `toke…`) and values, the target
    forecast most of all (`targ… val 4.20 at ~step …`). Now the forecast has a panel of its own,
    open at first, wrapped to its width; labels are whole and long values wrap."""
    app = FedDashboard(device="cuda:0", gpus=1, target=3.1, run=LONG_RUN)
    assert snap_compare(app, terminal_size=size, run_before=assert_panels_whole)


async def test_a_cpu_run_says_once_it_has_no_gpu_and_shows_its_memory():
    """A CPU run at 120x40 showed `GPU  GPU none: CPU run` and the NVML error in a GPU panel, and a
    memory panel of dashes (the allocator's figures are CUDA's). Now there is no GPU panel; the
    memory panel says `GPU none (CPU run)` once and gives the run's resident memory (open once
    chosen: the time panel opens before it)."""
    app = FedDashboard(device="cpu", gpus=0)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        dash = app.screen
        await pilot.press("e", "e")  # throughput → time → memory
        dash.redraw()
        await pilot.pause()
        side = "\n".join(shown_in(app, dash.query_one("#side")))
        assert not dash.query(".gpu") and "NVML" not in side
        assert len(re.findall(r"\bGPU\b", side)) == 1
        memory = panel_lines(app, on_screen(dash, "#memory"))
        assert [re.sub(r" +", " ", line) for line in memory] == ["RSS 1.4G of 32.0G", "GPU none (CPU run)"]


@pytest.mark.slow
async def test_viewers_coming_and_going_are_a_count_in_the_top_bar_not_log_lines():
    """The run host logs each viewer that attaches or detaches (a probe too); at 80x24 those
    lines filled the log's two lines. They stay out of the log: the top bar counts the cockpits
    watching while there are others than this one. Any other line of the host's still shows."""
    host = [P.LogLine(f"host: a viewer {what} ({n} watching)")
            for what, n in [("attached", 1), ("attached", 2), ("attached", 3), ("detached", 2)]]
    refused = P.LogLine("host: refused a connection that did not present this run's key")
    app = FedDashboard(host + [refused])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        dash = app.screen
        dash.redraw()
        await pilot.pause()
        log = "\n".join(shown_in(app, dash.query_one("#log")))
        assert "viewer" not in log and "refused a connection" in log
        assert "2 watching" in shown_in(app, dash.query_one("#topbar"))[0]
        dash.apply_events([P.LogLine("host: a viewer detached (1 watching)")])  # this cockpit alone again
        dash.redraw()
        await pilot.pause()
        assert "watching" not in shown_in(app, dash.query_one("#topbar"))[0]


@pytest.mark.slow
async def test_the_log_wraps_again_to_its_width_after_a_resize():
    """A line wrapped at 80 columns stayed wrapped there on a wider terminal, and one written wide
    ran past the pane's edge on a narrower one."""
    line = "checkpoint: step 200 written to runs/cpu-20261123-120000/checkpoints/step_000200"
    app = FedDashboard()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        log = app.screen.query_one("#log")
        assert not any(line in row for row in shown_in(app, log))  # 81 columns: wrapped at 80
        await pilot.resize_terminal(120, 40)
        await pilot.pause()
        assert any(line in row for row in shown_in(app, log))
        app.screen.apply_events([P.LogLine("after: " + "x" * 100)])
        await pilot.pause()
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        *_, first, second, third, _ = shown_in(app, log)  # the last three lines inside the border, in view
        assert first.startswith("│after:") and second.startswith("│xxx") and third.startswith("│xxx")
        assert (second + third).count("x") == 100  # wrapped to the pane, none past its edge


def test_ended_dashboard_snapshot(snap_compare):
    """Aborted at step 240: the footer trades p, c and a for n (a new run: back to the launch screen)."""
    assert snap_compare(FedDashboard([P.StateChanged(P.ABORTED)]), terminal_size=(80, 24))


@pytest.mark.slow
async def test_the_chat_pane_at_100_columns_leaves_the_chart_its_width():
    """Below 140 columns the chat pane opens under the chart, in the log's place."""
    app = FedDashboard(device="cuda:0", gpus=1)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        dash = app.screen
        width = dash.query_one("#loss").region.width
        await pilot.press("t")
        await pilot.pause()
        chart, chat = on_screen(dash, "#loss"), on_screen(dash, "#chat")
        assert chart.region.width == width >= 45 and chart.region.height >= 6
        assert chat.region.y > chart.region.bottom and chat.region.width == 100
        assert not dash.query_one("#log").display
        on_screen(dash, "#stepline")
        on_screen(dash, "#devices")
        await pilot.press("escape", "t")
        await pilot.resize_terminal(150, 40)  # wide: beside the chart, the log back under it
        await pilot.press("t")
        await pilot.pause()
        chart, chat = on_screen(dash, "#loss"), on_screen(dash, "#chat")
        assert chat.region.x >= chart.region.right and dash.query_one("#log").display


async def test_e_cycles_which_side_panel_is_open():
    """At 80×24 the panels do not all fit: one is open, the others are a line each; e opens the
    next, and a 120×40 terminal opens as many as fit."""
    from lmcockpit.tui.widgets.panels import Panel

    app = FedDashboard(device="cuda:0", gpus=1)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        dash = app.screen

        def opened() -> list[str]:
            return [p.id or "gpu" for p in dash.query(Panel) if p.display and not p.collapsed]

        assert opened() == ["throughput"]
        summary = dash.query_one("#state", Panel).render().plain
        assert summary.startswith("▸ run") and "cuda:0 bf16" in summary
        side = dash.query_one("#side")
        await pilot.press("e")
        await pilot.pause()
        assert side.chosen == "anatomy" and opened() == ["anatomy"] and side.max_scroll_y == 0
        await pilot.press("e")
        await pilot.pause()
        # the GPU panel opens, and the run panel with it (both fit); throughput no longer fits
        assert side.chosen == "gpu" and opened() == ["state", "gpu"] and side.max_scroll_y == 0
        await pilot.press("e", "e", "e", "e")
        await pilot.pause()
        assert side.chosen == "throughput" and opened() == ["throughput"]
        await pilot.resize_terminal(120, 40)
        await pilot.pause()
        assert len(opened()) >= 3 and dash.query_one("#side").max_scroll_y == 0


@pytest.mark.slow
async def test_a_long_history_reads_as_a_person_writes_its_steps():
    """A viewer's reading of 150,375 steps (HistoryRead), then live steps: the chart spans them all,
    its step axis labelled 50k, 100k, 150k (plotext alone wrote 75187.5), the step line shows
    the live step."""
    from lmcockpit.core.run.history import History

    h = History()
    for step in range(1, 150_376):
        h.add_step(step, 3 + 100 / (step + 30), 1e-3, 0.1, 5000.0)
    h.add_eval(150_000, 3.1, 1.0)
    live = [P.StepMetrics(150_376, 3.0, 1e-3, 0.5, 5000.0, None, 0.1, 150_376 * 512)]
    app = FedDashboard(then=[P.HistoryRead(h), *live])
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        dash = app.screen
        dash.redraw()
        await pilot.pause()
        chart = dash.query_one("#loss", LossChart)
        shown = chart.render().plain
        assert chart.error == ""
        axis = next(line for line in shown.splitlines() if "100k" in line)
        assert "50k" in axis and "." not in axis, axis  # plotext leaves out a label past the edge
        assert chart.history.last_step == 150_376 and chart.history.count == 150_376
        assert "150376" in dash.query_one("#stepline").render().plain.replace(",", "")
        lr = dash.query_one("#lr")
        assert len(str(lr.render())) == lr.size.width - 1  # the lr sparkline across the whole width


async def test_a_history_read_is_drawn_at_once_not_at_the_next_redraw():
    """The dashboard redraws a changed screen once a second; the run's history, read on attaching,
    is drawn the moment it comes (attach to first frame)."""
    from lmcockpit.core.run.history import History

    app = FedDashboard()
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        dash = app.screen
        h = History()
        for step in range(1, 501):
            h.add_step(step, 3.0, 1e-3, 0.1, 10.0)
        dash.apply_events([P.HistoryRead(h)])
        assert not dash.dirty and dash.query_one("#loss", LossChart).history is h


@pytest.mark.slow
async def test_a_long_run_s_chart_is_painted_again_only_when_its_picture_moves():
    """plotext costs as much to draw the same picture again as a new one: at 150,000 steps a
    second's 25 steps move no dot of a 100-column chart, and the chart is left as it is (watching
    a long run then costs what a short one does); an evaluation or a loss that moves a dot paints
    it again, and a short run's steps (each a dot or more) paint it every time."""
    from lmcockpit.core.run.history import History
    from lmcockpit.tui.widgets.charts import EDGE_EVERY, edge_only

    def steps(first: int, n: int, loss=lambda s: 3 + 100 / (s + 30)):
        return [P.StepMetrics(s, loss(s), 1e-3, 0.5, 5000.0, None, 0.1, s * 512) for s in range(first, first + n)]

    for length, moves in ((150_000, False), (300, True)):
        h = History()
        for step in range(1, length + 1):
            h.add_step(step, 3 + 100 / (step + 30), 1e-3, 0.1, 5000.0)
        app = FedDashboard(then=[P.HistoryRead(h)])
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.pause()
            dash = app.screen
            chart = dash.query_one("#loss", LossChart)
            built = []
            build = chart.build_plot
            chart.build_plot = lambda: (built.append(dash.view.step), build())[1]
            step = length + 1
            for _ in range(3):  # the panels settle
                dash.apply_events(steps(step, 25))
                step += 25
                dash.redraw()
                await pilot.pause()
            before = len(built)
            for _ in range(5):  # five seconds of a run at 25 steps a second
                dash.apply_events(steps(step, 25))
                step += 25
                dash.redraw()
                await pilot.pause()
            assert chart.history.last_step == step - 1
            if moves:
                assert len(built) >= before + 5, built  # every second moves the curve by dots
                continue
            assert len(built) == before, built
            dash.apply_events([P.EvalMetrics(step - 1, 3.05, 1.0)])
            dash.redraw()
            await pilot.pause()
            assert len(built) == before + 1 and "val" in chart.render().plain
            before = len(built)  # (render() above built once)
            # The newest points alone moving by dots (the bucket still filling): every EDGE_EVERY s.
            now = [chart.painted_at]  # when the evaluation was painted
            chart.clock = lambda: now[0]
            dash.apply_events(steps(step, 25, loss=lambda s: 3.1))
            step += 25
            assert edge_only(chart.painted, chart.sighting())
            dash.redraw()
            await pilot.pause()
            assert len(built) == before
            now[0] += EDGE_EVERY
            dash.redraw()
            await pilot.pause()
            assert len(built) == before + 1
            # A jump past the frame's top: at once.
            dash.apply_events(steps(step, 500, loss=lambda s: 9.0))
            dash.redraw()
            await pilot.pause()
            assert len(built) == before + 2


def test_a_chart_draws_at_most_twice_its_width_of_evaluations():
    """A million-step run evaluated every 250 steps has 4,000 evaluations, all kept; the chart draws
    as many dots as it has room for (plotext's cost grows with each), the first and last among them."""
    from lmcockpit.tui.widgets.charts import drawn

    xs, ys = drawn([(s, 3 + 1 / s) for s in range(250, 1_000_001, 250)], 100)
    assert len(xs) == 200 and (xs[0], xs[-1]) == (250, 1_000_000) and ys[-1] == 3 + 1 / 1_000_000
    assert drawn([(5, 3.0), (10, 2.9)], 100) == ([5, 10], [3.0, 2.9])


@pytest.mark.slow
async def test_the_chart_keeps_its_data_through_collapsing_and_resizes():
    app = FedDashboard(device="cuda:0", gpus=1)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        chart = app.screen.query_one("#loss", LossChart)
        for size in [(100, 30), (120, 40), (80, 24)]:
            await pilot.resize_terminal(*size)
            await pilot.pause()
            assert chart.error == "" and chart.history.count == 240


@pytest.mark.slow
@pytest.mark.parametrize("size", LAUNCH_SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_launch_screen_snapshot(snap_compare, size, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no runs here: the recent-runs table is empty and stable
    # no token caches either: the token budget is the estimate, not a count another test left
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    async def counted(pilot):  # the settings' token budget comes from a thread
        await budget_counted(pilot.app.screen)

    assert snap_compare(CockpitApp(runs_root=tmp_path / "runs", telemetry=False), terminal_size=size,
                        run_before=counted)


async def test_the_side_column_never_scrolls_even_with_the_chat_pane_open():
    """At 80×24 the chat pane takes half the height: the chosen panel (throughput) no longer fits,
    so it is a line like the others, none cut off; closing the pane opens it again."""
    from lmcockpit.tui.widgets.panels import Panel

    app = FedDashboard(device="cuda:0", gpus=1)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        dash = app.screen
        await pilot.press("t")
        await pilot.pause()
        dash.redraw()
        await pilot.pause()
        side = dash.query_one("#side")
        assert side.max_scroll_y == 0 and dash.query_one("#throughput", Panel).collapsed
        await pilot.press("escape", "t")
        await pilot.pause()
        assert not dash.query_one("#throughput", Panel).collapsed and side.max_scroll_y == 0


# ------------------------------------------------------------------------------ the tasks panel
def braille_columns(line: str) -> list[int]:
    """Where a screen line has braille dots: a plot's points and lines."""
    return [n for n, ch in enumerate(line) if 0x2800 < ord(ch) <= 0x28FF]


async def assert_tasks_shown(pilot) -> None:
    """At a glance as any dashboard, and the tasks panel on screen with python-functions' latest
    accuracy: open where it fits, else a line."""
    await assert_at_a_glance(pilot)
    panel = on_screen(pilot.app.screen, "#tasks")
    assert "0.430" in "\n".join(shown_in(pilot.app, panel))


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_task_scores_dashboard_snapshot(snap_compare, size):
    """The cpu preset's run scoring python-functions at steps 100, 200 and 300: the tasks panel, a
    line at 80×24 and 100×30, open at 120×40."""
    app = FedDashboard(device="cpu", gpus=0, tasks=True)
    assert snap_compare(app, terminal_size=size, run_before=assert_tasks_shown)


@pytest.mark.slow
async def test_the_tasks_panel_shows_each_task_s_accuracy_over_steps():
    """At 80×24 the tasks panel is one line: python-functions' latest accuracy (its name cut to
    fit). e opens it: accuracy and centred score, and under them the accuracy at steps 100, 200
    and 300 as a rising braille line across steps 0 to 300, its range beside it; beside the chat
    pane it is a line again, none cut off (the time panel's line took the row it fitted in), and
    open once the pane closes; at 120×40 it is open, its plot wider."""
    app = FedDashboard(device="cpu", gpus=0, tasks=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        dash = app.screen
        dash.redraw()
        await pilot.pause()
        side, panel = dash.query_one("#side"), on_screen(dash, "#tasks")
        [line] = shown_in(app, panel)
        assert panel.collapsed and re.fullmatch(r" ▸ tasks  python-\S*… 0\.430 *", line), line

        await pilot.press("e", "e")  # throughput (chosen at first) → time → tasks
        await pilot.pause()
        assert side.chosen == "tasks" and not panel.collapsed and side.max_scroll_y == 0
        lines = shown_in(app, on_screen(dash, "#tasks"))
        assert re.search(r"│ python-\S*… 0\.430 \(\+0\.24\) *│", lines[1]), lines[1]  # the name cut to fit
        top, bottom = lines[2], lines[3]
        assert top.rstrip(" │").endswith("0.43") and bottom.rstrip(" │").endswith("0.30")
        width = top.rindex("0.43") - 3  # the plot's: after the border and padding, before " 0.43"
        assert braille_columns(top) and braille_columns(bottom)
        # step 100 of 300 is a third of the way across; the line rises from the bottom row to the top
        assert width / 4 < braille_columns(bottom)[0] - 2 < braille_columns(top)[0] - 2
        assert braille_columns(top)[-1] > braille_columns(bottom)[-1]

        await pilot.press("t")  # the chat pane takes half the height: a line short of room for it
        await pilot.pause()
        dash.redraw()
        await pilot.pause()
        assert panel.collapsed and side.chosen == "tasks" and side.max_scroll_y == 0
        await pilot.press("escape", "t")
        await pilot.pause()
        assert not panel.collapsed and side.max_scroll_y == 0 and shown_in(app, panel)[2:4] == lines[2:4]

        await pilot.resize_terminal(120, 40)
        await pilot.pause()
        dash.redraw()
        await pilot.pause()
        wide = shown_in(app, on_screen(dash, "#tasks"))
        assert not panel.collapsed and side.max_scroll_y == 0 and "python-functions 0.430 (+0.24)" in wide[1]
        assert len(braille_columns(wide[3])) > len(braille_columns(bottom))


async def test_the_tasks_panel_is_absent_without_tasks_and_says_when_none_are_scored_yet():
    """A run that names no task has no tasks panel (the other snapshots are unchanged by it); one
    that names one says, in its line at 80×24, at which step its first scores come; then shows them."""
    app = FedDashboard(device="cpu", gpus=0)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        dash = app.screen
        dash.redraw()
        await pilot.pause()
        panel = dash.query_one("#tasks")
        assert not panel.display and not any("tasks" in line for line in shown_in(app, dash.query_one("#side")))

        config = {"eval": {"every": 250, "tasks": ["hellaswag.jsonl"], "tasks_every": 500}}
        dash.apply_events([P.RunStarted("runs/x", config, 124_000_000, "cpu", "fp32", 240, 1000, 4096)])
        dash.redraw()
        await pilot.pause()
        assert panel.display and panel.collapsed  # the run is at step 240: the first scoring at 500
        assert shown_in(app, on_screen(dash, "#tasks")) == [" ▸ tasks  first at step 500".ljust(panel.region.width)]

        dash.apply_events([P.EvalMetrics(500, None, None, {"hellaswag": task_scores(0.2714)}),
                           P.StepMetrics(500, 3.1, 1e-3, 0.5, 4096.0, None, 1.0, 500 * 4096)])
        dash.redraw()
        await pilot.pause()
        [line] = shown_in(app, on_screen(dash, "#tasks"))
        assert "first at" not in line and "hellaswag 0.271" in line
        await pilot.press("e", "e")  # throughput → time → tasks
        await pilot.pause()
        assert "hellaswag 0.271 (+0.03)" in "\n".join(shown_in(app, on_screen(dash, "#tasks")))


async def test_a_task_with_a_reference_model_draws_its_score_as_a_dotted_line():
    """HellaSwag, which GPT-2 124M scores 0.2955 (llm.c's scoring): the panel draws that score
    across the task's plot, dotted, and names the model under it. Left of the first scoring
    (step 100 of 300) the run's line is not yet there: only the reference's dots are."""
    from lmcockpit.core.config import config_from_dict
    from lmcockpit.tui.widgets.task_panel import references_of

    hellaswag = [P.EvalMetrics(step, None, None, {"hellaswag": task_scores(acc, items=10042)})
                 for step, acc in [(100, 0.262), (200, 0.281), (300, 0.309)]]
    app = FedDashboard(hellaswag, device="cuda:0", gpus=1, tasks=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        dash = app.screen
        side, panel = dash.query_one("#side"), dash.query_one("#tasks")
        await pilot.press("e", "e")  # throughput → time → tasks
        await pilot.pause()
        assert side.chosen == "tasks" and not panel.collapsed and side.max_scroll_y == 0
        lines = shown_in(app, on_screen(dash, "#tasks"))
        at = next(n for n, line in enumerate(lines) if "hellaswag 0.309 (+0.08)" in line)
        plot, legend = lines[at + 1:at + 3], lines[at + 3]
        assert "┄ GPT-2 124M 0.2955" in legend
        assert plot[0].rstrip(" │").endswith("0.31") and plot[1].rstrip(" │").endswith("0.26")
        width = plot[0].rindex("0.31") - 3
        before_first = [[c for c in braille_columns(row) if c - 2 < width / 4] for row in plot]
        dotted = [row for row in before_first if row]
        assert len(dotted) == 1 and len(dotted[0]) >= width / 4 - 1  # one row, a dot in every cell
        # the python-functions plot has no reference: nothing before its first scoring
        pf = next(n for n, line in enumerate(lines) if "python-functions" in line)
        assert not any(c - 2 < width / 4 for row in lines[pf + 1:pf + 3] for c in braille_columns(row))

    assert references_of(None) == {} and references_of(config_from_dict({})) == {}
    assert references_of(config_from_dict({"eval": {"references": {"mine": {"a model": 0.5}}}})) == {
        "mine": {"a model": 0.5}}

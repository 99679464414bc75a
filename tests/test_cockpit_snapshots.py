"""Snapshots of the launch screen and of the dashboard fed a fixed event stream, at 80×24, 100×30
and 120×40, for a CPU run and a GPU run. Update them after an intended change with
`pytest --snapshot-update` and review the SVGs.

The GPU run's events are what an engine on one H100 sends (device cuda:0, bf16, MFU, allocator
figures); its NVML readings are stand-ins, as NVML cannot run here. Each dashboard snapshot also
asserts that the chart, the step line and the GPU (or CPU) bars are on screen, unscrolled."""

from __future__ import annotations

import math

import pytest
from textual.app import App

from lmcockpit.core import protocol as P
from lmcockpit.core.hardware.telemetry import GPUReading, ProcessLoad, Reading, Telemetry
from lmcockpit.tui.app import CockpitApp
from lmcockpit.tui.screens.dashboard import DashboardScreen
from lmcockpit.tui.widgets.charts import LossChart

from .test_cockpit import budget_counted

SIZES = [(80, 24), (100, 30), (120, 40)]
LAUNCH_SIZES = [(80, 24), (120, 40)]
GiB = 2**30
H100_UUID = "GPU-5f1c2d3e-0000-4a4a-9b9b-0123456789ab"


def fixed_events(device: str = "cpu") -> list[object]:
    """A run at step 240 of 400 with two evaluations and a checkpoint; on `device` ("cpu" or
    "cuda:0": bf16, MFU and allocator figures as the engine reports them on a GPU)."""
    gpu = device.startswith("cuda")
    run = f"runs/{'h100' if gpu else 'cpu'}-20261123-120000"
    tokens_per_step = 524_288 if gpu else 4096
    events: list[object] = [
        P.StateChanged(P.PREPARING),
        P.LogLine("data: reusing token cache ~/.cache/lmcockpit/9f7e97d0744113f743ad"),
        P.LogLine("model: 5,245,696 parameters, 4 layers, d_model 256, 4 heads / 2 kv heads"),
        P.RunStarted(run, {"sample": {"max_new_tokens": 48}}, 5_245_696, device, "bf16" if gpu else "fp32", 0, 400,
                     tokens_per_step, devices=(device,), device_uuids=(H100_UUID,) if gpu else ("",)),
        P.StateChanged(P.RUNNING),
    ]
    mem = {"allocated": 21 * GiB, "reserved": 30 * GiB, "peak": 28 * GiB} if gpu else {}
    for step in range(1, 241):
        loss = 3.2 + 5.8 * math.exp(-step / 40) + 0.15 * math.sin(step / 3)
        lr = 0.006 * min(1.0, step / 20) * (0.55 + 0.45 * math.cos(math.pi * step / 400))
        dt = 0.8 if gpu else 0.82
        events.append(P.StepMetrics(step, loss, lr, 0.5, tokens_per_step / dt, 0.41 if gpu else None, dt,
                                    step * tokens_per_step, mem))
        if step % 100 == 0:
            events.append(P.EvalMetrics(step, loss + 0.2, (loss + 0.2) / 2.4))
            events.append(P.StateChanged(P.RUNNING))
    events += [P.CheckpointWritten(200, f"{run}/checkpoints/step_000200"),
               P.LogLine(f"checkpoint: step 200 written to {run}/checkpoints/step_000200")]
    return events


class StandInTelemetry(Telemetry):
    """Fixed readings: one H100 at 87% (or none), a host, and the run's processes at 180% CPU."""

    def __init__(self, gpus: int):  # no NVML to start: read() and process_load() are all the dashboard uses
        self.gpus = gpus
        self.nvml = None
        self.nvml_error = "" if gpus else "no NVML: NVML Shared Library Not Found"
        self.driver = "550.54"

    def read(self) -> Reading:
        h100 = [GPUReading(i, "NVIDIA H100 80GB HBM3", util=87.0, mem_util=41.0, mem_used=int(61.3 * GiB),
                           mem_total=80 * GiB, temperature=64.0, power=512.0, sm_clock=1980,
                           uuid=H100_UUID if i == 0 else f"GPU-{i}") for i in range(self.gpus)]
        return Reading(12.0, 9 * GiB, 32 * GiB, h100)

    def process_load(self, pid: int) -> ProcessLoad | None:
        return ProcessLoad(180.0, int(1.4 * GiB), 2)


class FedDashboard(App):
    """The dashboard with no engine: events come from the test (the fixed ones, then `then`), the
    clock stands still; with `gpus`, stand-in telemetry (0: a CPU machine's)."""
    CSS_PATH = CockpitApp.CSS_PATH

    def __init__(self, then: list[object] = (), device: str = "cpu", gpus: int | None = None) -> None:
        super().__init__()
        self.then = list(then)
        self.device = device
        self.telemetry = StandInTelemetry(gpus) if gpus is not None else None

    async def on_mount(self) -> None:
        screen = DashboardScreen(None, "cpu" if self.device == "cpu" else "h100", clock=lambda: 1000.0,
                                 telemetry=self.telemetry)
        screen.run_pid = 4242  # read by the stand-in telemetry only
        await self.push_screen(screen)
        if self.telemetry is not None:  # a full utilisation history, so the 1 Hz sampling changes nothing
            for _ in range(120):
                screen.sample_telemetry()
        screen.apply_events(fixed_events(self.device) + self.then)
        screen.redraw()


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
    assert "step 240/400" in step and "loss 3." in step and "tok/s" in step and "ETA" in step
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


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("device", ["cpu", "cuda:0"], ids=["cpu", "gpu"])
def test_dashboard_snapshot(snap_compare, size, device):
    app = FedDashboard(device=device, gpus=1 if device != "cpu" else 0)
    assert snap_compare(app, terminal_size=size, run_before=assert_at_a_glance)


def test_ended_dashboard_snapshot(snap_compare):
    """Aborted at step 240: the footer trades p, c and a for n (a new run: back to the launch screen)."""
    assert snap_compare(FedDashboard([P.StateChanged(P.ABORTED)]), terminal_size=(80, 24))


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
        # the GPU panel opens, and the run panel with it (both fit); throughput no longer fits
        assert side.chosen == "gpu" and opened() == ["state", "gpu"] and side.max_scroll_y == 0
        await pilot.press("e", "e", "e", "e")
        await pilot.pause()
        assert side.chosen == "throughput" and opened() == ["throughput"]
        await pilot.resize_terminal(120, 40)
        await pilot.pause()
        assert len(opened()) >= 3 and dash.query_one("#side").max_scroll_y == 0


async def test_the_chart_keeps_its_data_through_collapsing_and_resizes():
    app = FedDashboard(device="cuda:0", gpus=1)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        chart = app.screen.query_one("#loss", LossChart)
        for size in [(100, 30), (120, 40), (80, 24)]:
            await pilot.resize_terminal(*size)
            await pilot.pause()
            assert chart.error == "" and len(chart.steps) == 240


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

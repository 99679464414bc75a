"""The cockpit on machines with several GPUs: a panel per GPU the run uses, found through CUDA's
numbering, and the launch screen's process count. This machine has no GPU, so a Telemetry
subclass hands the real screens made-up NVML readings."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console
from textual.app import App

from lmcockpit.core import protocol as P
from lmcockpit.core.hardware.telemetry import GPUReading, Reading, Telemetry, cuda_gpu_count, nvml_index, run_gpu_indices
from lmcockpit.tui.app import CockpitApp
from lmcockpit.tui.screens.dashboard import DashboardScreen
from lmcockpit.tui.screens.launch import LaunchScreen
from lmcockpit.tui.widgets.panels import Panel, gpu_layout

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

GiB = 2**30


def gpu(i: int) -> GPUReading:
    """GPU i: util 11, 21, 31…% and (i+1) GiB used, so each figure says which GPU it came from."""
    return GPUReading(i, f"Card {i}", util=10.0 * i + 11, mem_util=5.0, mem_used=(i + 1) * GiB,
                      mem_total=80 * GiB, temperature=60.0 + i, power=300.0, sm_clock=1980)


class FakeTelemetry(Telemetry):
    def __init__(self, gpus: int):  # no NVML to start: only read() is used
        self.gpus = gpus
        self.nvml = None
        self.nvml_error = "" if gpus else "no NVML: test"
        self.driver = "550.54"

    def read(self) -> Reading:
        return Reading(5.0, 8 * GiB, 32 * GiB, [gpu(i) for i in range(self.gpus)])


def run_started(device: str = "cuda", devices: tuple[str, ...] = (), world: int = 1) -> P.RunStarted:
    return P.RunStarted("runs/x", {}, 1_000_000, device, "bf16", 0, 100, 4096, world=world, devices=devices)


class FedDashboard(App):
    """The dashboard with no engine: the test feeds it events; telemetry is made up."""
    CSS_PATH = CockpitApp.CSS_PATH

    def __init__(self, gpus: int):
        super().__init__()
        self.fake = FakeTelemetry(gpus)

    async def on_mount(self) -> None:
        await self.push_screen(DashboardScreen(None, "test", clock=lambda: 1000.0, telemetry=self.fake))


def text(renderable) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def gpu_panels(dash: DashboardScreen) -> list[Panel]:
    return list(dash.query(".gpu").results(Panel))


async def feed(pilot, dash: DashboardScreen, *events) -> list[tuple[str, str]]:
    """Apply events, redraw, let the panels mount; (title, text) of each GPU panel."""
    dash.apply_events(list(events))
    dash.redraw()
    await pilot.pause()
    return [(p.border_title, text(p.body)) for p in gpu_panels(dash)]


def memory_text(dash: DashboardScreen) -> str:
    return text(dash.query_one("#memory", Panel).body)


# -------------------------------------------------------------------------------- pure functions
def test_device_to_nvml_index():
    assert nvml_index("cuda") == 0
    assert nvml_index("cuda:3") == 3
    assert nvml_index("cpu") is None and nvml_index("mps") is None and nvml_index("cuda:x") is None
    # CUDA numbers the GPUs CUDA_VISIBLE_DEVICES lists, in its order; NVML numbers them all
    assert nvml_index("cuda:0", "2,3") == 2
    assert nvml_index("cuda:1", " 3, 1 ") == 1
    assert nvml_index("cuda", "5") == 5
    # UUIDs with no readings to find them in: CUDA index N is read as NVML GPU N
    assert nvml_index("cuda:1", "GPU-8a1f,GPU-77c2") == 1
    assert run_gpu_indices(("cuda:0", "cuda:1"), "6,7") == [6, 7]
    assert run_gpu_indices(("cpu",)) == []
    assert cuda_gpu_count(4) == 4
    assert cuda_gpu_count(4, "2,3") == 2
    assert cuda_gpu_count(4, "3,9") == 1  # GPU 9 does not exist here
    assert cuda_gpu_count(4, "") == 0
    assert cuda_gpu_count(4, "GPU-8a1f,GPU-77c2") == 2


def test_gpu_layout_goes_from_panels_to_one_table_as_gpus_grow():
    assert gpu_layout([], narrow=False) == []  # a CPU run: its memory panel says it has no GPU
    assert gpu_layout([3], narrow=False) == ["3"]
    assert gpu_layout([0, 1], narrow=False) == ["0", "1"]
    assert gpu_layout([0, 1], narrow=True) == ["table"]
    assert gpu_layout(list(range(8)), narrow=False) == ["table"]


# --------------------------------------------------------------------------------- the dashboard
@pytest.mark.slow
async def test_a_two_process_run_shows_a_panel_for_each_of_its_gpus():
    app = FedDashboard(gpus=4)
    async with app.run_test(size=(120, 40)) as pilot:
        dash = app.screen
        before = await feed(pilot, dash, P.StateChanged(P.COMPILING))
        assert [title for title, _ in before] == ["GPU 0"]  # until the run names its devices: the first GPU
        panels = await feed(pilot, dash, run_started("cuda:0", ("cuda:0", "cuda:1"), world=2))
        assert len(panels) == 2
        (title0, text0), (title1, text1) = panels
        assert title0 == "GPU 0 · Card 0" and "11%" in text0
        assert title1 == "GPU 1 · Card 1" and "21%" in text1
        assert "1.0G / 80.0G" in memory_text(dash)  # "GPU used" is the first device's
        assert "2 procs" in text(dash.query_one("#state", Panel).body)
        await pilot.resize_terminal(80, 24)  # too narrow for two panels: one, a row per GPU
        await pilot.pause()
        ((title, shown),) = await feed(pilot, dash)
        assert title == "2 GPUs" and "11%" in shown and "21%" in shown


async def test_a_single_process_run_on_cuda_1_shows_gpu_1():
    app = FedDashboard(gpus=4)
    async with app.run_test(size=(120, 40)) as pilot:
        dash = app.screen
        ((title, shown),) = await feed(pilot, dash, run_started("cuda:1"))
        assert title == "GPU 1"
        assert "Card 1" in shown and "21%" in shown and "Card 0" not in shown
        assert "2.0G / 80.0G" in memory_text(dash)


@pytest.mark.parametrize(("visible", "devices", "expected"), [
    ("2,3", ("cuda:0", "cuda:1"), [2, 3]),
    ("3", ("cuda",), [3]),
])
async def test_cuda_visible_devices_maps_cuda_numbers_to_gpus(monkeypatch, visible, devices, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    app = FedDashboard(gpus=4)
    async with app.run_test(size=(120, 40)) as pilot:
        dash = app.screen
        panels = await feed(pilot, dash, run_started(devices[0], devices, world=len(devices)))
        assert [title.split(" · ")[0] for title, _ in panels] == [f"GPU {i}" for i in expected]
        for (_, shown), i in zip(panels, expected, strict=True):
            assert f"{10 * i + 11}%" in shown
        assert f"{expected[0] + 1}.0G / 80.0G" in memory_text(dash)


@pytest.mark.parametrize("gpus", [0, 2], ids=["no-gpu", "gpus-unused"])
async def test_a_cpu_run_has_no_gpu_panel_and_says_so_once(gpus):
    """On a machine with GPUs or none, a CPU run has no GPU panel: its memory panel says it uses
    none, once, in place of the allocator's figures (CUDA's), and why NVML is missing is no
    business of a CPU run's."""
    app = FedDashboard(gpus=gpus)
    async with app.run_test(size=(120, 40)) as pilot:
        dash = app.screen
        assert await feed(pilot, dash, run_started("cpu")) == []
        memory = memory_text(dash)
        assert re.search(r"GPU +none \(CPU run\)", memory) and "allocated" not in memory and "NVML" not in memory


@pytest.mark.slow
@pytest.mark.parametrize("size", [(80, 24), (100, 30), (120, 40)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("n", [1, 2, 8])
async def test_every_gpu_has_a_bar_on_screen(size, n):
    """Every GPU the run uses has its bar on screen, at 80×24 too (eight take two lines there,
    four to a line), and the chart keeps half the width and its height."""
    app = FedDashboard(gpus=8)
    async with app.run_test(size=size) as pilot:
        dash = app.screen
        devices = tuple(f"cuda:{i}" for i in range(n))
        panels = await feed(pilot, dash, run_started("cuda:0", devices, world=n))
        wide = size[0] >= 100
        assert len(panels) == (n if n == 1 or (wide and n == 2) else 1)
        strip = dash.query_one("#devices")
        assert dash.region.contains_region(strip.region)
        shown = strip.render().plain
        assert [f"GPU{i}" in shown for i in range(n)] == [True] * n
        assert [f"{10 * i + 11:.0f}%" in shown for i in range(n)] == [True] * n
        assert strip.region.height <= (2 if size[1] < 30 else 4)
        chart = dash.query_one("#loss").region
        assert chart.width >= size[0] / 2 and chart.height >= 6


# ------------------------------------------------------------------------------ the launch screen
def launch_app(tmp_path, gpus: int) -> CockpitApp:
    app = CockpitApp(runs_root=tmp_path / "runs", telemetry=False)
    app.telemetry = FakeTelemetry(gpus)
    return app


@pytest.mark.slow
async def test_p_cycles_processes_through_the_gpus_into_the_launched_run(tmp_path, monkeypatch):
    """p picks the process count; Enter launches it for real: two processes through torchrun (on
    the CPU with gloo here, the GPUs being made up), which train the run together to its end."""
    from lmcockpit.core.run.folder import TRAIN_LOG

    from .helpers import SHRINK_CPU, TINY
    from .helpers import wait_for

    monkeypatch.chdir(tmp_path)
    app = launch_app(tmp_path, gpus=3)
    async with app.run_test(size=(120, 40)) as pilot:
        launch = app.screen
        assert isinstance(launch, LaunchScreen)
        assert "3 GPUs" in str(launch.query_one("#hardware").render())
        assert "p" in launch.active_bindings  # shown in the footer
        # the cpu preset shrunk, as if typed in with e
        shrunk = dict(s.split("=", 1) for s in [*SHRINK_CPU, *TINY, "training.compile=false", "eval.every=0",
                                                 "training.max_steps=3"])
        launch.overrides = dict(shrunk)
        launch.show_settings()
        counts = []
        for _ in range(3):
            await pilot.press("p")
            counts.append(launch.current_config().distributed.nproc)
        assert counts == [2, 3, 1]
        await pilot.press("p")
        assert launch.overrides == {**shrunk, "distributed.nproc": "2"}  # recorded as an edit records it
        settings = launch.query_one("#settings")
        assert str(settings.get_row("distributed.nproc")[1]) == "2"
        assert "(edited)" in settings.border_title
        launch.query_one("#presets").focus()
        await pilot.press("enter")
        await app.preparing.wait()  # checked and made in a thread
        await pilot.pause()
        dash = app.screen
        assert isinstance(dash, DashboardScreen)
        await wait_for(pilot, lambda: dash.view.state in P.TERMINAL_STATES, timeout=240, what="the run to end")
        assert dash.view.state == P.FINISHED and dash.view.step == 3, dash.engine.failure
        # the panels are redrawn on the dashboard's clock: a run this short ends before its next tick
        await wait_for(pilot, lambda: "2 procs" in text(dash.query_one("#state", Panel).body), what="the state panel")
        dash.engine.join(timeout=60)
        assert dash.engine.exitcode == 0
    log = (dash.engine.run_dir / TRAIN_LOG).read_text()
    for rank in (0, 1):
        assert re.search(rf"^rank{rank}: model: .* 2 processes \(ddp\)$", log, re.M), log


@pytest.mark.slow
async def test_p_counts_only_the_gpus_cuda_may_use(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    app = launch_app(tmp_path, gpus=4)
    async with app.run_test(size=(120, 40)) as pilot:
        launch = app.screen
        assert "4 GPUs (2 visible to CUDA)" in str(launch.query_one("#hardware").render())
        await pilot.press("p", "p")
        assert launch.overrides == {"distributed.nproc": "1"}


@pytest.mark.parametrize("gpus", [0, 1])
async def test_p_does_nothing_with_fewer_than_two_gpus(tmp_path, monkeypatch, gpus):
    monkeypatch.chdir(tmp_path)
    app = launch_app(tmp_path, gpus=gpus)
    async with app.run_test(size=(120, 40)) as pilot:
        launch = app.screen
        hardware = str(launch.query_one("#hardware").render())
        assert ("GPU: Card 0 (80 GiB)" if gpus else "no GPU") in hardware
        assert "p" not in launch.active_bindings
        await pilot.press("p")
        assert launch.overrides == {}
        assert launch.current_config().distributed.nproc == 1


def test_the_headless_progress_line_reads_the_run_s_own_gpu():
    from lmcockpit.tui.headless import progress_line
    from lmcockpit.core.run.state import RunState

    view = RunState()
    for ev in (run_started("cuda:1"), P.StateChanged(P.RUNNING),
               P.StepMetrics(1, 5.0, 1e-3, 1.0, 1000.0, None, 0.1, 4096)):
        view.apply(ev)
    reading = FakeTelemetry(4).read()
    assert "GPU 21%" in progress_line(view, reading, 1) and "VRAM 2.1/85.9GB" in progress_line(view, reading, 1)
    # a run on another device (the CPU here) has no GPU of its own to show: the fields are left out
    assert "GPU" not in progress_line(view, reading, None) and "VRAM" not in progress_line(view, reading, None)


def test_a_gpu_that_refuses_its_utilisation_is_listed_without_it_and_the_others_still_read():
    """MIG instances and some virtual GPUs answer NVML's utilisation query with NotSupported: the
    sampler must go on, with that field unknown (this machine has no NVML: a stand-in driver;
    tests/test_nvml.py fails every other call)."""
    from types import SimpleNamespace

    class NotSupported(Exception):
        pass

    def utilisation(handle):
        if handle == 0:
            raise NotSupported("Not Supported")
        return SimpleNamespace(gpu=42, memory=7)

    driver = SimpleNamespace(
        nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=utilisation,
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=GiB, total=80 * GiB),
        nvmlDeviceGetName=lambda h: b"NVIDIA H100 80GB HBM3", NVML_TEMPERATURE_GPU=0, NVML_CLOCK_SM=1)
    telemetry = Telemetry()
    telemetry.nvml = driver
    refused, read = telemetry.read().gpus
    assert (refused.index, refused.util, refused.mem_util, refused.mem_total) == (0, None, None, 80 * GiB)
    assert (read.index, read.name, read.util, read.mem_total) == (1, "NVIDIA H100 80GB HBM3", 42.0, 80 * GiB)
    assert read.temperature is None  # not offered by this driver either: no reading, no failure

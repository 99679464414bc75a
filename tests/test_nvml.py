"""NVML as the front-end reads it, through a stand-in `pynvml` (this machine has no NVML): every
call lmcockpit makes, failing in turn, costs its own field and never the cockpit, the headless
line or the doctor; and a run's GPUs are found among NVML's by UUID, whatever order CUDA and NVML
number them in."""

from __future__ import annotations

import dataclasses
import io
import re
import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from rich.console import Console
from textual.app import App

from lmcockpit.core import protocol as P
from lmcockpit.core.hardware import gpu_env
from lmcockpit.core.hardware.telemetry import GPUReading, Telemetry, nvml_index, run_gpu_indices
from lmcockpit.tui.app import CockpitApp
from lmcockpit.tui.headless import Headless
from lmcockpit.tui.screens.dashboard import DashboardScreen
from lmcockpit.tui.screens.launch import LaunchScreen
from lmcockpit.tui.widgets.panels import Panel

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

GiB = 2**30
# NVML lists B first (bus order), CUDA may list A first (fastest first, or CUDA_VISIBLE_DEVICES)
UUID_A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
UUID_B = "GPU-bbbbbbbb-1111-2222-3333-444444444444"
MIG_A = "MIG-cccccccc-1111-2222-3333-444444444444"  # a MIG instance carved from A


class NVMLError(Exception):
    pass


class NVMLError_GpuIsLost(NVMLError):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


@dataclass
class Card:
    name: bytes
    uuid: str
    util: int  # %
    used: int  # GiB
    mig: tuple[str, ...] = ()


# NVML index 0 is B, 1 is A; each figure says which card it came from
CARDS = [Card(b"Card B", UUID_B, util=11, used=1), Card(b"Card A", UUID_A, util=21, used=2, mig=(MIG_A,))]

# Every call lmcockpit makes; the stand-in has these and no others.
CALLS = ("nvmlInit", "nvmlShutdown", "nvmlSystemGetDriverVersion", "nvmlDeviceGetCount",
         "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetUtilizationRates",
         "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetClockInfo",
         "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetMigMode", "nvmlDeviceGetMaxMigDeviceCount",
         "nvmlDeviceGetMigDeviceHandleByIndex")


def stand_in(cards: list[Card] = CARDS) -> types.ModuleType:
    """A `pynvml` whose calls answer from `cards`. `nvml.failing[call] = (error, gpu)` makes `call`
    raise `error`, for GPU `gpu` only (None: every time); `nvml.raised` and `nvml.called` record
    what happened, and `nvml.missing` every name asked for that the stand-in lacks."""
    nvml = types.ModuleType("pynvml")
    nvml.failing, nvml.raised, nvml.called, nvml.missing = {}, set(), set(), set()

    def answer(name, fn):
        def call(*args):
            nvml.called.add(name)
            error, gpu = nvml.failing.get(name, (None, None))
            handle = args[0] if args else None
            on = handle if isinstance(handle, int) else handle[0] if isinstance(handle, tuple) else None
            if error is not None and (gpu is None or gpu == on):
                nvml.raised.add(name)
                raise error
            return fn(*args)
        return call

    def mig_mode(h):
        if not cards[h].mig:
            raise NVMLError_NotSupported("Not Supported")  # what a card without MIG answers
        return [1, 1]

    def mig_handle(h, k):
        if k >= len(cards[h].mig):
            raise NVMLError("Not Found")  # an empty slot
        return (h, k)

    answers = {
        "nvmlInit": lambda: None, "nvmlShutdown": lambda: None,
        "nvmlSystemGetDriverVersion": lambda: "550.54.15",
        "nvmlDeviceGetCount": lambda: len(cards),
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: cards[h].name,
        "nvmlDeviceGetUUID": lambda h: cards[h].uuid.encode() if isinstance(h, int) else cards[h[0]].mig[h[1]],
        "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=cards[h].util, memory=5),
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(used=cards[h].used * GiB, free=(80 - cards[h].used) * GiB,
                                                             total=80 * GiB),
        "nvmlDeviceGetTemperature": lambda h, sensor: 60 + h,
        "nvmlDeviceGetPowerUsage": lambda h: 300_000,  # mW
        "nvmlDeviceGetClockInfo": lambda h, clock: 1980,
        "nvmlDeviceGetCudaComputeCapability": lambda h: (9, 0),
        "nvmlDeviceGetMigMode": mig_mode,
        "nvmlDeviceGetMaxMigDeviceCount": lambda h: 7 if cards[h].mig else 0,
        "nvmlDeviceGetMigDeviceHandleByIndex": mig_handle,
    }
    assert set(answers) == set(CALLS)
    for name, fn in answers.items():
        setattr(nvml, name, answer(name, fn))
    nvml.NVMLError, nvml.NVMLError_GpuIsLost = NVMLError, NVMLError_GpuIsLost
    nvml.NVML_TEMPERATURE_GPU, nvml.NVML_CLOCK_SM, nvml.NVML_DEVICE_MIG_ENABLE = 0, 1, 1

    def missing(name):
        nvml.missing.add(name)
        raise AttributeError(name)

    nvml.__getattr__ = missing
    return nvml


@pytest.fixture
def nvml(monkeypatch) -> types.ModuleType:
    module = stand_in()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # CUDA sees every GPU, as on a plain machine
    return module


def healthy(i: int) -> GPUReading:
    card = CARDS[i]
    return GPUReading(i, card.name.decode(), float(card.util), 5.0, card.used * GiB, 80 * GiB, 60.0 + i, 300.0, 1980,
                      card.uuid, card.mig)


def healthy_nvml(i: int) -> gpu_env.NvmlGPU:
    card = CARDS[i]
    return gpu_env.NvmlGPU(i, card.uuid, card.name.decode(), 80 * GiB, (80 - card.used) * GiB, (9, 0))


# ------------------------------------------------------------------------------ every call fails
def test_with_every_call_answering_every_field_is_read(nvml):
    """The stand-in is complete: nothing lmcockpit asks for is missing from it (a missing call
    would only read as an unknown field), and every call is made."""
    telemetry = Telemetry()
    assert telemetry.read().gpus == [healthy(0), healthy(1)]
    assert (telemetry.driver, telemetry.nvml_error) == ("550.54.15", "")
    assert gpu_env.read_nvml() == gpu_env.NvmlInfo([healthy_nvml(0), healthy_nvml(1)], "550.54.15", "")
    assert nvml.missing == set()
    assert nvml.called == set(CALLS)


# What each call costs GPU 0 when it fails there: its fields left unknown in Telemetry's reading
# and in read_nvml's. The calls not listed fail for everything, below.
COSTS = {
    "nvmlDeviceGetName": ({"name": "?"}, {"name": "?"}),
    "nvmlDeviceGetUUID": ({"uuid": "", "mig_uuids": ()}, {"uuid": ""}),
    "nvmlDeviceGetUtilizationRates": ({"util": None, "mem_util": None}, {}),
    "nvmlDeviceGetMemoryInfo": ({"mem_used": None, "mem_total": None}, {"total": None, "free": None}),
    "nvmlDeviceGetTemperature": ({"temperature": None}, {}),
    "nvmlDeviceGetPowerUsage": ({"power": None}, {}),
    "nvmlDeviceGetClockInfo": ({"sm_clock": None}, {}),
    "nvmlDeviceGetCudaComputeCapability": ({}, {"compute_capability": None}),
    "nvmlDeviceGetMigMode": ({"mig_uuids": ()}, {}),
    "nvmlDeviceGetMaxMigDeviceCount": ({"mig_uuids": ()}, {}),
    "nvmlDeviceGetMigDeviceHandleByIndex": ({"mig_uuids": ()}, {}),
}
ERRORS = [NVMLError_GpuIsLost("GPU is lost"), RuntimeError("not an NVMLError")]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("call", CALLS)
def test_a_failing_call_costs_its_own_field_and_nothing_else(nvml, call, error):
    # MIG runs on card A: the MIG calls fail for it; every other per-GPU call fails for card B
    gpu = 1 if "Mig" in call else 0 if call in COSTS or call == "nvmlDeviceGetHandleByIndex" else None
    nvml.failing[call] = (error, gpu)
    telemetry = Telemetry()
    gpus = telemetry.read().gpus  # neither this nor read_nvml raises, whatever fails
    info = gpu_env.read_nvml()
    assert call in nvml.raised  # the failure really happened
    other = 1 - (gpu or 0)
    if call == "nvmlInit":
        assert (gpus, info.gpus) == ([], [])
        assert telemetry.nvml_error.startswith("no NVML") and info.error.startswith("no NVML (")
        return
    if call == "nvmlDeviceGetCount":
        assert (gpus, info.gpus) == ([], [])
        assert telemetry.nvml_error == f"NVML cannot count the GPUs: {type(error).__name__}: {error}"
        assert info.error.startswith("NVML cannot count the GPUs")
        return
    assert telemetry.nvml_error == info.error == ""
    if call == "nvmlDeviceGetHandleByIndex":  # no handle: that GPU is left out, the other still read
        assert (gpus, info.gpus) == ([healthy(1)], [healthy_nvml(1)])
        return
    assert (telemetry.driver, info.driver) == (("?", "?") if call == "nvmlSystemGetDriverVersion"
                                               else ("550.54.15", "550.54.15"))
    reading, nvml_costs = COSTS.get(call, ({}, {}))
    expected = [healthy(0), healthy(1)]
    expected[gpu or 0] = dataclasses.replace(expected[gpu or 0], **reading)
    expected_nvml = [healthy_nvml(0), healthy_nvml(1)]
    expected_nvml[gpu or 0] = dataclasses.replace(expected_nvml[gpu or 0], **nvml_costs)
    assert gpus == expected and info.gpus == expected_nvml
    assert gpus[other] == healthy(other)


def test_a_name_that_is_not_utf8_is_unknown(monkeypatch):
    cards = [dataclasses.replace(CARDS[0], name=b"Card \xff"), CARDS[1]]
    monkeypatch.setitem(sys.modules, "pynvml", stand_in(cards))
    assert [g.name for g in Telemetry().read().gpus] == ["?", "Card A"]
    assert [g.name for g in gpu_env.read_nvml().gpus] == ["?", "Card A"]


def test_auto_device_choice_survives_nvml_failing(nvml, monkeypatch):
    """hardware.device = "auto" reads NVML in the engine: a failing NVML means GPU 0, not a crash."""
    import torch

    from lmcockpit.core.hardware import device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(uuid=gpu_env.normalise_uuid(CARDS[i].uuid)))
    busy_b = [dataclasses.replace(CARDS[0], used=70), CARDS[1]]
    monkeypatch.setitem(sys.modules, "pynvml", stand_in(busy_b))
    assert device._most_free_gpu() == 1
    failing = stand_in(busy_b)
    failing.failing["nvmlDeviceGetMemoryInfo"] = (NVMLError_GpuIsLost("GPU is lost"), None)
    monkeypatch.setitem(sys.modules, "pynvml", failing)
    assert device._most_free_gpu() == 0


# ---------------------------------------------------------------------- the cockpit keeps going
def text(renderable) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


async def test_the_launch_screen_says_why_when_nvml_cannot_count_the_gpus(nvml, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    nvml.failing["nvmlDeviceGetCount"] = (NVMLError_GpuIsLost("GPU is lost"), None)
    app = CockpitApp(runs_root=tmp_path / "runs")  # the real Telemetry, on the stand-in
    async with app.run_test(size=(120, 40)) as pilot:
        assert isinstance(app.screen, LaunchScreen)
        hardware = str(app.screen.query_one("#hardware").render())
        assert "no GPU: CPU run" in hardware and "NVML cannot count the GPUs: NVMLError_GpuIsLost" in hardware
        await pilot.press("down", "p")
        assert app.is_running and isinstance(app.screen, LaunchScreen)
        assert app.screen.overrides == {}  # no GPUs to spread processes over


def run_started(*devices: str, uuids: tuple[str, ...] = ()) -> P.RunStarted:
    return P.RunStarted("runs/x", {}, 1_000_000, devices[0], "bf16", 0, 100, 4096, world=len(devices),
                        devices=devices, device_uuids=uuids)


class Dashboard(App):
    """The dashboard with no engine, fed events by the test; the real Telemetry, on the stand-in."""
    CSS_PATH = CockpitApp.CSS_PATH

    async def on_mount(self) -> None:
        await self.push_screen(DashboardScreen(None, "test", clock=lambda: 1000.0, telemetry=Telemetry()))


async def gpu_panels(pilot, dash: DashboardScreen, *events) -> list[tuple[str, str]]:
    """Sample telemetry, apply events, redraw: (title, text) of each GPU panel."""
    dash.sample_telemetry()
    dash.apply_events(list(events))
    dash.redraw()
    await pilot.pause()
    return [(p.border_title, text(p.body)) for p in dash.query(".gpu").results(Panel)]


async def test_the_dashboard_finds_the_run_s_gpu_by_uuid_and_goes_on_as_nvml_fails(nvml):
    app = Dashboard()
    async with app.run_test(size=(120, 40)) as pilot:
        dash = app.screen
        # cuda:0 is A, NVML's GPU 1: its panel, its figures
        [(title, shown)] = await gpu_panels(pilot, dash, run_started("cuda:0", uuids=(gpu_env.normalise_uuid(UUID_A),)))
        assert title == "GPU 1" and "Card A" in shown and "21%" in shown and "Card B" not in shown
        assert "2.0G / 80.0G" in text(dash.query_one("#memory", Panel).body)
        # the card stops answering for its utilisation and name: those fields only
        nvml.failing["nvmlDeviceGetUtilizationRates"] = (NVMLError_GpuIsLost("GPU is lost"), 1)
        nvml.failing["nvmlDeviceGetName"] = (RuntimeError("not an NVMLError"), 1)
        [(title, shown)] = await gpu_panels(pilot, dash)
        assert title == "GPU 1" and "21%" not in shown
        assert re.search(r"util +– ", shown) and re.search(r"name +\? ", shown), shown
        assert "2.0G / 80.0G" in text(dash.query_one("#memory", Panel).body)
        # then falls off the bus: no handle, so no reading; never another card's
        nvml.failing["nvmlDeviceGetHandleByIndex"] = (NVMLError_GpuIsLost("GPU is lost"), 1)
        [(title, shown)] = await gpu_panels(pilot, dash)
        assert title == "GPU" and "no reading of the run's GPU" in shown and "11%" not in shown
        # and the driver with it: no GPU count
        nvml.failing["nvmlDeviceGetCount"] = (NVMLError_GpuIsLost("GPU is lost"), None)
        [(title, shown)] = await gpu_panels(pilot, dash)
        assert "NVML cannot count the GPUs" in shown
        assert app.is_running and app.screen is dash


# --------------------------------------------------------------------------- the headless line
class Engine:
    """Hands the headless loop its events, then is done."""

    def __init__(self, events):
        self.events = list(events)

    @property
    def done(self) -> bool:
        return not self.events

    def poll(self, timeout: float):
        return self.events.pop(0)

    def join(self, timeout: float) -> None:
        pass


def headless_lines(*started: P.RunStarted) -> list[str]:
    """The live progress line after each event of a run that starts and takes a step."""
    events = [*started, P.StateChanged(P.RUNNING), P.StepMetrics(1, 5.0, 1e-3, 1.0, 1000.0, None, 0.1, 4096)]
    headless = Headless(Engine(events), log_every=10, console=Console(file=io.StringIO()))
    lines = []
    headless._loop(lambda: lines.append(headless.status_line()))
    return lines


def test_the_headless_line_shows_the_gpu_found_by_uuid(nvml):
    line = headless_lines(run_started("cuda:0", uuids=(gpu_env.normalise_uuid(UUID_A),)))[-1]
    assert line.startswith("step 1/100") and "GPU 21%" in line and "VRAM 2.1/85.9GB" in line
    # an older engine that sends no UUID: CUDA's numbering, cuda:0 read as NVML GPU 0
    assert "GPU 11%" in headless_lines(run_started("cuda:0"))[-1]


@pytest.mark.parametrize(("call", "gpu", "shown", "left_out"), [
    ("nvmlDeviceGetUtilizationRates", 1, ["VRAM 2.1/85.9GB"], ["GPU "]),
    ("nvmlDeviceGetMemoryInfo", 1, ["GPU 21%"], ["VRAM"]),
    ("nvmlDeviceGetCount", None, [], ["GPU ", "VRAM"]),
])
def test_the_headless_line_goes_on_without_what_nvml_will_not_say(nvml, call, gpu, shown, left_out):
    nvml.failing[call] = (RuntimeError("not an NVMLError"), gpu)
    line = headless_lines(run_started("cuda:0", uuids=(gpu_env.normalise_uuid(UUID_A),)))[-1]
    assert line.startswith("step 1/100") and "loss 5.0000" in line
    assert all(field in line for field in shown) and not any(field in line for field in left_out), line


# ------------------------------------------------------------------------------- UUID mapping
NVML_GPUS = [healthy(0), healthy(1)]
A, B, M = (gpu_env.normalise_uuid(u) for u in (UUID_A, UUID_B, MIG_A))


@pytest.mark.parametrize(("devices", "uuids", "visible", "expected"), [
    (("cuda:0",), (A,), None, [1]),  # CUDA's first GPU is NVML's second
    (("cuda:0", "cuda:1"), (A, B), None, [1, 0]),
    (("cuda:0",), (A.upper(),), "0", [1]),  # the UUID wins over CUDA_VISIBLE_DEVICES's arithmetic
    (("cuda:0",), (M,), f"{MIG_A}", [1]),  # a MIG instance: the GPU it is carved from
    (("cuda:0",), ("dddddddd-0000",), None, []),  # a UUID NVML does not list: no guess
    (("cuda:0",), (), "GPU-aaaa", [1]),  # no UUID from the engine: CUDA_VISIBLE_DEVICES's, by prefix
    (("cuda:0",), (), MIG_A, [1]),
    (("cuda:0", "cuda:1"), (), f"{UUID_A},{UUID_B}", [1, 0]),
    (("cuda:0", "cuda:1"), ("",), None, [0, 1]),  # none known: CUDA index N is NVML GPU N
    (("cuda:1",), (), "2,0", [0]),
    (("cpu",), ("",), None, []),
])
def test_a_run_s_devices_are_found_among_nvml_s_gpus_by_uuid(devices, uuids, visible, expected):
    assert run_gpu_indices(devices, visible, uuids, NVML_GPUS) == expected


def test_without_readings_a_known_uuid_names_no_gpu_and_an_unknown_one_falls_back():
    assert nvml_index("cuda:0", None, A, []) is None
    assert nvml_index("cuda:0", "GPU-aaaa", "", []) == 0
    assert nvml_index("cuda:1", "3,2", "", []) == 2


def test_the_doctor_and_the_presets_command_say_what_nvml_would_not(nvml, capsys):
    from lmcockpit.tui.commands import doctor, presets

    nvml.failing["nvmlDeviceGetMemoryInfo"] = (NVMLError_GpuIsLost("GPU is lost"), None)
    lines = doctor.gpu_lines_from_nvml(gpu_env.read_nvml())
    assert [(c.what, c.detail) for c in lines] == [("GPU 0", "Card B, memory unknown (from NVML)"),
                                                   ("GPU 1", "Card A, memory unknown (from NVML)")]
    assert presets.main([]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "NVML will not say the GPU's memory: each preset is judged against the GPU class it was sized for" in out

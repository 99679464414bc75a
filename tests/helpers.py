"""Helpers the test files share: plain functions, classes and constants (fixtures are in
conftest.py). A test file imports what it needs from here, never from another test file
(tests/test_layout.py holds that).

Importing this module imports no torch: tests/test_cockpit.py's torch-free front-end imports it."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http.client
import io
import json
import math
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
from textual.app import App

from lmcockpit.core import protocol as P
from lmcockpit.core.config import Config, DataConfig, load_config
from lmcockpit.core.data import build, readers, sources, spool
from lmcockpit.core.hardware import cpu_precision
from lmcockpit.core.hardware.telemetry import GPUReading, ProcessLoad, Reading, Telemetry
from lmcockpit.core.process import host, live
from lmcockpit.core.process.viewer import RunViewer
from lmcockpit.core.run.folder import create_run_dir, read_metrics
from lmcockpit.tui.app import CockpitApp
from lmcockpit.tui.runplan import RunPlan
from lmcockpit.tui.screens.dashboard import DashboardScreen

from . import cli_zygote


# ------------------------------------------------------------------------------------ tiny runs
# Small everywhere: a 1 MB slice of the stdlib, a 512-token BPE, a 2-layer model of width 64.
TINY = [
    "training.max_steps=12", "training.log_every=4", "eval.every=6", "eval.batches=2",
    "sample.prompts=[]", "checkpoint.keep=2", "hardware.device=\"cpu\"",
    "eval.tasks=[]",  # the cpu preset's python-functions costs a run ~2 s; trained_run and test_tasks score it
]


PINNED_FP32 = cpu_precision.Verdict("fp32", why="pinned by the test suite")


@contextlib.contextmanager
def cpu_verdict(verdict: cpu_precision.Verdict | None):
    """This CPU's cached verdict is `verdict` (None: none, so the next "auto" run probes) for the
    block, the suite's pinned fp32 again after it."""
    path = cpu_precision.cache_path()
    if verdict is None:
        path.unlink(missing_ok=True)
    else:
        cpu_precision.store(verdict)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        cpu_precision.store(PINNED_FP32)


def tiny_config(*overrides: str) -> Config:
    cfg, _ = load_config("debug", [*TINY, *overrides])
    return cfg


# The cpu preset shrunk to the debug preset's sizes; everything else (compile on) stays as shipped.
SHRINK_CPU = [
    "model.n_layer=2", "model.d_model=64", "model.mlp_hidden=0", "model.max_seq_len=64", "training.seq_len=64",
    "training.micro_batch_size=8", "data.max_bytes=1_000_000", "tokenizer.vocab_size=512",
    "tokenizer.train_bytes=300_000", "sample.max_new_tokens=16",
    # Qwen3 has no value embeddings or U-net skips, and the export, harness and chat tests export these
    # runs: the preset's other options stay (test_presets trains all of them); its 128-then-256
    # context does not fit a context of 64.
    "model.value_embeds=0", "model.unet_skips=false", "training.seq_len_schedule=[]",
]


def shrunk_cpu(*extra: str):
    cfg, _ = load_config("cpu", [*SHRINK_CPU, *TINY, "training.compile=false", "eval.every=0", *extra])
    return cfg


def drive_engine(cfg: Config, run_dir: Path, on_event=None, timeout: float = 300, resume=None, queued=(),
                 on_start=None, set_up_then=()):
    """Run the real engine process to its end; returns (engine, every event in order).
    `on_event(engine, event)` may send commands as events arrive; `queued` commands wait for the
    engine before it starts: it takes them before its first step, but an Abort among them ends the
    run while it is set up (the data prepared, the model built); `set_up_then` commands reach it once
    it is set up, before its first step (a Pause queued, then these when it says it paused).
    `on_start(engine)` runs the moment it has started. `resume`: a resume.ResumePlan, whose run
    folder and checkpoint are used."""
    from lmcockpit.core.process.runner import EngineProcess

    if resume is not None:
        cfg, run_dir = resume.cfg, resume.run_dir
    else:
        run_dir = create_run_dir(cfg, "test", str(run_dir))
    engine = EngineProcess(cfg, run_dir, resume.checkpoint if resume is not None else None)
    for command in [*queued, *([P.Pause()] if set_up_then else [])]:
        engine.commands.put(command)
    engine.start()
    if on_start:
        on_start(engine)
    events = []
    deadline = time.monotonic() + timeout
    try:
        while not engine.done:
            assert time.monotonic() < deadline, f"engine did not finish in {timeout}s"
            ev = engine.poll(timeout=0.5)
            if ev is not None:
                events.append(ev)
                if set_up_then and isinstance(ev, P.StateChanged) and ev.state == P.PAUSED:
                    for command in set_up_then:
                        engine.send(command)
                    set_up_then = ()
                if on_event:
                    on_event(engine, ev)
    finally:
        engine.join(timeout=60)  # it exits on its own right after its last event
        engine.kill()  # only if a failed assertion left it running
        engine.join(timeout=30)
    return engine, events


def ema(values: list[float], beta: float = 0.9) -> list[float]:
    """The bias-corrected EMA a chart draws, computed whole: what the history's running one must equal."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i))
    return out


def losses(events) -> list[float]:
    return [e.loss for e in events if isinstance(e, P.StepMetrics)]


# ----------------------------------------------------------------------------- the real command
def cli(*args: str, cwd: Path | None = None, timeout: float = 300, env: dict[str, str] | None = None,
        input: str | None = None, environ: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The real `lmcockpit` command, piped (so plain lines), as a user runs it, in a process of its own
    (forked from one that imported the front-end once: tests/cli_zygote.py); `env` adds to the
    environment (`NO_GPU` hides every GPU from it and the engine it starts), `environ` is the whole of
    it; `input` is its stdin."""
    whole = environ if environ is not None else {**os.environ, **env} if env else None
    if whole is not None and _new_interpreter(whole):
        return subprocess.run([sys.executable, "-m", "lmcockpit.tui.cli", *args], cwd=cwd, capture_output=True,
                              text=True, timeout=timeout, env=whole, input=input)
    return cli_zygote.run(list(args), cwd, whole, timeout, input)


def _new_interpreter(env: dict[str, str]) -> bool:
    """PYTHON* variables are read as an interpreter starts: a command with others than ours needs a new one."""
    return any(k.startswith("PYTHON") and env.get(k) != os.environ.get(k) for k in {*env, *os.environ})


# CUDA numbers only the GPUs CUDA_VISIBLE_DEVICES lists: empty, torch sees none. Tests that mean "a
# machine without a GPU" run their processes with it, so they hold on a machine with GPUs too.
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def as_flags(overrides: list[str]) -> list[str]:
    return [a for s in overrides for a in ("--set", s)]


def cli_popen(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None
              ) -> subprocess.Popen | cli_zygote.Forked:
    """The real `lmcockpit` command started, piped, for a test to read and signal as it runs (as
    subprocess.Popen(..., stdout=PIPE, stderr=PIPE, text=True)); forked as cli() forks it. Its engine
    is not its child but the shared forkserver's: `engine_of(run)` finds it."""
    whole = {**os.environ, **env} if env else None
    if whole is not None and _new_interpreter(whole):
        return subprocess.Popen([sys.executable, "-m", "lmcockpit.tui.cli", *args], cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=whole)
    return cli_zygote.Forked(list(args), cwd, whole)


def engine_of(run: Path) -> psutil.Process:
    """The engine training in run folder `run`: the pid it wrote into the folder's lock as it took it."""
    from lmcockpit.core.run.folder import LOCK

    wait_until(lambda: (run / LOCK).exists() and (run / LOCK).read_text().strip(), 60, "the engine's lock")
    return psutil.Process(int((run / LOCK).read_text()))


def start_cli_run(out: Path, *overrides: str, until: str = "step 4/", session: bool = False,
                  env: dict[str, str] | None = None) -> subprocess.Popen | cli_zygote.Forked:
    """A long tiny run through the real CLI, piped; returns once it printed a line starting with
    `until` (so training is really under way), the rest of its output still to be read. `session`:
    in a process group of its own, as a terminal's job is (its leader's pid is the group's): a
    process of its own with its own forkserver, which a signal to the group reaches too. `env` adds to
    the environment, as cli()'s does."""
    args = ["--run", "debug", *as_flags([*TINY, "training.max_steps=100000", "eval.every=0", *overrides]),
            "--out", str(out)]
    if session:
        proc = subprocess.Popen([sys.executable, "-m", "lmcockpit.tui.cli", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True,
                                env={**os.environ, **(env or {})})
    else:
        proc = cli_popen(*args, env=env)
    for line in proc.stdout:
        if line.startswith(until):
            break
    return proc


# The trained_run fixture's command (test_cli runs it again to compare).
TRAINED_RUN = ("--run", "cpu", *as_flags([*SHRINK_CPU, *TINY, "sample.prompts=[\"def \"]", "checkpoint.every=6",
                                          "eval.tasks=[\"python-functions\"]"]))


def trained_cache(run: Path) -> Path:
    """The token cache folder (as under $XDG_CACHE_HOME/lmcockpit) the trained_run fixture's `run` was
    made with: its own, since the run is every test worker's."""
    return run.parent / "xdg-cache" / "lmcockpit"


# A small corpus and a BPE that trains in a second: the build is what is under test, not its size.
QUICK_BUILD = ["tokenizer.vocab_size=300", "tokenizer.train_bytes=20_000", "data.workers=1", "data.val_fraction=0.2"]


def engines_of(pid: int) -> list[psutil.Process]:
    """The engines (and chat engines) front-end process `pid` started: forks of its forkserver
    (core/process/warm_start.py), the processes the forkserver's children are."""
    servers = [c for c in psutil.Process(pid).children() if "multiprocessing.forkserver" in " ".join(c.cmdline())]
    return [engine for server in servers for engine in server.children()]


def as_set(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def one_error(proc, *words: str) -> str:
    """The command's one `error:` line, after checking it failed as a user mistake should."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


# ------------------------------------------------------------------------ a real terminal
class Terminal:
    """The real `lmcockpit` command on a pseudo-terminal of `size` (columns, rows), as a user types
    at it (Ctrl-C, Ctrl-D included); `env` adds to its environment."""

    def __init__(self, *args: str, size: tuple[int, int] = (80, 24), env: dict[str, str] | None = None):
        import fcntl
        import pty
        import struct
        import termios

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the real command, with the terminal as its controlling tty
            try:
                fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
                os.execve(sys.executable, [sys.executable, "-m", "lmcockpit.tui.cli", *args],
                          {**os.environ, **(env or {})})
            finally:
                os._exit(127)
        self.seen = ""

    def expect(self, text: str, timeout: float = 120) -> str:
        """Read until `text` has appeared after what earlier calls consumed; returns what came."""
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"no {text!r} in {timeout}s: {self.seen[-400:]!r}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    self.seen += os.read(self.fd, 4096).decode(errors="replace")
                except OSError:  # the command has ended (EIO on Linux)
                    assert text in self.seen, f"ended before {text!r}: {self.seen[-400:]!r}"
        head, _, self.seen = self.seen.partition(text)
        return head + text

    def read(self, at_least: int, timeout: float = 60) -> str:
        """Read until at least that many more characters came; returns them."""
        deadline, start = time.monotonic() + timeout, len(self.seen)
        while len(self.seen) - start < at_least:
            left = deadline - time.monotonic()
            assert left > 0, f"only {self.seen[start:]!r} in {timeout}s"
            if select.select([self.fd], [], [], left)[0]:
                self.seen += os.read(self.fd, 4096).decode(errors="replace")
        got, self.seen = self.seen[start:], ""
        return got

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait_blocked_reading(self, timeout: float = 30) -> None:
        """Wait until the command's main thread sleeps in select(), where readline waits for keys.
        A Ctrl-C that lands in the moment between readline printing the prompt and its select()
        is not acted on until Enter (CPython's readline checks for signals only when select() is
        interrupted); a person cannot type that fast, a test can."""
        deadline = time.monotonic() + timeout
        while not Path(f"/proc/{self.pid}/wchan").read_text().startswith("poll_schedule_timeout"):
            assert time.monotonic() < deadline, "the command never waited for input"
            time.sleep(0.01)  # polling the state waited for, not standing in for it

    def end(self, timeout: float = 30) -> tuple[int, str]:
        """(exit code, everything it printed after the last expect) once it has exited."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"still running after {timeout}s: {self.seen[-400:]!r}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:
                    data = b""
                if not data:
                    break
                self.seen += data.decode(errors="replace")
        _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status), self.seen

    def close(self) -> None:
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            if os.waitpid(self.pid, os.WNOHANG) == (0, 0):
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)


# ---------------------------------------------------------------------------------- a full disk
def fill(disk: Path, *appended: Path) -> Path:
    """A file that takes every byte left on `disk`; delete it to free them. Each of `appended` (a
    log another process appends to) gets empty lines to the end of its last block, which would
    take a few more lines of text before the disk said it is full."""
    filler = disk / "filler"
    for path, chunk in ((filler, bytes(1 << 16)), *((p, b"\n") for p in appended)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            while os.write(fd, chunk):
                pass
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        finally:
            os.close(fd)
    return filler


# -------------------------------------------------------------- runs training in the background
def wait_until(condition, timeout: float = 120, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # polling the state waited for, not standing in for it
    return value


def steps(run: Path) -> list[dict]:
    return read_metrics(run, "step") if (run / "metrics.jsonl").is_file() else []


def last_step(run: Path) -> int:
    rows = steps(run)
    return rows[-1]["step"] if rows else 0


def stop(run: Path, timeout: float = 120) -> None:
    """Whatever a test left training ends here, its host gone."""
    record = live.LiveRecord.read(run)
    if record is None or not live.alive(record.pid):
        return
    viewer = RunViewer(run)
    viewer.send(P.Abort(save=False))
    viewer.join(timeout)
    viewer.close()
    assert not live.alive(record.pid), "the run host did not end"


def detached(tmp_path: Path, name: str, *extra: str) -> Path:
    cfg = shrunk_cpu("training.max_steps=100000", "training.log_every=1", *extra)
    run = create_run_dir(cfg, "cpu", str(tmp_path / name))
    host.start(run, label="cpu")
    return run


def run_server(run: Path) -> host.RunServer:
    """A run host's server on `run`, with the live.json that points viewers to it: the host's
    socket and handshake for real, without an engine behind them."""
    (run / "train.log").touch()
    server = host.RunServer(run, on_command=lambda c: None, log=lambda text: None, run=host.run_so_far(run))
    live.LiveRecord(str(run.resolve()), os.getpid(), socket.gethostname(), str(server.path)).write()
    return server


# -------------------------------------------------------------------- the cockpit through Pilot
def request(tmp_path: Path, *extra: str) -> RunPlan:
    cfg = shrunk_cpu(*extra)
    return RunPlan(cfg, create_run_dir(cfg, "cpu", str(tmp_path / "run")), None, "cpu")


async def wait_for(pilot, condition, timeout: float = 90.0, what: str = "condition") -> None:
    """Let the app run until `condition()` holds (a synchronisation on state, not a guess)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.05)


async def budget_counted(launch) -> None:
    """Until the launch screen shows the token budget of the settings it shows (counted in a
    thread; a count for settings replaced meanwhile is dropped, and never sets this)."""
    await asyncio.wait_for(launch.counted.wait(), timeout=60)


def screen_lines(app) -> list[str]:
    """The screen as the terminal shows it, a string per row: what the snapshot SVGs draw."""
    from rich.console import Console

    width, height = app.size
    console = Console(width=width, height=height, record=True, file=io.StringIO(), legacy_windows=False,
                      safe_box=False)
    console.print(app.screen._compositor.render_update(full=True))
    return console.export_text().splitlines()


def shown_in(app, widget) -> list[str]:
    """The screen's rows within `widget`'s region: what of the widget the user really sees (a
    table cell cropped by the widget's edge, or scrolled out of it, is not there)."""
    x, y, width, height = widget.region
    return [line[x:x + width] for line in screen_lines(app)[y:y + height]]


def dashboard(app) -> DashboardScreen:
    assert isinstance(app.screen, DashboardScreen), app.screen
    return app.screen


# ------------------------------------------------------- the dashboard fed a fixed event stream
GiB = 2**30


H100_UUID = "GPU-5f1c2d3e-0000-4a4a-9b9b-0123456789ab"


TASK_ACCURACY = {100: 0.30, 200: 0.38, 300: 0.43}  # python-functions' (chance 0.25) at each scoring


def task_scores(accuracy: float, chance: float = 0.25, items: int = 66) -> dict[str, float]:
    """A task's entry in EvalMetrics.tasks, centred as the engine centres it."""
    return {"accuracy": accuracy, "centered": (accuracy - chance) / (1 - chance), "items": items}


def fixed_events(device: str = "cpu", tasks: bool = False, target: float = 0.0, run: str = "") -> list[object]:
    """A run at step 240 of 400 with two evaluations and a checkpoint; on `device` ("cpu" or
    "cuda:0": bf16, MFU and allocator figures as the engine reports them on a GPU). With `tasks`,
    as the cpu preset: at step 300, each of its three evaluations scoring python-functions. With
    `target` (training.target_val_loss, at $2.50 an hour), evaluations every 50 steps, enough to
    forecast it. `run`: its folder, if not runs/cpu-20261123-120000 (or h100-...). Each step says
    where its time went (its parts, and the work since the step before), as a run with the step
    clock does."""
    gpu = device.startswith("cuda")
    run = run or f"runs/{'h100' if gpu else 'cpu'}-20261123-120000"
    tokens_per_step = 524_288 if gpu else 4096
    config = {"sample": {"max_new_tokens": 48}}
    if tasks:
        config["eval"] = {"every": 100, "tasks": ["python-functions"], "tasks_every": 0,
                          "references": {"hellaswag": {"GPT-2 124M": 0.2955}}}  # as gpt2-fineweb names it
    if target:
        config |= {"training": {"target_val_loss": target}, "hardware": {"cost_per_hour": 2.5}}
    events: list[object] = [
        P.StateChanged(P.PREPARING),
        P.LogLine("data: reusing token cache ~/.cache/lmcockpit/9f7e97d0744113f743ad"),
        P.LogLine("model: 5,245,696 parameters, 4 layers, d_model 256, 4 heads / 2 kv heads"),
        P.RunStarted(run, config, 5_245_696, device, "bf16" if gpu else "fp32", 0, 400,
                     tokens_per_step, devices=(device,), device_uuids=(H100_UUID,) if gpu else ("",)),
        P.StateChanged(P.RUNNING),
    ]
    mem = {"allocated": 21 * GiB, "reserved": 30 * GiB, "peak": 28 * GiB} if gpu else {}
    every = 50 if target else 100
    # Each step's seconds by part, adding up to its dt: forward+backward 70% on the GPU, 78% on the CPU.
    parts = ({"data": 0.00003, "compute": 0.56, "sync": 0.00002, "optimizer": 0.23995} if gpu
             else {"data": 0.016, "compute": 0.64, "sync": 0.00001, "optimizer": 0.16399})
    for step in range(1, fixed_last_step(tasks) + 1):
        loss = 3.2 + 5.8 * math.exp(-step / 40) + 0.15 * math.sin(step / 3)
        lr = 0.006 * min(1.0, step / 20) * (0.55 + 0.45 * math.cos(math.pi * step / 400))
        dt = 0.8 if gpu else 0.82
        # the work since the step before: an evaluation (with its task scores), the checkpoint at 200
        between = {"evaluation": 0.9} if step > 1 and (step - 1) % every == 0 else {}
        if tasks and step > 1 and (step - 1) % 100 == 0:
            between["tasks"] = 2.4
        if step == 201:
            between["checkpoints"] = 1.1
        events.append(P.StepMetrics(step, loss, lr, 0.5, tokens_per_step / dt, 0.41 if gpu else None, dt,
                                    step * tokens_per_step, mem, parts, between))
        if step % every == 0:
            scores = {"python-functions": task_scores(TASK_ACCURACY[step])} if tasks and step % 100 == 0 else {}
            events.append(P.EvalMetrics(step, loss + 0.2, (loss + 0.2) / 2.4, scores))
            events.append(P.StateChanged(P.RUNNING))
    events += [P.CheckpointWritten(200, f"{run}/checkpoints/step_000200"),
               P.LogLine(f"checkpoint: step 200 written to {run}/checkpoints/step_000200")]
    return events


def fixed_last_step(tasks: bool) -> int:
    return 300 if tasks else 240


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
    clock stands still; with `gpus`, stand-in telemetry (0: a CPU machine's); with `tasks`, the
    run scores python-functions; `target` and `run` as fixed_events takes them."""
    CSS_PATH = CockpitApp.CSS_PATH

    def __init__(self, then: list[object] = (), device: str = "cpu", gpus: int | None = None,
                 tasks: bool = False, target: float = 0.0, run: str = "") -> None:
        super().__init__()
        self.then = list(then)
        self.device = device
        self.tasks = tasks
        self.target, self.run_dir = target, run
        self.telemetry = StandInTelemetry(gpus) if gpus is not None else None

    async def on_mount(self) -> None:
        screen = DashboardScreen(None, "cpu" if self.device == "cpu" else "h100", clock=lambda: 1000.0,
                                 telemetry=self.telemetry)
        screen.run_pid = 4242  # read by the stand-in telemetry only
        await self.push_screen(screen)
        if self.telemetry is not None:  # a full utilisation history, so the 1 Hz sampling changes nothing
            for _ in range(120):
                screen.sample_telemetry()
        screen.apply_events(fixed_events(self.device, self.tasks, self.target, self.run_dir) + self.then)
        screen.redraw()


# --------------------------------------------------------------------------------- data sources
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing "
         "matches near rivers of molten copper and ünïcode glyphs").split()


def records(n: int, seed: int = 0, words: int = 60) -> list[str]:
    rng = random.Random(seed)
    return [f"record {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(words // 2, words)))
            for i in range(n)]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def documents(source: str | Path, **data) -> list[readers.Document]:
    """Every document of the source's pieces as a build plans and reads them (a large compressed
    file's through spools)."""
    cfg = DataConfig(source=str(source), **data)
    planned = build.plan(cfg, sources.list_source(cfg))
    with tempfile.TemporaryDirectory() as spools:
        return [d for p, s in spool.spooled(planned.pieces, lambda p: p, Path(spools))
                for d in readers.read_piece(p, cfg.text_field, lambda _: True, s)]


def texts_of(source, **data) -> list[str]:
    return [d.text for d in documents(source, **data)]


# ------------------------------------------------------------------------------- a CORE bundle
def write_bundle(folder: Path, yaml_text: str | None = None, baselines: str | None = None,
                 lines: dict[str, list] | None = None) -> Path:
    """A bundle of CORE's layout with three tasks, one of each kind, as nanochat reads it."""
    (folder / "eval_data" / "lm").mkdir(parents=True, exist_ok=True)
    (folder / "core.yaml").write_text(yaml_text if yaml_text is not None else textwrap.dedent("""\
        icl_tasks:
        - label: tiny_mc
          dataset_uri: tiny_mc.jsonl
          num_fewshot: [1]
          icl_task_type: multiple_choice
          continuation_delimiter: " "
        - label: tiny_schema
          dataset_uri: tiny_schema.jsonl
          num_fewshot: [0]
          icl_task_type: schema
        - label: tiny_lm
          dataset_uri: lm/tiny_lm.jsonl
          num_fewshot: [0]
          icl_task_type: language_modeling
          continuation_delimiter: ""
        """))
    (folder / "eval_meta_data.csv").write_text(baselines if baselines is not None else
                                               "Eval Task,Task Category,Random baseline\ntiny_mc,x,25\n"
                                               "tiny_schema,x,50\ntiny_lm,x,0\n")
    data = {
        "tiny_mc.jsonl": [{"query": f"Q{i}:", "choices": ["yes", "no", "maybe", "never"], "gold": i % 4} for i in range(6)],
        "tiny_schema.jsonl": [{"context_options": ["The cat", "The dog"], "continuation": "barked.", "gold": 1}] * 3,
        "lm/tiny_lm.jsonl": [{"context": "import os  ", "continuation": "\nimport sys"}],
    } | (lines or {})
    for name, rows in data.items():
        (folder / "eval_data" / name).write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                                                         for r in rows))
    return folder


# ----------------------------------------------------------------------- checkpoints and memory
SHIPPED = "step_000006"


def model_and_optimizers(ckpt: Path):
    """The model and optimizers the trainer builds for this checkpoint's config, on the CPU."""
    import torch

    from lmcockpit.core.model.gpt import GPT, shape_from_config
    from lmcockpit.core.run.checkpoint_folder import checkpoint_config
    from lmcockpit.core.train.optim import build_optimizers

    cfg = checkpoint_config(ckpt)
    model = GPT(shape_from_config(cfg))
    return model, build_optimizers(model, cfg.optimizer, torch.device("cpu"), "fp32")


def cpu_bytes_held(fn) -> int:
    """The most bytes `fn` holds at once beyond what existed when it began: the CPU allocator's
    events, in the order the profiler saw them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # Every allocation and free is a "[memory]" event in the raw results (the summarised
    # prof.events() attributes some to their op and drops them).
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = held = 0
    for e in events:
        live += e.nbytes()
        held = max(held, live)
    return held


# -------------------------------------------------------------------------------------- the Hub
def hub_env(home: Path, endpoint: str, **extra: str) -> dict[str, str]:
    """The environment a user's command has: this Hub, a Hub cache of its own, no token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "TRANSFORMERS_OFFLINE"}
    return {**env, "HF_ENDPOINT": endpoint, "HF_HOME": str(home), **extra}


# --------------------------------------------- HTTP: notification targets and `lmcockpit serve`
@dataclass
class Received:
    path: str
    headers: Message
    body: bytes
    at: float  # time.monotonic() on arrival
    method: str = "POST"

    def json(self):
        def refuse(constant):
            raise ValueError(f"{constant} is not JSON")
        return json.loads(self.body, parse_constant=refuse)  # strict, as a JavaScript receiver reads it


class Server:
    """A real HTTP server that records each request and answers with the next of `answers` (then
    200), a status or (status, headers); with `hold`, each answer waits until that event is set, as
    a hung server does. `answer(handler)`, when given, writes each response instead."""

    def __init__(self, answers=(), hold: threading.Event | None = None, answer=None):
        self.received: list[Received] = []
        self.cond = threading.Condition()
        self.stopped = threading.Event()  # what an `answer` that never ends waits on
        self.answers, self.hold = list(answers), hold
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with server.cond:
                    server.received.append(Received(self.path, self.headers, body, time.monotonic(), self.command))
                    status = server.answers.pop(0) if server.answers else 200
                    server.cond.notify_all()
                if answer is not None:
                    answer(self, server.stopped)
                    return
                if server.hold is not None:
                    server.hold.wait(60)
                status, headers = status if isinstance(status, tuple) else (status, {})
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_PUT = do_POST  # where a followed redirect would arrive, whatever its method

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # polled often: shutdown() waits for the next poll
        threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True).start()

    def wait_for(self, n: int, timeout: float = 10) -> list[Received]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.received) >= n, timeout), \
                f"{len(self.received)} requests after {timeout} s, expected {n}"
            return list(self.received)

    def stop(self):
        self.stopped.set()
        if self.hold is not None:
            self.hold.set()
        self.httpd.shutdown()
        self.httpd.server_close()


NO_PROXY = {"no_proxy": "*", "NO_PROXY": "*"}  # a proxy in the environment would take 127.0.0.1's posts elsewhere


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVE = [sys.executable, "-m", "lmcockpit.tui.cli", "serve"]


class Served:
    """`lmcockpit serve ARGS` (or `program` ARGS) running in `cwd`, its stdout and stderr read as they come."""

    def __init__(self, *args: str, cwd: Path, env: dict[str, str] | None = None, program: list[str] = SERVE):
        # A session of its own: cleanup can end the server and every cockpit it started, and nothing else.
        self.proc = subprocess.Popen([*program, *args], cwd=cwd,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True, env={**os.environ, **(env or {})})
        self.out, self.err, self.closed = [], [], 0
        self.changed = threading.Condition()
        self.readers = [threading.Thread(target=self._read, args=(stream, into), daemon=True)
                        for stream, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    def _read(self, stream, into: list[str]) -> None:
        for line in stream:
            with self.changed:
                into.append(line)
                self.changed.notify_all()
        with self.changed:
            self.closed += 1  # at 2, both streams have ended: it has exited, nothing more will come
            self.changed.notify_all()

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def printed(self) -> re.Match:
        """The URL it printed (on TCP): its path (base, the cockpit's own) and its token."""
        found = re.search(r":\d+(/(?:[0-9a-f]+/)?)\?token=([0-9a-f]+) ", self.stdout)
        assert found, f"no URL with a token in {self.stdout!r}"
        return found

    @property
    def base(self) -> str:
        """The path everything is served under (on TCP)."""
        return self.printed()[1]

    @property
    def token(self) -> str:
        """The token in the URL it printed (on TCP)."""
        return self.printed()[2]

    def expect(self, text: str, timeout: float = 60, stderr: bool = False) -> None:
        """Wait until `text` has come on stdout (on stderr with `stderr`)."""
        def seen() -> bool:
            return text in (self.stderr if stderr else self.stdout)
        with self.changed:
            if not self.changed.wait_for(lambda: seen() or self.closed == 2, timeout):
                raise AssertionError(f"no {text!r} in {timeout}s: {self.stdout[-600:]!r} {self.stderr[-600:]!r}")
        assert seen(), f"exited ({self.proc.wait()}) before {text!r}: {self.stderr[-1500:]!r}"

    def cockpits(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.NoSuchProcess):
            return psutil.Process(self.proc.pid).children()  # each cockpit is the server's own child
        return []

    def wait(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        for reader in self.readers:
            reader.join(timeout=10)
        return code

    def close(self) -> None:
        """Stop it as Ctrl-C would, then make sure: the server and whatever it started."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # its session: the cockpits and their engines too
        self.proc.wait()


def http_get(where: int | str, path: str = "/", headers: dict[str, str] | None = None) -> list:
    """GET `path` from a port on 127.0.0.1 (an int) or a Unix socket (its path), as curl would:
    [status, headers, body], JSON-able, so another account's call (other_account.py) can return it."""
    connection = http.client.HTTPConnection("127.0.0.1" if isinstance(where, int) else "localhost",
                                            where if isinstance(where, int) else 8000, timeout=30)
    try:
        if isinstance(where, str):
            connection.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connection.sock.settimeout(30)
            connection.sock.connect(where)
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        return [response.status, dict(response.getheaders()), response.read().decode()]
    finally:
        connection.close()


def token_cookie(port: int, served: Served, host: str | None = None) -> str:
    """The cookie the server gives in exchange for the token in the page's URL, as `name=value`."""
    status, headers, _ = http_get(port, f"{served.base}?token={served.token}", {"Host": host} if host else None)
    assert status == 303, status
    return headers["Set-Cookie"].split(";")[0]


WEBSOCKET = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
             "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}

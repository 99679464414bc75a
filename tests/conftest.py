"""Shared fixtures: an isolated cache, tiny configs, and helpers that drive the real engine."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.config import Config, load_config
from lmcockpit.core.hardware import cpu_precision
from lmcockpit.core.run.folder import create_run_dir

# Small everywhere: a 1 MB slice of the stdlib, a 512-token BPE, a 2-layer model of width 64.
TINY = [
    "training.max_steps=12", "training.log_every=4", "eval.every=6", "eval.batches=2",
    "sample.prompts=[]", "checkpoint.keep=2", "hardware.device=\"cpu\"",
    "eval.tasks=[]",  # the cpu preset's python-functions costs a run ~2 s; trained_run and test_tasks score it
]


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory) -> Path:
    """Every test (and every engine process they start) shares one token cache of its own."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    # The registry of runs training in the background (core/process/live.py): the tests' own.
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("xdg-state"))
    # precision "auto" on a CPU is what a probe measured on it (cpu_precision): the suite pins
    # fp32, so every test trains the same on any CPU; tests/test_cpu_precision.py probes for real.
    cpu_precision.store(PINNED_FP32)
    return cache / "lmcockpit"


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


@pytest.fixture(autouse=True)
def no_run_left_training():
    """A run started through a host outlives the cockpit that started it, by design: a test that
    leaves one training would slow every test after it. Stopped here, and the test fails naming it."""
    from lmcockpit.core.process import live

    before = {r.run_dir for r in live.live_runs()}
    yield
    left = [r for r in live.live_runs() if r.run_dir not in before]
    for run in left:
        if run.live:
            from lmcockpit.core.process.viewer import RunViewer

            viewer = RunViewer(run.run_dir)
            viewer.send(P.Abort(save=False))
            viewer.join(120)
            viewer.close()
        live.forget(run.run_dir)
    assert not [r for r in left if r.live], f"left training in the background: {[str(r.run_dir) for r in left]}"


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A filesystem of its own, 32 MB (a tmpfs), for a test to fill: the full disk the engine meets
    is the kernel's, not one made up. Mounting it takes root, which CI has (it installs Chromium)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a disk to fill needs root, to mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], capture_output=True)


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


def tiny_config(*overrides: str) -> Config:
    cfg, _ = load_config("debug", [*TINY, *overrides])
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


def cli(*args: str, cwd: Path | None = None, timeout: float = 300, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess:
    """The real `lmcockpit` command, piped (so plain lines), as a user runs it; `env` adds to the
    environment (`NO_GPU` hides every GPU from it and the engine it starts)."""
    return subprocess.run([sys.executable, "-m", "lmcockpit.tui.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **env} if env else None)


# CUDA numbers only the GPUs CUDA_VISIBLE_DEVICES lists: empty, torch sees none. Tests that mean "a
# machine without a GPU" run their processes with it, so they hold on a machine with GPUs too.
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


# The cpu preset shrunk to the debug preset's sizes; everything else (compile on) stays as shipped.
SHRINK_CPU = [
    "model.n_layer=2", "model.d_model=64", "model.mlp_hidden=0", "model.max_seq_len=64", "training.seq_len=64",
    "training.micro_batch_size=8", "data.max_bytes=1_000_000", "tokenizer.vocab_size=512",
    "tokenizer.train_bytes=300_000", "sample.max_new_tokens=16",
]


def as_flags(overrides: list[str]) -> list[str]:
    return [a for s in overrides for a in ("--set", s)]


def start_cli_run(out: Path, *overrides: str, until: str = "step 4/") -> subprocess.Popen:
    """A long tiny run through the real CLI, piped; returns once it printed a line starting with
    `until` (so training is really under way), the rest of its output still to be read."""
    proc = subprocess.Popen([sys.executable, "-m", "lmcockpit.tui.cli", "--run", "debug",
                             *as_flags([*TINY, "training.max_steps=100000", "eval.every=0", *overrides]),
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith(until):
            break
    return proc


# The trained_run fixture's command (test_cli runs it again to compare).
TRAINED_RUN = ("--run", "cpu", *as_flags([*SHRINK_CPU, *TINY, "sample.prompts=[\"def \"]", "checkpoint.every=6",
                                          "eval.tasks=[\"python-functions\"]"]))


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One shrunk cpu-preset run through the CLI, compiled, shared by the tests that only read
    what it left behind."""
    out = tmp_path_factory.mktemp("trained") / "run"
    return out, cli(*TRAINED_RUN, "--out", str(out))


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


@pytest.fixture
def terminal():
    opened = []

    def open_(*args: str, **kwargs) -> Terminal:
        opened.append(Terminal(*args, **kwargs))
        return opened[-1]
    yield open_
    for t in opened:
        t.close()

"""Shared fixtures: an isolated cache and state, a run trained once per session, a disk to fill, a
terminal, servers. Plain helpers (tiny configs, the real command, driving the engine) are in
helpers.py; the names below are imported from there for the fixtures, and stay importable from
here for a test that still does."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.hardware import cpu_precision

# One thread per engine the tests start: two test workers share two cores, and OpenMP threads
# that wait for one another's cores cost more than they give at these model sizes (10 % of
# test_resume.py's time). Set before any engine or CLI process starts: each inherits it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


from .helpers import (  # noqa: F401 - the names tests imported from here before helpers.py held them
    NO_GPU, PINNED_FP32, SERVE, SHRINK_CPU, TINY, TRAINED_RUN, Served, Terminal, as_flags, cli, cpu_verdict,
    drive_engine, ema, fill, losses, start_cli_run, tiny_config, trained_cache,
)


def _bytecode_written_once() -> None:
    """Each of the ~900 processes the suite starts (engines, CLI commands, hosts) imports
    lmcockpit. Where PYTHONDONTWRITEBYTECODE is set, as some CI containers set it, none of them
    keeps the bytecode it compiled, and each compiles the package again (0.1-0.2 s of a start).
    Written here once (py_compile writes whatever that flag says); they read it."""
    if not sys.flags.dont_write_bytecode:
        return  # the first process to import a module writes its bytecode, as usual
    import compileall

    import lmcockpit.core
    import lmcockpit.tui

    for package in (lmcockpit.core, lmcockpit.tui):
        for folder in package.__path__:
            compileall.compile_dir(folder, quiet=2)


_bytecode_written_once()


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


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, isolated_cache) -> tuple[Path, subprocess.CompletedProcess]:
    """One shrunk cpu-preset run through the CLI, compiled, shared by the tests that only read
    what it left behind: by every test worker of the session, the first that needs it training it
    (another that needs it meanwhile waits on the lock; in CI the compile alone, with a cold inductor
    cache, was ~40 s of CPU a worker). Its token cache is a folder of its own, beside it
    (`trained_cache`), which a test that runs the same command again must name."""
    root = _session_folder(tmp_path_factory) / "trained"
    root.mkdir(exist_ok=True)
    out, result = root / "run", root / "result.json"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            cache = trained_cache(out)
            cache.mkdir(parents=True, exist_ok=True)
            shutil.copy(isolated_cache / cpu_precision.CACHE_FILE, cache)  # the suite's pinned fp32
            proc = cli(*TRAINED_RUN, "--out", str(out), env={"XDG_CACHE_HOME": str(cache.parent)})
            written = root / ".result.json"
            written.write_text(json.dumps([proc.returncode, proc.stdout, proc.stderr]))
            os.replace(written, result)
    code, stdout, stderr = json.loads(result.read_text())
    return out, subprocess.CompletedProcess(["lmcockpit", *TRAINED_RUN, "--out", str(out)], code, stdout, stderr)


def _session_folder(tmp_path_factory) -> Path:
    """A folder of this session's, shared by its test workers (pytest-xdist's are each in a folder of
    their own under the session's)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture
def terminal():
    opened = []

    def open_(*args: str, **kwargs) -> Terminal:
        opened.append(Terminal(*args, **kwargs))
        return opened[-1]
    yield open_
    for t in opened:
        t.close()


@pytest.fixture
def closed_port():
    """An endpoint on loopback that refuses connections: a port held (so no one else takes it)
    but not listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def serve(tmp_path):
    """Starts `lmcockpit serve ARGS` in the test's folder (helpers.Served); each one started is
    stopped, with every cockpit it started, when the test ends."""
    started: list[Served] = []

    def start(*args: str, ready: bool = True, env: dict[str, str] | None = None, program: list[str] = SERVE,
              ready_line: str = "lmcockpit serve: the cockpit on") -> Served:
        started.append(Served(*args, cwd=tmp_path, env=env, program=program))
        if ready:
            started[-1].expect(ready_line)
        return started[-1]
    yield start
    for served in started:
        served.close()


@pytest.fixture
def runtime():
    """An $XDG_RUNTIME_DIR of the test's own that every account may enter (a real one is 0700): what
    keeps another account from the socket is then lmcockpit's own folder and socket file."""
    folder = Path(tempfile.mkdtemp(prefix="lmcockpit-runtime-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)

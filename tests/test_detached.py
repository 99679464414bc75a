"""A run host is detached (core/process/detached.py): forked from the front-end's warm forkserver
into a session of its own, nobody's child, its own engine a fork of it; the front-end learns its
pid, whether it runs and its exit code."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from lmcockpit.core.process import detached, host, live

from .child_probe import exits_when_told
from .helpers import detached as detached_run
from .helpers import engine_of, last_step, stop, wait_until

pytestmark = pytest.mark.slow  # a forkserver is a process: the first start imports torch in it


def start(tmp_path: Path, code: int) -> tuple[detached.Detached, int]:
    told_r, told = os.pipe()
    log = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        proc = detached.start(exits_when_told, (code,), log, passed=(told_r,))
    finally:
        os.close(told_r)
        os.close(log)
    return proc, told


@pytest.fixture(params=["pidfd", "pid polled"])
def kernel(request, monkeypatch):
    """This kernel, and one before 5.3 (no process descriptors: the pid is polled instead)."""
    if request.param == "pid polled":
        def no_pidfd(pid: int, flags: int = 0) -> int:
            raise OSError(errno.ENOSYS, "Function not implemented")

        monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    return request.param


def test_a_detached_process_is_nobody_s_child_and_says_its_exit_code(tmp_path, kernel):
    proc, told = start(tmp_path, 7)
    try:
        wait_until(lambda: (tmp_path / "log").read_text(), 30, "its first line")
        me = psutil.Process(proc.pid)
        assert me.ppid() != os.getpid() and me.pid not in [c.pid for c in psutil.Process().children(recursive=True)]
        assert os.getsid(proc.pid) != os.getsid(0)  # a session of its own: no terminal's hang-up reaches it
        assert (tmp_path / "log").read_text() == "standard input: /dev/null\n"  # nothing of this terminal's
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.2)
    finally:
        os.write(told, b"!")
        os.close(told)
    assert proc.wait(30) == 7 and proc.poll() == 7 and proc.returncode == 7
    proc.kill()  # ended: nothing to signal, and no other process that took its pid is


def test_a_detached_process_that_is_killed_ended_without_saying_its_code(tmp_path, kernel):
    proc, told = start(tmp_path, 0)
    wait_until(lambda: (tmp_path / "log").read_text(), 30, "its first line")
    proc.kill()
    assert proc.wait(30) == detached.KILLED
    os.close(told)


def test_a_run_host_comes_from_the_front_end_s_forkserver_and_forks_its_engine(tmp_path):
    """What each run saved: a host of its own that imported torch in a forkserver of its own
    (2.4-3.2 CPU-s on 2 Xeon cores) before its engine's first step. Now the host is a fork of the
    front-end's forkserver, which holds those imports, and its engine is its child."""
    run = detached_run(tmp_path, "run")
    try:
        the_host = psutil.Process(live.LiveRecord.read(run).pid)
        engine = engine_of(run)
        assert engine.ppid() == the_host.pid and os.getsid(the_host.pid) != os.getsid(0)
        assert "multiprocessing.forkserver" in " ".join(the_host.cmdline())  # a fork of one, not `python -m`
        forkservers = [c for c in the_host.children()  # the engine's command line is one's too: it is a fork
                       if c.pid != engine.pid and "multiprocessing.forkserver import main" in " ".join(c.cmdline())]
        assert forkservers == []  # no forkserver of its own (its queues' resource tracker, maybe)
    finally:
        stop(run)


def test_a_piped_detach_ends_with_its_command_and_the_run_trains_on(tmp_path):
    """The host once held its front-end's forkserver alive (its "alive" pipe), and that forkserver
    held the command's output: `lmcockpit PRESET --detach | cat` (or ssh capturing it) never ended.
    Its standard input here is a pipe, as a terminal's would be."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "lmcockpit.tui.cli", "debug", "--detach", "--out", str(out),
                           "--set", "training.max_steps=100000", "--set", "eval.every=0", "--set", "sample.prompts=[]"],
                          capture_output=True, text=True, timeout=90, input="")
    try:
        assert done.returncode == 0 and "training in the background" in done.stdout, done.stderr
        wait_until(lambda: last_step(out) >= 2, what="steps after the command ended")
        host = live.LiveRecord.read(out).pid
        assert live.alive(host)
        # nor its standard input (a fork of the forkserver had it: a terminal, held open by the run)
        assert [os.readlink(f"/proc/{pid}/fd/0") for pid in (host, engine_of(out).pid)] == ["/dev/null"] * 2
    finally:
        stop(out)


def test_a_host_that_cannot_serve_ends_its_engine_at_once_and_says_why(tmp_path, monkeypatch):
    """The host forks its engine before it serves (before it has a thread): when it then cannot
    serve (here the registry of live runs cannot be made: its folder's name is a file's), the
    engine goes with it, untrained, and the front-end says why. Left alone, the host's exit
    waited on the engine (multiprocessing joins its children), which trained on, unseen."""
    from lmcockpit.core.run.folder import create_run_dir, read_metrics

    from .helpers import shrunk_cpu

    state = tmp_path / "state"
    state.mkdir()
    (state / "lmcockpit").write_text("a file where the registry's folder goes\n")
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    run = create_run_dir(shrunk_cpu("training.max_steps=100000", "training.log_every=1"), "cpu", str(tmp_path / "run"))
    with pytest.raises(host.HostError, match="did not start: .*Not a directory"):
        host.start(run, label="cpu")
    this_test = os.environ["PYTEST_CURRENT_TEST"]

    def started_here() -> list[psutil.Process]:  # the host and its engine (not this worker's own helpers)
        found = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.ppid() != os.getpid() and p.pid != os.getpid() and p.environ().get("PYTEST_CURRENT_TEST") == this_test:
                    found.append(p)
        return found

    wait_until(lambda: not started_here(), 30, "the host and its engine to end")
    assert not read_metrics(run, "step")  # it never trained

"""Processes start from a forkserver with torch imported (core/process/warm_start.py), yet each is
born with what a spawned one had: the front-end's environment, umask, working directory and signal
dispositions of the moment it starts, not the forkserver's of when it started."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from lmcockpit.core.process.runner import ProcessHandle

from . import cli_zygote
from .child_probe import exits, report

pytestmark = pytest.mark.slow  # a forkserver is a process: the first start imports torch in it


def born(name: str) -> dict:
    handle = ProcessHandle(report, (name,))
    handle.start()
    deadline = time.monotonic() + 120
    while not isinstance(event := handle.poll(timeout=1), dict):
        assert not handle.done and time.monotonic() < deadline, f"the probe ended: {handle.failure}"
    handle.join(30)
    return event | {"pid": handle.pid}


@contextlib.contextmanager
def umask(mask: int):
    saved = os.umask(mask)
    try:
        yield
    finally:
        os.umask(saved)


def test_a_process_is_born_with_the_front_ends_state_of_its_start_from_a_warm_forkserver(tmp_path, monkeypatch):
    first = born("LMCOCKPIT_PROBE")  # starts this process's forkserver, if no test did yet
    server = psutil.Process(first["parent"])
    assert "multiprocessing.forkserver" in " ".join(server.cmdline()) and server.ppid() == os.getpid()
    # Changed since the forkserver started: a spawned child would have taken all of it.
    monkeypatch.setenv("LMCOCKPIT_PROBE", "set since")
    monkeypatch.chdir(tmp_path)
    saved = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as `nohup` leaves it
    try:
        with umask(0o027):
            second = born("LMCOCKPIT_PROBE")
    finally:
        signal.signal(signal.SIGHUP, saved)
    assert second["parent"] == server.pid  # the same forkserver: no second import of torch
    assert second["preloaded"], "torch was not imported in the forkserver"
    # Nor a Hub or HTTP client: their settings may then differ between the forkserver and a command
    # that shares it (tests/cli_zygote.py's UNREAD).
    assert not set(cli_zygote.NOT_IMPORTED) & set(second["modules"])
    assert second["value"] == "set since" and second["umask"] == 0o027 and Path(second["cwd"]) == tmp_path
    assert second["dispositions"] == {"SIGINT": "SIG_IGN", "SIGTERM": "SIG_DFL", "SIGHUP": "SIG_IGN"}
    assert second["blocked"] == []
    third = born("LMCOCKPIT_PROBE")
    assert third["dispositions"]["SIGHUP"] == "SIG_DFL"  # no nohup: a hang-up stops it in order


def test_a_process_writes_where_the_front_end_s_output_and_errors_go_at_its_start(tmp_path):
    """Not where they went when the forkserver started: what an engine prints before its own log
    is open (a traceback) reaches whoever reads the front-end's streams now."""
    born("HOME")  # the forkserver runs, its streams those of this process until now
    saved = [os.dup(fd) for fd in (1, 2)]
    out, err = tmp_path / "out", tmp_path / "err"
    try:
        for fd, path in ((1, out), (2, err)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            os.dup2(target, fd)
            os.close(target)
        probe = born("HOME")
    finally:
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
    assert probe["streams"] == [str(out), str(err)]
    assert born("HOME")["streams"] == [os.readlink(f"/proc/self/fd/{fd}") for fd in (1, 2)]


def test_the_forkserver_never_hears_a_hang_up_or_sigterm_its_process_group_gets():
    """Its forks' exit codes reach the front-end through it: a terminal's hang-up must not end it
    (tests/test_resume.py's signal test shows the run it would cost)."""
    server = psutil.Process(born("HOME")["parent"])
    blocked = int(next(line for line in Path(f"/proc/{server.pid}/status").read_text().splitlines()
                       if line.startswith("SigBlk:")).split()[1], 16)
    for sig in (signal.SIGHUP, signal.SIGTERM):
        assert blocked & 1 << (sig - 1), sig.name
    # and this process is left as it was: its own mask has neither
    assert not {signal.SIGHUP, signal.SIGTERM} & signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_an_exit_code_asked_for_by_several_threads_at_once_is_the_code_it_exited_with():
    """The chat window's closer joins its engine while the event reader asks whether it lives: the
    forkserver sends an exit code once, and a second thread reading it got the pipe's end, which
    multiprocessing reports as 255 (a chat closed cleanly, shown as a crash). Each exit here is
    asked for by three threads at once, as the window's closer, reader and the UI do."""
    for _ in range(20):
        handle = ProcessHandle(exits, (3,))
        handle.start()
        start = threading.Barrier(3)

        def ask() -> None:
            start.wait()
            while handle.process.is_alive():
                pass

        askers = [threading.Thread(target=ask) for _ in range(2)]
        for asker in askers:
            asker.start()
        start.wait()
        handle.join()
        for asker in askers:
            asker.join()
        assert handle.process.exitcode == 3
        handle.poll(timeout=0)  # no event came: the death is noticed, with the code it read
        assert handle.failure.message == "the lmcockpit-engine process exited with code 3 without reporting why"


def test_a_forkserver_started_in_the_same_breath_as_its_resource_tracker_is_deaf_as_well():
    """multiprocessing unblocks SIGTERM in the starting thread once it has spawned its resource
    tracker (bpo-33613): a forkserver spawned next, in the same deaf block, heard SIGTERM (the
    launcher's for torchrun's ranks; a front-end's first run host). A fresh front-end, so that
    neither is running yet."""
    script = ("import psutil\nfrom multiprocessing import forkserver\nfrom lmcockpit.core.process import warm_start\n"
              "warm_start.context(())\nwith warm_start.deaf_helpers():\n    forkserver.ensure_running()\n"
              "for c in psutil.Process().children():\n"
              "    if 'multiprocessing.forkserver' in ' '.join(c.cmdline()):\n"
              "        print(open(f'/proc/{c.pid}/status').read())\n")
    status = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True).stdout
    blocked = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
    for sig in (signal.SIGHUP, signal.SIGTERM):
        assert blocked & 1 << (sig - 1), sig.name

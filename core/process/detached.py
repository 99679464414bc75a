"""A process that outlives the front-end that starts it (the run host): a fork of its warm forkserver.

The run host was a fresh interpreter (`python -m ...host`) whose engine came from a forkserver of
its own: every run paid torch's imports again (2.4-3.2 CPU-s a run on 2 Xeon cores) though the
front-end had a forkserver holding them. Now the front-end's forkserver (warm_start) forks a
go-between, which starts a session of its own, gives up all it holds of the front-end (its
terminal as standard input, the pipes that keep its forkserver and resource tracker alive),
sends its output to the host's log, forks the host and exits. The host is then nobody's child
(init reaps it): no front-end waits for it at exit (multiprocessing joins the processes it
started), and one that quits leaves it alone. The host forks its engine in turn
(runner.ProcessHandle(fork=True)), before it has a thread.

The front-end learns the host's pid, and at its end its exit code, on a pipe the host writes;
whether it still runs, from a pidfd (a process descriptor: race-free where a pid may be reused).
Torch-free, as warm_start is: the forkserver imports torch, this module never does.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import struct
import subprocess
import threading
import time
import traceback
import weakref
from multiprocessing import reduction

from . import live, warm_start

KILLED = -1  # the exit code of a host that ended without saying its own (killed: only init learns how)
STARTED_WITHIN = 120.0  # seconds for the forkserver (its first start imports torch) and the fork


class Descriptors:
    """File descriptors for the go-between, sent beside the process object as multiprocessing
    sends a spawned child's (made at pickling, where the forkserver can take them)."""

    def __init__(self, *fds: int):
        self.fds = list(fds)

    def __getstate__(self) -> list:
        return [reduction.DupFd(fd) for fd in self.fds]

    def __setstate__(self, state: list) -> None:
        self.fds = [fd.detach() for fd in state]


class Detached:
    """The front-end's handle on a detached process, answering as subprocess.Popen's does: `pid`,
    `poll()`, `wait()`, `kill()`, `returncode` (KILLED for one that ended without saying it)."""

    def __init__(self, pid: int, said: int):
        self.pid = pid
        self.returncode: int | None = None
        self._said = said  # the pipe's read end: its exit code comes there
        self._lock = threading.Lock()  # the cockpit asks from its UI thread and its event reader
        self._pidfd: int | None = None
        self._reaped = False
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # already ended and reaped
            self._reaped = True
        except OSError:  # a kernel before 5.3 has no process descriptors: its pid is polled
            pass
        else:  # open as long as this handle is: a thread may be waiting on it
            weakref.finalize(self, os.close, self._pidfd)

    def poll(self) -> int | None:
        return self._ended(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._ended(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"process {self.pid}", timeout)
        return code

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self.returncode is not None or self._reaped:
                return
            with contextlib.suppress(ProcessLookupError):
                if self._pidfd is not None:  # never another's process, whatever became of the pid
                    signal.pidfd_send_signal(self._pidfd, sig)
                elif live.alive(self.pid):
                    os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _gone(self, timeout: float | None) -> bool:
        """Whether it has ended, waiting `timeout` seconds at most."""
        if self._reaped:
            return True
        if self._pidfd is not None:
            return bool(select.select([self._pidfd], [], [], timeout)[0])  # readable once it has ended
        deadline = None if timeout is None else time.monotonic() + timeout
        while live.alive(self.pid):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.05)  # no descriptor to wait on: the pid, polled
        return True

    def _ended(self, timeout: float | None) -> int | None:
        gone = self.returncode is None and self._gone(timeout)
        with self._lock:
            if self.returncode is None and gone:
                try:
                    code = os.read(self._said, 1)  # written before it ended: there if it was said
                except BlockingIOError:
                    code = b""
                os.close(self._said)
                self.returncode = code[0] if code else KILLED
            return self.returncode


def start(target, args: tuple, log: int, passed: tuple[int, ...] = (), preload: tuple[str, ...] = warm_start.ENGINE
          ) -> Detached:
    """`target(*args, *passed)` in a detached process whose standard output and error go to `log`;
    `passed`: descriptors it gets (theirs, in it). Its return value is its exit code."""
    said_r, said_w = os.pipe()
    try:
        warm_start.context(preload)
        go_between = warm_start.Process(target=warm_start.as_if_spawned, name="lmcockpit-detach",
                                        args=(warm_start.Inherited(), _go_between, Descriptors(log, said_w, *passed),
                                              target, *args))
        with warm_start.starting():
            go_between.start()
        os.close(said_w)
        said_w = -1
        pid = _read_pid(said_r)
        go_between.join()
    except BaseException:
        os.close(said_r)
        raise
    finally:
        if said_w >= 0:
            os.close(said_w)
    os.set_blocking(said_r, False)
    return Detached(pid, said_r)


def _read_pid(said: int) -> int:
    data = b""
    while len(data) < 4:
        if not select.select([said], [], [], STARTED_WITHIN)[0]:
            raise OSError(f"no process after {STARTED_WITHIN:.0f} s")
        if not (chunk := os.read(said, 4 - len(data))):
            raise OSError("the process ended before it began")
        data += chunk
    return struct.unpack("!i", data)[0]


def _go_between(descriptors: Descriptors, target, *args) -> None:
    log, said, *passed = descriptors.fds
    os.setsid()  # a closed terminal or a dropped SSH connection sends it no SIGHUP
    # Nothing of the front-end's terminal: a fork of the forkserver has its standard input still
    # (multiprocessing replaces sys.stdin, not descriptor 0), which held the terminal open.
    nothing = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nothing, 0)
    os.close(nothing)
    for fd in (1, 2):
        os.dup2(log, fd)
    os.close(log)
    # The front-end's forkserver and resource tracker live while anyone holds their pipes, and
    # write to its terminal: held by the host, they stayed for the whole run (a piped --detach
    # never ended). The host and its engine start their own if they need one.
    warm_start.forget_helpers()
    if os.fork():
        os._exit(0)  # the go-between ends here: the process below is nobody's child but init's
    from .child import exit_now

    code = 1
    try:
        with contextlib.suppress(OSError):  # a starter gone meanwhile (Ctrl-C): the host goes on
            os.write(said, struct.pack("!i", os.getpid()))
        code = target(*args, *passed) or 0  # None, as sys.exit takes it: 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - what killed it goes to its log, as an interpreter's would
        traceback.print_exc()
    finally:
        with contextlib.suppress(OSError):
            os.write(said, bytes([code & 0xFF]))
    exit_now(code)


"""Engines start from a forkserver that has torch imported: the second one starts in a tenth of a second.

A spawned engine pays its imports before its first step: torch, torch.distributed.checkpoint and
torch._dynamo (which torch.optim imports at an optimizer's first call) are about 5 s of CPU on
two EPYC cores, every time. multiprocessing's forkserver is a fresh interpreter like spawn's (no
CUDA context, no threads of the front-end's, nothing of Textual), started once per front-end
process; it imports `PRELOAD` while nothing waits on it, and each engine is a fork of it. The
cockpit's second run, a chat engine beside a run, and a test suite's hundred engines skip the
imports (bench/RESULTS.md: 0.05 s against 4.2 s a start). What it costs: the forkserver stays,
idle, as long as the front-end does, holding the imported modules (about 400 MB, shared
copy-on-write with the engines it forks).

A fork of the forkserver is not quite what spawn made, and `as_if_spawned` mends the difference
first thing in the child: it gets the front-end's environment of now (the forkserver has the one it
started with: a variable set since, such as CUDA_VISIBLE_DEVICES for a chosen GPU, would be
missing), its umask, its standard output and error of now (the forkserver writes where the
front-end's went when it started: a front-end that has since sent them elsewhere would lose what its
engine prints there, a traceback before the engine's own log is open), and the signal dispositions a
spawned child had (SIGINT ignored, SIGHUP ignored only under nohup, SIGTERM default).
multiprocessing sends the working directory and sys.path itself. The forkserver is started with
SIGHUP and SIGTERM blocked, which it and its forks inherit: a hang-up or SIGTERM sent to the whole
process group must reach the engine (which unblocks them) and the front-end, not kill the
forkserver, through which the front-end learns its engine's exit code (nor the resource tracker,
whose death fills the output with tracebacks). Nothing is lost in the front-end meanwhile: a blocked
signal waits.
Torch-free: the forkserver imports torch, this module never does.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
from multiprocessing import connection, popen_fork, popen_forkserver, reduction, resource_tracker
from multiprocessing.context import ForkProcess, ForkServerProcess

from ..run.safe_files import current_umask

# What a training engine imports before its first step, imported once in the forkserver. The first
# process a front-end starts sets what its forkserver holds (a chat engine's is less: no optimizer,
# no dynamo); a name that fails to import there is skipped by multiprocessing, and the process
# imports what it needs itself.
ENGINE = ("lmcockpit.core.process.engine", "lmcockpit.core.train.trainer", "torch._dynamo")
DEAF = {signal.SIGHUP, signal.SIGTERM}  # blocked in the helper processes multiprocessing starts


def context(preload: tuple[str, ...]):
    """multiprocessing's forkserver context, with what a forkserver started next imports."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


class _PolledOnce:
    """A Popen whose exit code any number of threads may ask for. The forkserver sends a child's
    exit code once, on a pipe that then closes, and multiprocessing's Popen reads it in poll() with
    no lock: of two threads that both saw it ready, one read the code and the other the pipe's end,
    which multiprocessing takes for a dead forkserver and reports as exit code 255. The cockpit's
    chat window closing did it (its closer joined while the event reader asked is_alive): 157 exits
    of 200 read as 255 with two threads polling beside a join, on 2 cores. A forked child's waitpid
    has the same race (the loser's ECHILD reads as "still running"). The read is made under a lock;
    a blocking wait for the exit comes before it, outside the lock, so other threads still poll.
    (The read itself stays as asked: a fork's pipe reads as ended a moment before its waitpid does.)"""

    def __init__(self, process_obj):
        self._read_once = threading.Lock()
        super().__init__(process_obj)

    def poll(self, flag=os.WNOHANG):
        if flag != os.WNOHANG and self.returncode is None:
            connection.wait([self.sentinel])
        with self._read_once:
            return super().poll(flag)


class _ForkServerPopen(_PolledOnce, popen_forkserver.Popen):
    pass


class _ForkPopen(_PolledOnce, popen_fork.Popen):
    pass


class Process(ForkServerProcess):
    """A fork of the forkserver, its exit code safe to ask for from any thread."""

    @staticmethod
    def _Popen(process_obj):
        return _ForkServerPopen(process_obj)


class ForkedProcess(ForkProcess):
    """A plain fork of this process (the run host's engine: the host holds the forkserver's
    imports and has no thread yet when it forks), its exit code safe to ask for from any thread."""

    @staticmethod
    def _Popen(process_obj):
        return _ForkPopen(process_obj)


@contextlib.contextmanager
def starting():
    """Around a process's start and its queues' making, in a front-end: what it starts sees the real
    standard streams, SIGINT ignored and multiprocessing's helpers deaf (each below says why)."""
    with _real_streams(), _sigint_ignored(), deaf_helpers():
        yield


@contextlib.contextmanager
def _real_streams():
    """Textual replaces sys.stdout/stderr with objects whose fileno() is -1, and multiprocessing
    hands sys.stderr's descriptor to the processes it starts: give it the real streams."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


@contextlib.contextmanager
def _sigint_ignored():
    """A process started while SIGINT is ignored starts with it ignored (exec keeps SIG_IGN, and
    Python then installs no KeyboardInterrupt handler): Ctrl-C in the child's first second, while
    it imports, would otherwise kill it before it can ignore SIGINT itself."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; the app starts processes from it
        return
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, saved)


@contextlib.contextmanager
def deaf_helpers():
    """Around a process's start and its queues' making: multiprocessing's helper processes started
    now (the forkserver, the resource tracker) have SIGHUP and SIGTERM blocked for good. A tracker
    killed by a hang-up filled the output with its tracebacks ("process died unexpectedly").
    Blocked, not ignored: one that arrives meanwhile waits for the front-end rather than being lost.
    They start with PYTHONSAFEPATH=1 as well: multiprocessing starts them with `python -c`, which puts
    the working folder first on sys.path, and Python 3.11's forkserver imports PRELOAD before it takes
    the front-end's sys.path: a lmcockpit/ in the folder the command runs in (a clone's root, with a
    regular install) was imported instead of ours, and the forkserver died. A process started meanwhile
    keeps it (its Inherited environment is taken now): what an engine starts in turn (torchrun's
    ranks) does not put the working folder first either."""
    saved = signal.pthread_sigmask(signal.SIG_BLOCK, DEAF)
    safe_path = os.environ.get("PYTHONSAFEPATH")
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        # The tracker first: starting, it unblocks SIGTERM in this thread once it is spawned
        # (bpo-33613), and a forkserver started after it in the same block heard SIGTERM.
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, DEAF)
        yield
    finally:
        if safe_path is None:
            del os.environ["PYTHONSAFEPATH"]
        else:
            os.environ["PYTHONSAFEPATH"] = safe_path
        signal.pthread_sigmask(signal.SIG_SETMASK, saved)


def forget_helpers() -> None:
    """In a fork (of the forkserver, or of a process that has them): close and forget the pipes
    that keep multiprocessing's forkserver and resource tracker of the process it came from
    alive, so that this one holds neither and starts its own when it needs one. Both are
    multiprocessing's private state: it has no public way to let go of them."""
    from multiprocessing import forkserver

    server, tracker = forkserver._forkserver, resource_tracker._resource_tracker
    for fd in (server._forkserver_alive_fd, tracker._fd):
        if fd is not None:
            os.close(fd)
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    tracker._fd = tracker._pid = None


class Inherited:
    """What a spawned child takes from the front-end, read when the process object is pickled for
    the forkserver: at the process's start, as spawn reads it. The standard streams travel as
    descriptors (multiprocessing passes them to the forkserver beside the process); one the
    front-end has closed stays the forkserver's."""

    def __init__(self):
        # A plain fork (the host's engine) is never pickled: it has the streams already
        self.env, self.umask, self.hup_ignored, self.streams = *self._now(), [None for _ in STREAMS]

    @staticmethod
    def _now() -> tuple:
        return dict(os.environ), current_umask(), signal.getsignal(signal.SIGHUP) is signal.SIG_IGN

    def __getstate__(self) -> tuple:
        streams = [reduction.DupFd(fd) if _is_open(fd) else None for fd in STREAMS]
        return *self._now(), streams

    def __setstate__(self, state: tuple) -> None:
        self.env, self.umask, self.hup_ignored, streams = state
        self.streams = [s.detach() if s is not None else None for s in streams]


STREAMS = (1, 2)  # standard output and error; a child of multiprocessing has no standard input


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def as_if_spawned(inherited: Inherited, target, *args) -> None:
    """The process's target, with the front-end's environment, umask and signal dispositions."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under _sigint_ignored: the target takes it over
    signal.signal(signal.SIGHUP, signal.SIG_IGN if inherited.hup_ignored else signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, DEAF)
    os.environ.clear()
    os.environ.update(inherited.env)
    os.umask(inherited.umask)
    for fd, received in zip(STREAMS, inherited.streams):
        if received is not None:
            os.dup2(received, fd)
            os.close(received)
    target(*args)

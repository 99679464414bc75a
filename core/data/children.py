"""The processes a cache build starts: the tokenizing workers and the BPE's own process.

* How many workers: one per core, as many as keep the build's whole process tree under
  TREE_BYTES (the issue's bound, whatever the corpus), from the per-worker peaks measured.
* Each is born with SIGINT blocked and ignores it: Ctrl-C reaches the whole process group, and the
  build alone answers it, ending its children (a child's own KeyboardInterrupt would print a
  traceback over the terminal).
* Each dies with the build (PR_SET_PDEATHSIG): a SIGKILLed build leaves no orphan writing beside
  the next one.
* Workers are processes of their own, each handed a piece at a time over its own pipe, rather
  than a multiprocessing Pool: a Pool replaces a worker that dies and waits for ever for its
  piece, where here the build stops and names it (each_in_workers).
* The BPE trains in a process of its own (in_child), so the trainer's memory goes back to the
  system before the workers start.
No numpy, no tokenizers: what the children run is imported in them.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
from multiprocessing import connection, resource_tracker
import os
import signal
import threading
import traceback
from contextlib import contextmanager
from typing import Callable, Iterable

from ..config import ConfigError
from .sources import Source

# Peak RSS of one worker, measured at 1 and 3 GB (bench/RESULTS.md, 2026-11-25), with a margin:
# its imports, a tokenizer, a batch of text (78-79 MB), and for Parquet and Arrow pyarrow with a
# page's data (151-159 MB); the main process (55-93 MB) with multiprocessing's resource tracker
# (13 MB). The default worker count keeps their sum under TREE_BYTES, the bound on the whole
# preparation whatever the corpus.
WORKER_BYTES = 90_000_000
COLUMNAR_WORKER_BYTES = 170_000_000
MAIN_BYTES = 110_000_000
TREE_BYTES = 1_500_000_000
TICK_S = 0.5  # how often a build's progress is said while its workers tokenise


def default_workers(source: Source, log: Callable[[str], None] = lambda line: None) -> int:
    """One per core, or fewer where that many would pass TREE_BYTES together (said in the log)."""
    cores = len(os.sched_getaffinity(0))
    each = COLUMNAR_WORKER_BYTES if any(f.kind in ("parquet", "arrow") for f in source.files) else WORKER_BYTES
    fit = max(1, (TREE_BYTES - MAIN_BYTES) // each)
    if cores > fit:
        log(f"data: {fit} tokenizer processes for {cores} cores, so that preparation stays under "
            f"{TREE_BYTES / 1e9:.1f} GB (about {each / 1e6:.0f} MB each); data.workers sets how many")
    return min(cores, fit)


def each_in_workers(fn, jobs: Iterable, workers: int, initializer, initargs: tuple, done: Callable[[object], None],
                    tick: Callable[[], None], what: Callable[[object], str]) -> None:
    """`fn(job)` for every job in `workers` spawned processes, born deaf to Ctrl-C (`initializer`
    calls quiet_child()), a job at a time each, taken from `jobs` as a worker is free for it:
    `done(result)` as each job ends, in any order, and `tick()` about every TICK_S meanwhile. A
    job's error is raised here, its worker's traceback as a note. A worker that dies (the OOM
    killer's SIGKILL, a crash in pyarrow) is a ConfigError naming the job it was on (`what(job)`),
    and the others are killed: a Pool started another in its place and waited for ever for the
    answer. On any error or Ctrl-C, every worker is killed at once."""
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    todo, held = iter(jobs), {}  # held: a worker's index → the job it is on

    def died(i: int) -> ConfigError:
        procs[i].join()
        on = f"on {what(held[i])}" if i in held else "between pieces"
        return ConfigError(f"data: a tokenizing process died ({_how(procs[i].exitcode)}) {on}; the pieces "
                           "finished are kept, and preparing again goes on from them"
                           + (" (fewer data.workers need less memory)" if procs[i].exitcode == -signal.SIGKILL
                              else ""))

    def hand(i: int) -> None:
        if (job := next(todo, None)) is not None:
            held[i] = job
            try:
                conns[i].send(held[i])
            except OSError:  # its end of the pipe closed: it is dead
                raise died(i) from None

    try:
        with _deaf_children():
            for _ in range(workers):
                mine, theirs = ctx.Pipe()
                procs.append(ctx.Process(target=_work, args=(theirs, fn, initializer, initargs), daemon=True))
                procs[-1].start()
                theirs.close()
                conns.append(mine)
        for i in range(workers):
            hand(i)
        while held:
            # A dead worker's end of its pipe is closed by the system: its pipe reads as ready, then EOF.
            ready = connection.wait(conns, TICK_S)
            for i, conn in enumerate(conns):
                if conn not in ready:
                    continue
                try:
                    ok, value, trace = conn.recv()
                except (EOFError, OSError):
                    raise died(i) from None
                if not ok:
                    value.add_note(trace)
                    raise value
                del held[i]
                done(value)
                hand(i)
            tick()
    finally:
        for proc in procs:
            if proc.pid is not None:
                proc.kill()
                proc.join()


def _how(exitcode: int | None) -> str:
    if exitcode == -signal.SIGKILL:
        return f"exit code {exitcode}: killed, out of memory?"
    if exitcode is not None and exitcode < 0 and -exitcode in signal.valid_signals():
        return f"exit code {exitcode}: {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def _work(conn, fn, initializer, initargs) -> None:
    """A worker: jobs from `conn`, one at a time, each answered (ok, result or error, traceback)."""
    initializer(*initargs)
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the build is gone (it kills its workers when done)
            return
        try:
            answer = (True, fn(job), "")
        except Exception as e:  # noqa: BLE001 - a worker's every failure goes back to the build, which raises it
            answer = (False, e, traceback.format_exc())
        try:
            conn.send(answer)
        except Exception as e:  # noqa: BLE001 - an error that does not pickle, whatever it is: said as text
            conn.send((False, RuntimeError(f"{type(answer[1]).__name__}: {answer[1]}"), answer[2] or str(e)))


def in_child(fn, *args):
    """`fn(*args)` in a spawned process of its own, its errors raised here. For the BPE's training:
    the trainer's memory (hundreds of MB for a large sample) goes back to the system when the
    child ends, rather than stay in this process beside the workers that tokenise after it. On
    Ctrl-C, or any error here, the child is killed at once rather than left to finish training;
    a child killed from outside (the OOM killer) is an error, not a wait for an answer that
    never comes (as a Pool's would be)."""
    ctx = mp.get_context("spawn")
    answer, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_answer, args=(send, fn, args), daemon=True)
    try:
        with _deaf_children():
            child.start()
        send.close()
        ok, value = answer.recv()
    except EOFError:
        child.join()
        raise ConfigError(f"data: the tokenizer's training process died (exit code {child.exitcode}"
                          f"{': killed, out of memory?' if child.exitcode == -signal.SIGKILL else ''}); "
                          "a smaller tokenizer.train_bytes needs less memory") from None
    finally:
        if child.pid is not None:  # started (a Ctrl-C is kept until it is: _deaf_children)
            child.kill()
            child.join()
    if not ok:
        raise value
    return value


def _answer(send, fn, args) -> None:
    quiet_child()
    try:
        send.send((True, fn(*args)))
    except Exception as e:  # noqa: BLE001 - any failure is raised in the parent as it was raised here
        send.send((False, e))


def quiet_child() -> None:
    """The first thing a child of the build does: ignore Ctrl-C (the build answers it), unblock it
    (it came blocked: one sent while the child was starting is dropped here), die with the build."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _die_with_parent()


@contextmanager
def _deaf_children():
    """Children started inside are born with SIGINT blocked (a signal mask survives fork and exec),
    until quiet_child ignores it; a Ctrl-C meanwhile is this process's once the block ends.

    Two things make that hold. multiprocessing's resource tracker is started first: the first
    spawn starts it, and starting it unblocks SIGINT on its way out, so the first child would be
    born hearing Ctrl-C (one during its interpreter's start printed a "Fatal Python error"). And in
    the main thread a Ctrl-C is held by a handler of this block and raised at its end: blocking it
    in this thread does not stop another thread from taking the signal, and Python would then raise
    KeyboardInterrupt here, half way through writing a child's start-up data (its EOFError
    traceback on the terminal)."""
    resource_tracker.ensure_running()
    held: list = []
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, lambda *frame: held.append(frame)) if main else None
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        if main:
            signal.signal(signal.SIGINT, previous)
            if held and callable(previous):
                previous(*held[0])  # Python's own: KeyboardInterrupt, now that the children are started
            elif held and previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGINT)


def _die_with_parent() -> None:
    """A worker ends when the build that started it is killed (Linux's PR_SET_PDEATHSIG), rather
    than finish its piece beside the next build's workers."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: build.py's per-process temporary names still keep it safe
        pass
    if os.getppid() == 1:  # the parent died before the call
        os._exit(1)

"""A process target that reports what it was born with, for tests/test_warm_start.py (a module of
its own, light to import: the forkserver's child imports it to unpickle the target)."""

from __future__ import annotations

import os
import signal
import sys


def report(name: str, events, commands) -> None:
    preloaded = "torch" in sys.modules  # before anything here could import it
    modules = sorted({name.partition(".")[0] for name in sys.modules})
    with open("/proc/self/status", encoding="ascii") as fh:
        status = dict(line.split(":\t", 1) for line in fh.read().splitlines() if ":\t" in line)
    events.put({
        "value": os.environ.get(name),
        "umask": int(status["Umask"], 8),
        "dispositions": {sig.name: getattr(signal.getsignal(sig), "name", "a handler")
                         for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)},
        "blocked": sorted(s.name for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "preloaded": preloaded,
        "modules": modules,
        "cwd": os.getcwd(),
        "parent": os.getppid(),
        "streams": [os.readlink(f"/proc/self/fd/{fd}") for fd in (1, 2)],
    })


def exits(code: int, events, commands) -> None:
    os._exit(code)


def exits_when_told(code: int, told: int) -> int:
    """A detached process (core/process/detached.py): says where its standard input is, then waits
    for a byte on `told` and exits with `code`."""
    print(f"standard input: {os.readlink('/proc/self/fd/0')}", flush=True)
    os.read(told, 1)
    return code

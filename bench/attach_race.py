"""Attach and detach in a tight loop against a real run host's server, under CPU load: the stress
that found the host closing a viewer's descriptor under its other thread (the next connection got
the number, and an event landed in its handshake). A count of failed attaches, not a timing.

    python bench/attach_race.py [--cycles 3000] [--log-lines 20000] [--burners 2]

Each cycle is `RunViewer(run).close()`, as `lmcockpit attach` checks a run and then opens the
cockpit's connection. The server runs in this process, beside the viewers, as in
tests/test_cli_failures.py. `--log-lines` sizes the train.log that each attach's catch-up reads.
`--burners` is the number of busy processes that run beside the loop.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from machine import record


def burn(stop) -> None:
    while not stop.is_set():
        pass


def cycles(n: int, log_lines: int) -> tuple[Counter, int, float]:
    """(failures by message, refusals the host logged, seconds)."""
    from lmcockpit.core.process import host, live
    from lmcockpit.core.process.viewer import NotLive, RunViewer

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        (run / "train.log").write_text("a log line of a long run\n" * log_lines)
        logged: list[str] = []
        server = host.RunServer(run, on_command=lambda c: None, log=logged.append)
        live.LiveRecord(str(run.resolve()), os.getpid(), socket.gethostname(), str(server.path)).write()
        failures: Counter = Counter()
        t0 = time.perf_counter()
        try:
            for _ in range(n):
                try:
                    RunViewer(run).close()
                except NotLive as e:
                    failures[str(e).split(": ", 1)[-1].replace(str(run), "RUN")] += 1
        finally:
            server.close(grace=1)
        return failures, sum("refused" in line for line in logged), time.perf_counter() - t0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=3000)
    ap.add_argument("--log-lines", type=int, default=20000)
    ap.add_argument("--burners", type=int, default=2)
    args = ap.parse_args()
    stop = mp.get_context("spawn").Event()
    burners = [mp.get_context("spawn").Process(target=burn, args=(stop,), daemon=True) for _ in range(args.burners)]
    for p in burners:
        p.start()
    try:
        failures, refusals, seconds = cycles(args.cycles, args.log_lines)
    finally:
        stop.set()
        for p in burners:
            p.join()
    lines = ["| attach-detach cycles | burners | failed attaches | refusals the host logged | seconds |",
             "| ---: | ---: | ---: | ---: | ---: |",
             f"| {args.cycles:,} | {args.burners} | {sum(failures.values())} | {refusals} | {seconds:.1f} |"]
    if failures:
        lines += ["", *(f"* {count}×: {message}" for message, count in failures.most_common())]
    record("Attach and detach under load: the host's descriptors", lines)

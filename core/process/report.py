"""The pipe on which a run host tells the front-end that started it how the run's start went.

How a run host tells the front-end that started it how the run's start went: one pipe, written
by the host (StartReport), read by the front-end (Reports). Torch-free.

`ready` once the host serves; then one JSON object a line: the engine's preparation (`progress`),
and at last whether the run `started` or `ended` first (with its failure, if any), after which the
host closes the pipe. `--detach` reads all of it, so that a run failing at its start is reported
as a foreground run would report it; the cockpit reads only `ready`, then attaches.
"""

from __future__ import annotations

import json
import os
import select
import time
from multiprocessing import util

from .. import protocol as P

REPORT_EVERY = 1.0  # seconds between progress lines: the reader draws one line, no need for more


class StartReport:
    """The host's end. A front-end that stopped reading (the cockpit once served, or Ctrl-C while
    --detach waited) costs nothing: a write it would not read is dropped, never waited on, and
    the run goes on, attachable, whatever became of the front-end."""

    def __init__(self, fd: int | None):
        self.fd = fd
        self.progress_at = 0.0
        if fd is not None:
            os.set_blocking(fd, False)
            # The engine is a fork of the host: holding the pipe open, it would hide the host's
            # end from the front-end (the EOF that says the host died before it reported).
            util.register_after_fork(self, StartReport.close)

    def _write(self, text: str) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, text.encode())  # a line is below PIPE_BUF: written whole or not at all
        except BlockingIOError:
            pass  # the reader is behind by a pipe's worth: a progress line less
        except OSError:  # EPIPE: nobody reads any more
            self.close()

    def ready(self) -> None:
        self._write("ready\n")

    def event(self, event: object) -> None:
        if isinstance(event, P.RunStarted):
            self._say(started=True)
            self.close()
        elif isinstance(event, P.Progress) and time.monotonic() - self.progress_at >= REPORT_EVERY:
            self.progress_at = time.monotonic()
            self._say(progress=[event.phase, event.done, event.total, event.unit])

    def ended(self, state: str, failure: P.Failure | None) -> None:
        """The engine ended before it started training (after, the pipe is closed already)."""
        message = failure.message if failure else ""
        # A line one write puts whole (PIPE_BUF, 4096 bytes on Linux): a message of a few lines
        # fits; a longer one, or one that JSON escapes 6 bytes a character, is cut to fit.
        while len(line := self._line(ended=state, message=message,
                                     user_error=bool(failure and failure.user_error))) > select.PIPE_BUF:
            message = message[:len(message) * 3 // 4]
        self._write(line)
        self.close()

    def _say(self, **what) -> None:
        self._write(self._line(**what))

    @staticmethod
    def _line(**what) -> str:
        return json.dumps(what) + "\n"

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Reports:
    """The front-end's end: the host's lines, each waited for with a time limit."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buffer = b""

    def next(self, timeout: float) -> str | None:
        """The next line; None if none came within `timeout`; EOFError once the host has closed
        the pipe (said all it had to, or died)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 4096)
            if not chunk:
                raise EOFError
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

"""A front-end's handle on a run that a run host serves, as `lmcockpit attach` and the dashboards hold it.

It connects to the run host (host.py) through the address in the run's `live.json`. Torch-free.

It offers what runner.ProcessHandle offers the dashboard (`poll`, `send`, `done`, `final_state`,
`failure`, `run_dir`), so a dashboard does not know whether it owns its engine or watches one.
On attaching, and again whenever the host says it had to drop events for this viewer, the run's
history comes from its folder: the end of train.log, the history (core/run/history_file.py: a
summary the engine keeps, and the rows of metrics.jsonl after it), then the host's snapshot (the
run's RunStarted, state, progress) and when the host began the run (live.Began, from live.json:
what elapsed counts from). The connection is made before
the folder is read, and what arrives meanwhile is kept: the engine writes a step's line before it
sends the step's event, so every step is in the file or still to come, and none is shown twice.
It attaches only to the user's own run host, checked before the handshake (live.py says how): what
the host sends is unpickled.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import subprocess
import threading
import time
from multiprocessing import AuthenticationError, connection
from pathlib import Path

from .. import protocol as P
from ..run import history_file
from ..run.folder import TRAIN_LOG, tail_lines
from ..run.safe_files import NotOwnFile
from . import live

LOG_HISTORY_BYTES = 256 * 1024  # the end of train.log a viewer shows from before it attached: read, not the whole log
HANDSHAKE_TIMEOUT = 5.0  # seconds a host has to answer a viewer's connection; it answers in milliseconds


class NotLive(Exception):
    """The run is not served (ended, or its host died): the message says which, and what to do."""


def connect(address: str, authkey: bytes, pid: int | None = None) -> connection.Connection:
    """multiprocessing's Client, with a time limit on the connect and the handshake: a socket that
    accepts and never answers (a host frozen, or something else at that path) would otherwise
    hold the viewer forever. The limit is lifted once the host has answered: events come when the
    run makes them. Before the handshake, the kernel says who holds the socket (live.check_peer):
    what comes through it is unpickled, so it must be this user's process (`pid`, where given)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        live.time_limits(sock, HANDSHAKE_TIMEOUT)
        sock.connect(address)
        live.check_peer(sock, pid)
    except BaseException:
        sock.close()
        raise
    conn = connection.Connection(sock.detach())
    try:
        connection.answer_challenge(conn, authkey)
        connection.deliver_challenge(conn, authkey)
        live.time_limits(conn, 0)
    except BaseException:
        conn.close()
        raise
    return conn


def history(run_dir: Path) -> list[object]:
    """The run so far: the end of train.log as log lines, then the run folder's history
    (history_file: its summary and the rows of metrics.jsonl after it) as one HistoryRead."""
    events: list[object] = [P.LogLine(line) for line in tail_lines(Path(run_dir) / TRAIN_LOG, LOG_HISTORY_BYTES)]
    events.append(P.HistoryRead(history_file.load(Path(run_dir))[0]))
    return events


class RunViewer:
    process_name = "run host"

    def __init__(self, run_dir: Path, host_process: subprocess.Popen | None = None):
        """`host_process`: the host, when this front-end started it (and so can wait for it)."""
        self.run_dir = Path(run_dir).resolve()
        self.host_process = host_process
        self.record = _record(self.run_dir)
        if not live.is_live(self.record):
            raise NotLive(f"{self.run_dir}: its engine died at step {self.record.step} without ending the run; "
                          f"resume it with: lmcockpit --run --resume {self.run_dir}")
        self.conn = self._connect()
        self.closed = False
        self.inbox: queue.Queue = queue.Queue()
        self.final_state: str | None = None
        self.failure: P.Failure | None = None
        self.viewers = 1
        self.last_step = self.record.step
        self._shown: dict[object, int] = {}  # the last step of each kind shown: what the history gave already
        self._lock = threading.Lock()
        threading.Thread(target=self._receive, name="viewer-receive", daemon=True).start()

    def _connect(self) -> connection.Connection:
        """A connection to the run's host, or NotLive saying why there is none, before anything
        the other end sent has been unpickled."""
        try:
            key = live.read_key(self.run_dir)
        except NotOwnFile as e:
            raise NotLive(f"cannot attach: {e} (a key someone else wrote proves nothing about the host)") from None
        except OSError as e:
            raise NotLive(f"{self.run_dir}: cannot read the run's key {live.KEY} ({e.strerror or e})") from None
        try:
            return connect(self.record.socket, key, self.host_pid)
        except live.WrongPeer as e:
            raise NotLive(f"{self.run_dir}: the socket at {self.record.socket} is held by {e}: attach refused "
                          f"(live.json is stale, or was not written by this user's run host)") from None
        except AuthenticationError:
            raise NotLive(f"{self.run_dir}: the run's host refused this key ({live.KEY} was replaced?)") from None
        except BlockingIOError:  # the time limit
            raise NotLive(f"{self.run_dir}: the run's host at {self.record.socket} did not answer within "
                          f"{HANDSHAKE_TIMEOUT:.0f} s") from None
        except (OSError, EOFError) as e:
            raise NotLive(f"{self.run_dir}: cannot reach the run's host at {self.record.socket} ({e})") from None

    @property
    def host_pid(self) -> int | None:
        """The pid the host's socket must be held by: live.json's, where that names this machine
        (a host on another one, sharing the run folder, has a pid this machine cannot check)."""
        return self.record.pid if self.record.machine == socket.gethostname() else None

    @property
    def pid(self) -> int:
        return self.record.pid

    # ------------------------------------------------------------------------------ events
    def _receive(self) -> None:
        while True:
            try:
                event = self.conn.recv()
            except (EOFError, OSError):  # the host is gone, or `close` shut the connection down
                break
            if isinstance(event, P.Catchup):
                self._catch_up(event)
            else:
                self.inbox.put(event)
        with self._lock:  # not while `send` writes to it
            self.conn.close()
        self.inbox.put(_GONE)

    def _catch_up(self, catchup: P.Catchup) -> None:
        self.viewers = catchup.viewers
        started = next((e for e in catchup.snapshot if isinstance(e, P.RunStarted)), None)
        try:
            past = history(self.run_dir)
        except Exception as e:  # noqa: BLE001 - this thread is the viewer's only ear: it must not end unheard
            past = [P.LogLine(f"warning: the run's history was not read ({type(e).__name__}: {e}); "
                              f"live events go on")]
        if catchup.reason == "lagged":  # the log pane has the lines it showed; steps may be missing
            past = [e for e in past if not isinstance(e, P.LogLine)]
        # When the host began the run: elapsed is the run's, not the time since this viewer attached.
        began = [live.Began(self.record.started)] if self.record.started else []
        # The snapshot's RunStarted first (it resets the view), then what happened, then the state now.
        for event in ([started] if started else []) + began + past + [e for e in catchup.snapshot if e is not started]:
            self.inbox.put(event)

    def poll(self, timeout: float = 0.1) -> object | None:
        """The next event not shown yet; None when none came within `timeout`. When the host is
        gone: a final StateChanged once (FAILED if the run had not ended), then `done`."""
        while True:
            try:
                event = self.inbox.get(timeout=timeout)
            except queue.Empty:
                return None
            if event is _GONE:
                return self._gone()
            if self._fresh(event):
                return self._observe(event)

    def _fresh(self, event: object) -> bool:
        """A step, evaluation or checkpoint at or below one already shown is the history's copy."""
        if isinstance(event, (P.StepMetrics, P.EvalMetrics, P.CheckpointWritten)):
            what = _what(event)
            if event.step <= self._shown.get(what, -1):
                return False
            self._shown[what] = event.step
        elif isinstance(event, P.RunStarted):
            self._shown.clear()
        elif isinstance(event, P.HistoryRead):
            self._shown.update(_history_shown(event.history))
        elif isinstance(event, P.RolledBack):
            # The steps after to_step come again, on other batches: not copies of those shown.
            self._shown = {what: min(step, event.to_step) for what, step in self._shown.items()}
        return True

    def _observe(self, event: object) -> object:
        if isinstance(event, P.Failure):
            self.failure = event
        elif isinstance(event, P.StateChanged) and event.state in P.TERMINAL_STATES:
            self.final_state = event.state
        elif isinstance(event, P.StepMetrics):
            self.last_step = event.step
        return event

    def _gone(self) -> object | None:
        if self.final_state is not None:  # ended in order: nothing more to say
            return None
        if self.host_alive:
            what = "the connection to the run's host was lost; the run goes on: attach again"
            self.final_state = P.INTERRUPTED
            return P.StateChanged(P.INTERRUPTED, what)
        what = (f"the run host (pid {self.record.pid}) is gone at step {self.last_step}; resume with: "
                f"lmcockpit --run --resume {self.run_dir}")
        self.failure, self.final_state = P.Failure(what), P.FAILED
        return P.StateChanged(P.FAILED, what)

    @property
    def done(self) -> bool:
        return self.final_state is not None

    @property
    def host_alive(self) -> bool:
        if self.host_process is not None:
            return self.host_process.poll() is None
        return live.alive(self.record.pid)

    @property
    def exitcode(self) -> int | None:
        """The host's exit code (the run's outcome: 0 ended in order, 1 failed), where this
        front-end started it and it has ended; else None."""
        return self.host_process.poll() if self.host_process is not None else None

    def join(self, timeout: float | None = None) -> None:
        """Wait for the host to end (the run's files are then complete), `timeout` seconds at most."""
        if self.host_process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.host_process.wait(timeout)
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while live.alive(self.record.pid) and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.1)  # not our child: nothing to wait on but its pid

    # ---------------------------------------------------------------------------- commands
    def send(self, command: object) -> None:
        """To the run, also after `close` (through a connection of its own, as any viewer's)."""
        with self._lock:
            try:
                if not self.closed:
                    self.conn.send(command)
                    return
                with connect(self.record.socket, live.read_key(self.run_dir), self.host_pid) as c:
                    c.send(command)
            except (OSError, ValueError, EOFError, AuthenticationError):
                pass  # the host is gone: poll (or host_alive) says so

    def close(self) -> None:
        """Detach: the run goes on. The connection is shut down here and closed by the receiving
        thread once its read returns. Closed here, its descriptor's number could go to the next
        connection this process makes while that thread is between two reads of the number: its
        next read would take that connection's bytes (an attach right after a detach failed its
        handshake with "bad message length")."""
        with self._lock:
            self.closed = True
            try:
                with socket.socket(fileno=os.dup(self.conn.fileno())) as both_ends:
                    both_ends.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed already: the host went first


def _what(event: object) -> object:
    """What `_fresh` counts steps of: an event's type; for an evaluation, also what it holds. The
    validation loss and the task scores have cadences of their own: an evaluation of one is no
    copy of an evaluation of the other at the same step."""
    if isinstance(event, P.EvalMetrics):
        return P.EvalMetrics, event.val_loss is not None, bool(event.tasks)
    return type(event)


def _history_shown(h) -> dict[object, int]:
    """What `_fresh` counts as shown once a history is: its last step, evaluation of each kind and
    checkpoint. An evaluation with both a validation loss and task scores is a copy if both are."""
    val = h.evals[-1][0] if h.evals else -1
    tasks = max((points[-1][0] for points in h.tasks.values() if points), default=-1)
    return {P.StepMetrics: h.last_step if h.count else -1, (P.EvalMetrics, True, False): val,
            (P.EvalMetrics, False, True): tasks, (P.EvalMetrics, True, True): min(val, tasks),
            P.CheckpointWritten: h.checkpoints[-1][0] if h.checkpoints else -1}


def _record(run_dir: Path) -> live.LiveRecord:
    """The run's live.json, or NotLive saying why there is none this user can act on."""
    try:
        return live.LiveRecord.load(run_dir)
    except FileNotFoundError:
        raise NotLive(f"{run_dir}: no run is being served here (it ended, or was not started from "
                      "the cockpit or with --detach)") from None
    except NotOwnFile as e:
        raise NotLive(f"cannot attach: {e} (it names the socket to trust: only this user's own is read)") from None
    except OSError as e:
        raise NotLive(f"{run_dir}: cannot read {live.RECORD} ({e.strerror or e})") from None
    except ValueError as e:  # live.BadRecord: its message names the file
        raise NotLive(f"cannot attach: {e}") from None


_GONE = object()

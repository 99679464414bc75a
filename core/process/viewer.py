"""A front-end's handle on a run that a run host serves, as `lmcockpit attach` and the dashboards hold it.

It connects to the run host (host.py) through the address in the run's `live.json`. Torch-free.

It offers what runner.ProcessHandle offers the dashboard (`poll`, `send`, `done`, `final_state`,
`failure`, `run_dir`), so a dashboard does not know whether it owns its engine or watches one.
On attaching, and again whenever the host says it had to drop events for this viewer, the run so
far comes from the host itself (P.Catchup): the run's RunStarted, when the host began it, the end
of its log, its history and its state now, as the host's own fold of the run's events
(core/run/state.py) stood before the next event this viewer is sent. Every event is shown once:
the catch-up and the live events are one stream, cut at one point. It attaches only to the user's
own run host, checked before the handshake (live.py says how): what the host sends is unpickled.
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
from ..run.safe_files import NotOwnFile
from . import live
from .detached import Detached

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


class RunViewer:
    process_name = "run host"

    def __init__(self, run_dir: Path, host_process: Detached | None = None):
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
        for event in catchup.snapshot:
            self.inbox.put(event)

    def poll(self, timeout: float = 0.1) -> object | None:
        """The next event; None when none came within `timeout`. When the host is gone: a final
        StateChanged once (FAILED if the run had not ended), then `done`."""
        try:
            event = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        if event is _GONE:
            return self._gone()
        return self._observe(event)

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

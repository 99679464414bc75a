"""The run host: owns a detachable run's engine, outlives every front-end, serves any number of viewers.

`lmcockpit` (the cockpit) and `lmcockpit PRESET --detach` start runs through a host: a fork of
the front-end's forkserver in a session of its own, nobody's child (detached.py: so a closed
terminal or a dropped SSH connection sends it no SIGHUP, and the front-end may quit), which starts
the engine as a front-end would (runner.EngineProcess, multiprocessing queues; a plain fork of
the host, which holds the forkserver's imports) and stays its parent: the engine's "my front-end
is gone" rule now means "the host is gone". The host serves the run on a Unix socket (live.py
says where, and how a viewer proves it may attach):

* the host keeps the run's one fold of its events (core/run/state.py's RunState, started from the
  run folder: a resumed run's history), which live.json's summary, the stall watch and the
  notifications read; a viewer that joins is handed it (`Catchup("attached")`), then the events
  after it;
* every event goes to every viewer, through a queue of its own with a sending thread of its own:
  a viewer that stops reading (a frozen SSH session) fills its queue and loses events, never
  slows the others or training. Its dropped events are replaced by the run's state as it then
  stands (`Catchup("lagged")`);
* commands from any viewer go to the engine in the order they arrive; their effects come back
  to every viewer as events;
* a connection from a process of another uid is refused before the handshake (the kernel says
  whose it is: SO_PEERCRED), and one that does not present the run's key is refused; each
  refusal is logged. What a viewer sends is unpickled: only the user's own processes get that far,
  and a viewer checks the host the same way (live.py says what each end trusts).

The handshake runs in the connection's own thread: a client that connects and says nothing holds
up no one, and is let go after HANDSHAKE_LIMIT. Nothing listens on a network port. The host's log (host.log) and the run's (train.log)
are appended to never through a link, and only as the user's own files (safe_files). The
front-end that started the host learns how the run's start went through a pipe of its own
(report.py).

Headless `--run` keeps owning its engine directly: a signal there still checkpoints and stops.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import signal
import socket
import threading
import time
from multiprocessing import AuthenticationError, connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

from .. import protocol as P
from ..config import config_from_dict, read_toml
from ..run import history_file
from ..run.folder import CONFIG, TRAIN_LOG, tail_lines
from ..run.safe_files import fresh_runtime_dir, open_log
from ..run.state import RunState
from . import detached, live, warm_start
from .rendezvous import Rendezvous
from .report import Reports, StartReport
from .runner import EngineProcess
from .notify import Announcer, Notifier
from .stall import StallWatch

VIEWER_QUEUE = 4096  # events held for one viewer before it counts as fallen behind
LOG_HISTORY_BYTES = 256 * 1024  # the end of train.log a resumed run's viewers are shown: read, not the whole log
RECORD_EVERY = 1.0  # seconds between rewrites of live.json's summary
PRELOAD = (*warm_start.ENGINE, "lmcockpit.core.process.host")  # a forkserver that starts a host imports them
HOST_LOG = "host.log"  # the host's own stdout and stderr: what went wrong before it could serve
HANDSHAKE_LIMIT = 10.0  # seconds a connection has to prove the key; a viewer takes milliseconds
ACCEPT_BACKOFF = 0.2  # seconds between tries to accept while the process has no descriptor to spare
# accept's errors that pass: out of descriptors or kernel memory, freed as viewers and files close
SHORT_OF = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class HostError(Exception):
    """The host could not start: the message carries the last it printed."""


class AttachedViewer:
    """One attached front-end: events out through a bounded queue and a thread, commands in
    through another thread.

    The connection's descriptor is closed by the last of the two threads to end, never while the
    other may still use it: a number closed under a thread about to write would go to the next
    connection this host accepts, and the write (a Catchup, an event) would land in that viewer's
    handshake ("refused a connection", an attach that times out). Ending is a shutdown of both
    directions, which wakes the other thread: the sender through its queue, the receiver by EOF."""

    def __init__(self, conn: connection.Connection, server: RunServer):
        self.conn, self.server = conn, server
        self.outbox: queue.Queue = queue.Queue(maxsize=VIEWER_QUEUE)
        self.closed = False  # hung up: the server has forgotten it
        self._lock = threading.Lock()
        self._running = 2  # its threads: the last to end closes the descriptor
        self.sender = threading.Thread(target=self._send, name="viewer-send", daemon=True)
        self.sender.start()
        threading.Thread(target=self._receive, name="viewer-receive", daemon=True).start()

    def offer(self, event: object) -> None:
        """Under the server's lock (broadcast, admit): events queue in the order the run's state
        folded them."""
        try:
            self.outbox.put_nowait(event)
        except queue.Full:
            # Behind by a whole queue: what it has not read is dropped, and its sender hands it the
            # run's state instead when it gets that far (`_send`).
            self._replace_outbox(_LAGGED)

    def drop_events(self) -> None:
        """Under the server's lock: the events queued are folded into the state about to be sent
        instead. What ends the sending stays."""
        with self.outbox.mutex:
            kept = [e for e in self.outbox.queue if e is None or e is _HUNG_UP]
            self.outbox.queue.clear()
            self.outbox.queue.extend(kept)

    def _replace_outbox(self, *events: object) -> None:
        with self.outbox.mutex:
            self.outbox.queue.clear()
        for event in events:
            self.outbox.put_nowait(event)

    def _send(self) -> None:
        try:
            while (event := self.outbox.get()) is not None and event is not _HUNG_UP:  # None: the run ended
                if event is _LAGGED:
                    event = self.server.catchup(self, "lagged")
                if isinstance(event, bytes):  # a catch-up, pickled while the state stood still
                    self.conn.send_bytes(event)
                else:
                    self.conn.send(event)
        except (OSError, ValueError):
            pass  # gone, or closed its end: what it sent before closing is still read
        finally:
            self.close()  # after the run's end: all is sent, the viewer reads EOF next
            self._ended()

    def _receive(self) -> None:
        try:
            while True:
                try:
                    command = self.conn.recv()
                except (EOFError, OSError):
                    break
                self.server.on_command(command)
        finally:
            self.close()
            self._ended()

    def finish(self) -> None:
        """Send what is queued, then close."""
        try:
            self.outbox.put(None, timeout=5)
        except queue.Full:
            self.close()

    def close(self) -> None:
        """Hang up: both directions shut down, the sender woken, the server told. The descriptor
        stays open until both threads have ended (_ended)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                with socket.socket(fileno=os.dup(self.conn.fileno())) as both_ends:
                    both_ends.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the viewer went first
        self._replace_outbox(_HUNG_UP)
        self.server.forget_viewer(self)

    def _ended(self) -> None:
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last:
            self.conn.close()


_HUNG_UP = object()  # in a viewer's outbox: stop sending
_LAGGED = object()  # in a viewer's outbox, for what was dropped: send the run's state instead


class RunServer:
    """The run's socket, its viewers, and the run's state (`run`, the host's one fold of every
    event it broadcasts): a viewer that joins is handed the state as it stands before the next
    event it is sent, so it shows every event once. `began`: the run's start by the wall clock."""

    def __init__(self, run_dir: Path, on_command, log, run: RunState | None = None, began: float | None = None):
        self.run_dir = Path(run_dir)
        self.on_command, self.log = on_command, log
        self.run, self.began = run or RunState(), began
        self.key = live.new_key(self.run_dir)
        self.path = live.socket_path(self.run_dir)
        self.path.unlink(missing_ok=True)  # a dead host's
        # A socket of our own, not multiprocessing's Listener: closing that one unlinks its path,
        # which by then may be a resumed run's host's socket (close).
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        saved = os.umask(0o177)  # the socket file is 0600 from its first instant
        try:
            self.listener.bind(str(self.path))
        finally:
            os.umask(saved)
        self.listener.listen()
        self.inode = _inode(self.path)  # which socket file at that path is ours
        self.viewers: list[AttachedViewer] = []
        self.lock = threading.Lock()  # the viewers, and the run's state while it folds or is copied
        self.closing = False
        self.acceptor = threading.Thread(target=self._accept, name="accept", daemon=True)
        self.acceptor.start()

    def _accept(self) -> None:
        short_since = None  # since when no descriptor has been free to accept with
        while not self.closing:
            try:
                sock, _ = self.listener.accept()
            except OSError as e:
                if self.closing or e.errno not in SHORT_OF:
                    break  # closed: the run has ended
                # Out of descriptors for a moment (viewers by the hundred, a low `ulimit -n`): the
                # connection waits in the listen backlog until some are freed. Ended here, the run
                # would be served to no one for the rest of its days.
                if short_since is None:  # said once: to the viewers, and to train.log if it can be opened
                    short_since = time.monotonic()
                    self.log(f"out of descriptors ({e.strerror}; ulimit -n): viewers attaching wait until some "
                             "are freed")
                time.sleep(ACCEPT_BACKOFF)
                continue
            if short_since is not None:
                self.log(f"accepting viewers again after {time.monotonic() - short_since:.1f} s out of descriptors")
                short_since = None
            if not self._same_user(sock):
                continue
            try:
                sock.setblocking(True)
                # A connection that does not finish the handshake in time is let go: one that
                # connects and says nothing would hold its thread and descriptor for the run's life.
                live.time_limits(sock, HANDSHAKE_LIMIT)
            except OSError:
                sock.close()  # gone already
                continue
            conn = connection.Connection(sock.detach())
            threading.Thread(target=self._admit, args=(conn,), name="handshake", daemon=True).start()

    def _same_user(self, sock: socket.socket) -> bool:
        """Whether the connecting process runs as this host's user; one that does not is logged
        and hung up on before a byte is exchanged. The socket file is 0600: such a process is one
        that file modes do not stop (root's), or one that found them widened."""
        try:
            live.check_peer(sock)
            return True
        except live.WrongPeer as e:
            self.log(f"refused a connection from {e}")
        except OSError:
            pass  # gone already
        sock.close()
        return False

    def _admit(self, conn: connection.Connection) -> None:
        try:
            connection.deliver_challenge(conn, self.key)
            connection.answer_challenge(conn, self.key)
            live.time_limits(conn, 0)  # proven: from now on events come when the run makes them
        except AuthenticationError:
            self.log("refused a connection that did not present this run's key")
            conn.close()
            return
        except (OSError, EOFError):  # gone, or silent past HANDSHAKE_LIMIT (EAGAIN)
            conn.close()
            return
        with self.lock:  # the catch-up goes first: no event can come between it and the viewer's joining
            if self.closing:
                conn.close()
                return
            viewer = AttachedViewer(conn, self)
            self.viewers.append(viewer)
            watching = self.count  # counted with the change it reports: two threads log apart
            viewer.offer(self._catchup("attached", watching))
        self.log(f"a viewer attached ({watching} watching)")

    def catchup(self, viewer: AttachedViewer, reason: str) -> bytes:
        """For `viewer`, which fell behind: the run's state as it stands, in place of the events
        queued for it (folded into that state already)."""
        with self.lock:
            viewer.drop_events()
            return self._catchup(reason, self.count)

    def _catchup(self, reason: str, watching: int) -> bytes:
        """Under the lock: a Catchup pickled at once (as Connection.send would), so the sending
        thread sends the state as it is now while the run goes on folding into it."""
        return bytes(ForkingPickler.dumps(P.Catchup(reason, self.run.catchup(reason, self.began), watching)))

    @property
    def count(self) -> int:
        return len(self.viewers)

    def forget_viewer(self, viewer: AttachedViewer) -> None:
        with self.lock:
            if viewer not in self.viewers:
                return
            self.viewers.remove(viewer)
            watching = self.count
        if not self.closing:
            self.log(f"a viewer detached ({watching} watching)")

    def broadcast(self, event: object) -> None:
        """Folded into the run's state and queued for every viewer, in one step: a viewer that
        joins (or catches up) is handed the state before or after it, and the event only in the
        first case."""
        with self.lock:
            self.run.apply(event)
            for viewer in self.viewers:
                viewer.offer(event)

    def close(self, grace: float = 10) -> None:
        """After the last event: every viewer gets what is queued for it (a viewer that reads
        nothing, within `grace` seconds at most), then the socket goes."""
        with self.lock:
            self.closing = True
            viewers = list(self.viewers)
        for viewer in viewers:
            viewer.finish()
        deadline = time.monotonic() + grace
        for viewer in viewers:
            viewer.sender.join(max(0.0, deadline - time.monotonic()))
        # A close alone leaves the accept thread blocked on the socket for ever; a shutdown wakes
        # it (EINVAL), and it ends.
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        # A host started on this run meanwhile (a resume) has put its own socket at the same path
        # and then written its live.json (this host's went as its engine ended). The inode alone
        # cannot tell: the new socket file may get the number the old one freed.
        record = live.LiveRecord.read(self.run_dir)
        if _inode(self.path) == self.inode and (record is None or record.pid == os.getpid()):
            self.path.unlink(missing_ok=True)
            if fresh_runtime_dir(self.path.parent):  # made for this socket alone (a run folder's path too long)
                with contextlib.suppress(OSError):
                    self.path.parent.rmdir()


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class Summary:
    """live.json's figures, read from the host's RunState (the one fold of the run's events:
    `ps` and a dashboard give one ETA), rewritten at most once a RECORD_EVERY; with a target, its
    forecast as the run's latest evaluation left it."""

    def __init__(self, record: live.LiveRecord, run: RunState):
        self.record, self.run = record, run
        self.written = 0.0

    def apply(self, event: object) -> None:
        """After `event` was folded into the run's state."""
        r, run = self.record, self.run
        r.step, r.loss, r.state, r.eta_s = run.step, run.loss, run.state, run.eta
        if run.max_steps:
            r.max_steps = run.max_steps
        if isinstance(event, P.EvalMetrics) and (ahead := run.forecast) is not None:
            r.target = ahead.short(run.cost_per_hour)

    def write(self, viewers: int, force: bool = False) -> None:
        """OSError where live.json could not be written (the next try is a RECORD_EVERY later)."""
        now = time.monotonic()
        if force or now - self.written >= RECORD_EVERY:
            self.record.viewers = viewers
            self.written = now
            self.record.write()


def host(run_dir: Path, resume_from: Path | None, rendezvous: Rendezvous | None, label: str = "",
         ready_fd: int | None = None) -> int:
    """Run the engine to its end, serving it meanwhile. Exit code: the engine's outcome."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # no terminal is ours; a stray hang-up changes nothing
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cfg = config_from_dict(read_toml(run_dir / CONFIG), source=str(run_dir / CONFIG))
    report = StartReport(ready_fd)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    started = time.time()
    run = run_so_far(run_dir)  # before the engine writes a row: each is folded once
    # A fork of this process, which holds the forkserver's imports (detached.py): first, while
    # nothing here has started a thread that a fork would copy mid-step.
    engine = EngineProcess(cfg, run_dir, resume_from, rendezvous, fork=True)
    engine.start()

    def log(text: str) -> None:
        line = f"host: {text}"
        with contextlib.suppress(OSError), open_log(run_dir / TRAIN_LOG) as fh:  # refused: the viewers still see it
            fh.write(line + "\n")
        server.broadcast(P.LogLine(line))

    try:
        server = RunServer(run_dir, engine.send, log, run, began=started)
        record = live.LiveRecord(str(run_dir.resolve()), os.getpid(), socket.gethostname(), str(server.path),
                                 preset=label or run_dir.name, max_steps=cfg.training.max_steps, started=started)
        summary = Summary(record, run)
        summary.write(0, force=True)
        live.register(run_dir)
    except BaseException:  # not served, so not started: its engine goes first (the front-end reports why)
        engine.close()
        raise
    report.ready()  # serving: the front-end that started us may connect
    stopping = False
    watch = StallWatch(cfg.notify.stall_after, run)
    word = Announcer(Notifier(cfg.notify, run_dir.name, log=log), run)  # its targets checked before the run folder was made
    while not engine.done:
        if stop.is_set() and not stopping:
            stopping = True  # SIGTERM: the run checkpoints and stops, as a headless one would
            engine.send(P.Abort(save=True, interrupted=True))
        event = engine.poll(timeout=0.5)
        news = [event] if event is not None else []
        said = watch.heard() if event is not None else watch.check()
        if said:  # a stall begins or ends: live.json says so at once, for `ps`
            log(said)
            if watch.stalled:
                news.append(P.StateChanged(P.STALLED, watch.detail))
                word.stalled(watch.detail)
            elif not isinstance(event, P.StateChanged):  # the state the stall hid, given back
                news.insert(0, P.StateChanged(watch.state))
        for news_event in news:
            server.broadcast(news_event)  # folded into `run`, then sent
            summary.apply(news_event)
            word.heard(news_event)
        if event is not None:
            report.event(event)
        # Not written (a full disk, no descriptor free for the moment): the listing shows the last
        # one a little longer. The run and its viewers need no live.json to go on.
        with contextlib.suppress(OSError):
            summary.write(server.count, force=bool(said))

    report.ended(engine.final_state or P.FAILED, engine.failure)
    word.ended(engine.final_state or P.FAILED, engine.failure)
    stop_serving(run_dir, server)
    return 0 if engine.failure is None else 1


def run_so_far(run_dir: Path) -> RunState:
    """The run's state from its folder, before its engine starts: nothing for a new run; for a
    resumed one, its history (history_file: the summary the engine keeps, and the rows of
    metrics.jsonl after it) and the end of train.log, which a viewer that joins is shown."""
    run = RunState()
    try:
        for line in tail_lines(run_dir / TRAIN_LOG, LOG_HISTORY_BYTES):
            run.apply(P.LogLine(line))
        run.apply(P.HistoryRead(history_file.load(run_dir)[0]))
    except Exception as e:  # noqa: BLE001 - a damaged history costs the viewers its curve, never the run
        run.apply(P.LogLine(f"host: warning: the run's history was not read ({type(e).__name__}: {e}); "
                            "live events go on"))
    return run


def stop_serving(run_dir: Path, server: RunServer) -> None:
    """Once the engine has ended. Its run folder is free from that moment and a resume may start
    a host of its own on it, writing the same files: live.json and live.key go at once, not after
    the viewers' grace, and each file this host leaves is removed only if it is still its own."""
    live.release(run_dir, os.getpid(), server.key)
    server.close()


def spawn(run_dir: Path, resume_from: Path | None, rendezvous: Rendezvous | None, label: str,
          ready_w: int) -> detached.Detached:
    """A host for `run_dir` in a session of its own, reporting on `ready_w` (StartReport)."""
    with open_log(Path(run_dir) / HOST_LOG, "ab") as out:  # NotOwnFile: a link, someone else's file
        return detached.start(host, (Path(run_dir).resolve(), resume_from, rendezvous, label), out.fileno(),
                              passed=(ready_w,), preload=PRELOAD)


def start_with_reports(run_dir: Path, resume_from: Path | None = None, rendezvous: Rendezvous | None = None,
                       label: str = "", timeout: float = 60) -> tuple[detached.Detached, Reports]:
    """Start a host for `run_dir` (its config.toml already written) and return it once it serves,
    with what it goes on to report about the run's start. One that fails first is reported with
    the last it printed. `label`: what listings call the run (its preset)."""
    run_dir = Path(run_dir)
    ready_r, ready_w = os.pipe()  # the host writes "ready" into it once it serves, or dies closing it
    reports = Reports(ready_r)
    try:
        try:
            proc = spawn(run_dir, resume_from, rendezvous, label, ready_w)
        except OSError as e:  # host.log refused, or nothing forked (detached.start says which)
            raise HostError(f"the run host for {run_dir} did not start: {e}") from None
        finally:
            os.close(ready_w)
        try:
            said = reports.next(timeout)
        except EOFError:
            said = None
    except BaseException:  # Ctrl-C included: the host, if started, goes on (StartReport)
        reports.close()
        raise
    if said == "ready":
        return proc, reports
    reports.close()
    proc.kill()
    raise HostError(f"the run host for {run_dir} did not start: {last_words(run_dir)}")


def last_words(run_dir: Path) -> str:
    """The end of a host's log, on one line: what a host that died before it reported printed."""
    last = (Path(run_dir) / HOST_LOG).read_text(encoding="utf-8", errors="replace").strip().splitlines()[-5:]
    return " | ".join(last) or "it said nothing"


def start(run_dir: Path, resume_from: Path | None = None, rendezvous: Rendezvous | None = None,
          label: str = "", timeout: float = 60) -> detached.Detached:
    """`start_with_reports`, for a front-end that attaches at once and so needs no more of its reports."""
    proc, reports = start_with_reports(run_dir, resume_from, rendezvous, label, timeout)
    reports.close()
    return proc

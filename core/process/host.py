"""The run host: owns a detachable run's engine, outlives every front-end, serves any number of viewers.

`lmcockpit` (the cockpit) and `lmcockpit PRESET --detach` start runs through a host: a small
torch-free process in a session of its own (so a closed terminal or a dropped SSH connection
sends it no SIGHUP), which starts the engine exactly as a front-end would (runner.EngineProcess,
multiprocessing queues) and stays its parent: the engine's "my front-end is gone" rule now means
"the host is gone". The host serves the run on a Unix socket (live.py says where, and how a viewer
proves it may attach):

* every event goes to every viewer, through a queue of its own with a sending thread of its own:
  a viewer that stops reading (a frozen SSH session) fills its queue and loses events, never
  slows the others or training. Told `Catchup("lagged")`, it reads what it missed from the run
  folder, where the engine wrote it anyway;
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

import argparse
import contextlib
import errno
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from multiprocessing import AuthenticationError, connection
from pathlib import Path

from .. import protocol as P
from ..config import Config, config_from_dict, read_toml
from ..run.folder import CONFIG, TRAIN_LOG
from ..run.safe_files import fresh_runtime_dir, open_log
from ..run.target import Evaluations, forecast_aim
from . import live
from .rendezvous import Rendezvous
from .report import Reports, StartReport
from .runner import EngineProcess
from .notify import Announcer, Notifier
from .stall import StallWatch

VIEWER_QUEUE = 4096  # events held for one viewer before it counts as fallen behind
RECORD_EVERY = 1.0  # seconds between rewrites of live.json's summary
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
        try:
            self.outbox.put_nowait(event)
        except queue.Full:
            # Behind by a whole queue: drop what it has not read and tell it to catch up from the
            # run folder, which holds every step, evaluation and log line anyway.
            self._replace_outbox(self.server.catchup("lagged"), event)

    def _replace_outbox(self, *events: object) -> None:
        with self.outbox.mutex:
            self.outbox.queue.clear()
        for event in events:
            self.outbox.put_nowait(event)

    def _send(self) -> None:
        try:
            while (event := self.outbox.get()) is not None and event is not _HUNG_UP:  # None: the run ended
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


class RunServer:
    def __init__(self, run_dir: Path, on_command, log):
        self.run_dir = Path(run_dir)
        self.on_command, self.log = on_command, log
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
        self.lock = threading.Lock()
        self.snapshot: dict[type, object] = {}  # the latest RunStarted, StateChanged, Progress
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
            viewer.offer(P.Catchup("attached", tuple(self.snapshot.values()), watching))
        self.log(f"a viewer attached ({watching} watching)")

    def catchup(self, reason: str) -> P.Catchup:
        with self.lock:
            return P.Catchup(reason, tuple(self.snapshot.values()), self.count)

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
        with self.lock:
            if isinstance(event, (P.RunStarted, P.StateChanged, P.Progress)):
                self.snapshot[type(event)] = event
            viewers = list(self.viewers)
        for viewer in viewers:
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
    """live.json's figures, folded from events, rewritten at most once a RECORD_EVERY; with a
    target, its forecast refitted at each evaluation. The step time and ETA are folded as every
    front-end folds them (live.Pace, live.eta): `ps` and a dashboard give one ETA."""

    def __init__(self, record: live.LiveRecord, cfg: Config | None = None):
        self.record = record
        self.written = 0.0
        self.cfg = cfg
        self.evals = Evaluations()  # the target's: bounded, a day of evaluations or a year
        self.pace = live.Pace()
        self.step_time: float | None = None  # the pace's, as the forecast last used it

    def apply(self, event: object) -> None:
        r = self.record
        if isinstance(event, P.RunStarted):
            r.step, r.max_steps = event.start_step, event.max_steps
            self.pace.start(event.start_step)
        elif isinstance(event, P.StepMetrics):
            r.step, r.loss = event.step, event.loss
            self.pace.add(event.step, event.dt)
            self.step_time = self.pace.step_time
            r.eta_s = live.eta(r.step, r.max_steps, self.step_time)
        elif isinstance(event, P.RolledBack):  # the steps after to_step come again
            r.step = event.to_step
            self.pace.cut(event.to_step)
            self.step_time = self.pace.step_time
            r.eta_s = live.eta(r.step, r.max_steps, self.step_time)
        elif isinstance(event, P.StateChanged):
            r.state = event.state
            if event.state in P.TERMINAL_STATES:  # nothing more is coming
                r.eta_s = None
        elif isinstance(event, P.EvalMetrics) and self.cfg is not None:
            t = self.cfg.training
            value = (event.val_loss if t.target_val_loss else
                     (event.tasks.get(t.target_task) or {}).get("accuracy") if t.target_task else None)
            if value is not None:
                self.evals.add(event.step, value)
                ahead = forecast_aim(t.target_val_loss, t.target_task, t.target_accuracy, self.evals.values(),
                                     self.cfg.tokens_per_step, t.max_steps, self.step_time)
                r.target = ahead.short(self.cfg.hardware.cost_per_hour)

    def write(self, viewers: int, force: bool = False) -> None:
        """OSError where live.json could not be written (the next try is a RECORD_EVERY later)."""
        now = time.monotonic()
        if force or now - self.written >= RECORD_EVERY:
            self.record.viewers = viewers
            self.written = now
            self.record.write()


def host(run_dir: Path, resume_from: Path | None, rendezvous: Rendezvous | None, ready_fd: int | None = None,
         label: str = "") -> int:
    """Run the engine to its end, serving it meanwhile. Exit code: the engine's outcome."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # no terminal is ours; a stray hang-up changes nothing
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cfg = config_from_dict(read_toml(run_dir / CONFIG), source=str(run_dir / CONFIG))
    engine = EngineProcess(cfg, run_dir, resume_from, rendezvous)

    def log(text: str) -> None:
        line = f"host: {text}"
        with contextlib.suppress(OSError), open_log(run_dir / TRAIN_LOG) as fh:  # refused: the viewers still see it
            fh.write(line + "\n")
        server.broadcast(P.LogLine(line))

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    server = RunServer(run_dir, engine.send, log)
    record = live.LiveRecord(str(run_dir.resolve()), os.getpid(), socket.gethostname(), str(server.path),
                             preset=label or run_dir.name, max_steps=cfg.training.max_steps, started=time.time())
    summary = Summary(record, cfg)
    summary.write(0, force=True)
    live.register(run_dir)
    engine.start()
    report = StartReport(ready_fd)
    report.ready()  # serving: the front-end that started us may connect
    stopping = False
    watch = StallWatch(cfg.notify.stall_after)
    word = Announcer(Notifier(cfg.notify, run_dir.name, log=log))  # its targets checked before the run folder was made
    while not engine.done:
        if stop.is_set() and not stopping:
            stopping = True  # SIGTERM: the run checkpoints and stops, as a headless one would
            engine.send(P.Abort(save=True, interrupted=True))
        event = engine.poll(timeout=0.5)
        news = [event] if event is not None else []
        said = watch.heard(event) if event is not None else watch.check()
        if said:  # a stall begins or ends: live.json says so at once, for `ps`
            log(said)
            if watch.stalled:
                news.append(P.StateChanged(P.STALLED, watch.detail))
                word.stalled(watch.detail)
            elif not isinstance(event, P.StateChanged):  # the state the stall hid, given back
                news.insert(0, P.StateChanged(watch.state))
        for news_event in news:
            summary.apply(news_event)
            server.broadcast(news_event)
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


def stop_serving(run_dir: Path, server: RunServer) -> None:
    """Once the engine has ended. Its run folder is free from that moment and a resume may start
    a host of its own on it, writing the same files: live.json and live.key go at once, not after
    the viewers' grace, and each file this host leaves is removed only if it is still its own."""
    live.release(run_dir, os.getpid(), server.key)
    server.close()


def spawn(run_dir: Path, resume_from: Path | None, rendezvous: Rendezvous | None, label: str,
          ready_w: int) -> subprocess.Popen:
    """A host for `run_dir` in a session of its own, reporting on `ready_w` (StartReport)."""
    args = [sys.executable, "-m", "lmcockpit.core.process.host", str(run_dir), "--ready-fd", str(ready_w)]
    if resume_from is not None:
        args += ["--resume", str(resume_from)]
    if rendezvous is not None:
        args += ["--rendezvous", json.dumps(asdict(rendezvous))]
    if label:
        args += ["--label", label]
    with open_log(Path(run_dir) / HOST_LOG, "ab") as out:  # NotOwnFile: a link, someone else's file
        return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, pass_fds=(ready_w,))


def start_with_reports(run_dir: Path, resume_from: Path | None = None, rendezvous: Rendezvous | None = None,
                       label: str = "", timeout: float = 60) -> tuple[subprocess.Popen, Reports]:
    """Start a host for `run_dir` (its config.toml already written) and return it once it serves,
    with what it goes on to report about the run's start. One that fails first is reported with
    the last it printed. `label`: what listings call the run (its preset)."""
    run_dir = Path(run_dir)
    ready_r, ready_w = os.pipe()  # the host writes "ready" into it once it serves, or dies closing it
    reports = Reports(ready_r)
    try:
        try:
            proc = spawn(run_dir, resume_from, rendezvous, label, ready_w)
        except OSError as e:  # host.log refused, or the interpreter not started
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
          label: str = "", timeout: float = 60) -> subprocess.Popen:
    """`start_with_reports`, for a front-end that attaches at once and so needs no more of its reports."""
    proc, reports = start_with_reports(run_dir, resume_from, rendezvous, label, timeout)
    reports.close()
    return proc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lmcockpit.core.process.host")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--resume", type=Path)
    ap.add_argument("--rendezvous", type=json.loads)
    ap.add_argument("--ready-fd", type=int)
    ap.add_argument("--label", default="")
    a = ap.parse_args(argv)
    return host(a.run_dir.resolve(), a.resume, Rendezvous(**a.rendezvous) if a.rendezvous else None, a.ready_fd,
                a.label)


if __name__ == "__main__":
    sys.exit(main())

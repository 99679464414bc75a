"""The front-end's handle on the engine process: start it, send commands, receive events.

No torch here: the engine process imports it, the front-end never does. An engine that dies
without saying so (SIGKILL, the OOM killer, a segfault) is noticed from its exit code and
reported as a `Failure` like any other.
"""

from __future__ import annotations

import contextlib
import queue
import signal
from pathlib import Path

from .. import protocol as P
from ..config import Config
from ..run.folder import METRICS, MetricsLog, TRAIN_LOG
from ..run.safe_files import open_log
from . import warm_start
from .rendezvous import Rendezvous


class ProcessHandle:
    """A child process that speaks the protocol: commands in, events out. Subclasses name the
    process's entry point and may watch events (`observe`) or record a silent death."""

    process_name = "lmcockpit-engine"
    preload = warm_start.ENGINE  # what its forkserver imports, if this process is the one that starts it

    def __init__(self, target, args: tuple, fork: bool = False):
        """`fork`: a plain fork of this process rather than of the forkserver, for the run host,
        which is itself a fork of a front-end's forkserver (its imports) and has no thread yet."""
        ctx = warm_start.context(self.preload)
        # A queue's semaphore starts multiprocessing's resource tracker, deaf as the forkserver is.
        # The forkserver's queues even for a plain fork: they travel on to torchrun's ranks, forks
        # of a forkserver, and one made for a fork may not ("A SemLock created in a fork context").
        with warm_start.starting():
            self.events = ctx.Queue()
            self.commands = ctx.Queue()
        kind = warm_start.ForkedProcess if fork else warm_start.Process
        self.process = kind(target=warm_start.as_if_spawned, name=self.process_name,
                            args=(warm_start.Inherited(), target, *args, self.events, self.commands))
        self.final_state: str | None = None
        self.failure: P.Failure | None = None

    def start(self) -> None:
        with warm_start.starting():
            self.process.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def send(self, command: object) -> None:
        if self.process.is_alive():
            self.commands.put(command)

    def poll(self, timeout: float = 0.1) -> object | None:
        """The next event, or None when none came within `timeout`. After the process ended and
        every event was read, returns a final StateChanged once, synthesised if it died without
        one; `done` is then true."""
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            if self.process.is_alive() or self.final_state is not None:
                return None
            return self._death()
        if isinstance(event, P.Failure):
            self.failure = event
        elif isinstance(event, P.StateChanged) and event.state in P.TERMINAL_STATES:
            self.final_state = event.state
        self.observe(event)
        return event

    def observe(self, event: object) -> None:
        pass

    def record_death(self, what: str) -> None:
        pass

    def _death(self) -> P.StateChanged:
        self.process.join()
        code = self.process.exitcode
        if code is not None and code < 0:
            what = f"the {self.process_name} process was killed by {signal.Signals(-code).name}"
        else:
            what = f"the {self.process_name} process exited with code {code} without reporting why"
        self.failure = P.Failure(what)
        self.final_state = P.FAILED
        self.record_death(what)
        return P.StateChanged(P.FAILED, what)

    @property
    def done(self) -> bool:
        return self.final_state is not None

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()

    def join(self, timeout: float | None = None) -> None:
        self.process.join(timeout)

    def close(self, timeout: float = 10) -> None:
        """Ask it to stop without saving, and make sure it has."""
        self.send(P.Abort(save=False))
        self.join(timeout)
        self.kill()
        self.join()


class EngineProcess(ProcessHandle):
    """The training engine (core/process/engine.py) for one run folder."""

    def __init__(self, cfg: Config, run_dir: Path, resume_from: Path | None = None,
                 rendezvous: Rendezvous | None = None, fork: bool = False):
        from .engine import main  # torch-free at import: torch loads in the child

        # Several processes go through torchrun; so does one when a rendezvous is asked for
        # (`--nproc 1`: the multi-process path on one GPU).
        if rendezvous is None and cfg.world > 1:
            rendezvous = Rendezvous()
        if rendezvous is not None:
            rendezvous.check(cfg)
        super().__init__(main, (str(run_dir), cfg.to_dict(), str(resume_from) if resume_from else None, rendezvous),
                         fork)
        self.run_dir = Path(run_dir)
        self.last_step = 0

    def observe(self, event: object) -> None:
        if isinstance(event, P.StepMetrics):
            self.last_step = event.step
        elif isinstance(event, P.RunStarted):
            self.last_step = event.start_step

    def record_death(self, what: str) -> None:
        # The engine could not record its own death: the run folder gets it from here. A log that
        # is refused (a link, someone else's file: safe_files) or cannot be written keeps it out
        # of the folder only; the front-end still reports it.
        with contextlib.suppress(OSError), open_log(self.run_dir / TRAIN_LOG) as fh:
            fh.write(f"front-end: {what}\n")
        with contextlib.suppress(OSError):
            metrics = MetricsLog(self.run_dir / METRICS)
            metrics.write(P.Failed(self.last_step, what))
            metrics.close()

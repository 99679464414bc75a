"""What every engine-side process is made of: the engine itself, each torchrun rank and the chat engine.

Signals held from the first instant, stdout and stderr pumped into train.log and the events queue
(each evaluation's line too, which the Trainer sends only as an event), the run header, commands
polled between steps, the Trainer run in this process, and the last events handed over. Importing
this module imports no torch.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import platform
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import NoReturn

from .. import protocol as P
from ..config import ConfigError, config_from_dict
from ..run.folder import append_whole
from ..run.safe_files import NotOwnFile, open_append

_EOF = "\x00lmcockpit-log-eof\x00"
_FILE_ONLY = "\x00lmcockpit-file-only\x00"  # before a printed line: into train.log, not onto the events
# torch.profiler's C++ side says on stderr when it starts and stops: train.log keeps it, the log
# pane is spared it (a profile's own lines say what was recorded).
_PROFILER_SAYS = re.compile(r"USDT:.*\] profiler_(start|stop)$")
_EARLY_SIGNALS: list[str] = []


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop the run in order: SIGTERM, and SIGHUP unless this process started with
    it ignored. `nohup lmcockpit --run ...` asks that a hang-up change nothing; the front-end
    leaves it ignored, each process of the run inherits that, and none may undo it."""
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        return (signal.SIGTERM,)
    return signal.SIGTERM, signal.SIGHUP


def hold_signals() -> None:
    """First thing in the engine: the log pump and torch's import take a second or more, and a
    SIGTERM or SIGHUP in that time must still stop the run in order (Commands takes it over)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in stop_signals():
        signal.signal(sig, lambda signum, frame: _EARLY_SIGNALS.append(signal.Signals(signum).name))


def early_signal() -> str | None:
    return _EARLY_SIGNALS.pop() if _EARLY_SIGNALS else None


class LogPump:
    """Copies everything written to fd 1 and 2 into train.log and onto the events queue. A line
    that a full disk keeps out of train.log still reaches the events, and the first line that fits
    again says how many are missing: the pump must not die, or the training writing into its pipe
    would block for good once the pipe filled."""

    def __init__(self, log_path: Path, events, prefix: str = ""):
        self.events = events
        self.prefix = prefix  # "rank1: " under several processes
        # train.log never through a link, and only the user's own (safe_files); the chat engine's
        # os.devnull is no regular file, and no one's to plant.
        self.log_fd = (os.open(os.devnull, os.O_WRONLY) if str(log_path) == os.devnull else open_append(log_path))
        self.missing = 0  # lines a full disk kept out of train.log, not yet said there
        r, w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.close(w)
        sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
        self._reader = open(r, encoding="utf-8", errors="replace")
        self.thread = threading.Thread(target=self._pump, name="log-pump", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        for line in self._reader:
            line = line.rstrip("\n")
            if line == _EOF:
                break
            forward = not line.startswith(_FILE_ONLY) and not _PROFILER_SAYS.match(line)
            line = self.prefix + line.removeprefix(_FILE_ONLY)
            self._to_file(line)
            if forward:
                self.events.put(P.LogLine(line))

    def _to_file(self, line: str) -> None:
        if self.missing and append_whole(self.log_fd, f"[{self.missing} lines missing here: the disk was "
                                                      "full]\n".encode()):
            self.missing = 0
        if self.missing or not append_whole(self.log_fd, (line + "\n").encode("utf-8", "replace")):
            self.missing += 1

    def close(self) -> None:
        # A sentinel rather than EOF: compile workers inherit fd 1/2 and keep the pipe open.
        print(_EOF, flush=True)
        sys.stderr.flush()
        self.thread.join(timeout=10)
        os.close(self.log_fd)


def run_header(spec_run_dir: str) -> str:
    """What makes a result reproducible: versions, machine and GPUs, written first in train.log."""
    import torch
    from ... import __version__

    lines = [f"lmcockpit {__version__} | python {platform.python_version()} | torch {torch.__version__}"
             f" | {platform.platform()} | pid {os.getpid()}", f"run folder: {spec_run_dir}"]
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=10).stdout
            lines.append(out.rstrip())
        except (OSError, subprocess.TimeoutExpired):
            pass
    return "\n".join(lines)


class Commands:
    """Commands from the front-end, plus the engine's own reasons to stop (signals, lost parent)."""

    def __init__(self, commands):
        self.commands = commands  # None: a rank other than 0, which hears only signals and its parent
        self.signalled = early_signal()  # a signal not yet turned into an Abort
        self.stop_signal = self.signalled  # the last signal received, kept
        self.parent = mp.parent_process()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for sig in stop_signals():
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = self.stop_signal = signal.Signals(signum).name

    def next(self, block: bool):
        if self.signalled:
            print(f"engine: {self.signalled} received; writing a checkpoint and stopping")
            self.signalled = None
            return P.Abort(save=True, interrupted=True)
        if self.parent is not None and not self.parent.is_alive():
            print("engine: the front-end is gone; writing a checkpoint and stopping")
            self.parent = None
            return P.Abort(save=True, interrupted=True)
        if self.commands is None:
            return None
        try:
            return self.commands.get(timeout=0.2) if block else self.commands.get_nowait()
        except queue.Empty:
            return None
        except (EOFError, OSError):  # the queue's other end closed: same as a lost parent
            return P.Abort(save=True, interrupted=True)


def eval_line(ev: P.EvalMetrics) -> str:
    """An evaluation as train.log and `--run`'s output give it: the validation loss, then each
    task's accuracy and CORE (an evaluation may hold either)."""
    fields = [f"eval step {ev.step}"]
    if ev.val_loss is not None:
        fields += [f"val loss {ev.val_loss:.4f}", f"val bpb {ev.val_bpb:.4f}" if ev.val_bpb is not None else "val bpb –"]
    fields += [f"{name} {scores['accuracy']:.3f}" for name, scores in ev.tasks.items()]
    if ev.core is not None:
        fields.append(f"CORE {ev.core:.3f}")
    return " | ".join(fields)


def saying_evaluations(emit):
    """`emit`, with each evaluation's line after its EvalMetrics. The Trainer sends an evaluation as
    an event, which each front-end shows its own way; its line is written here, so that train.log
    holds it as it holds everything else the engine says: printed into train.log alone (through the
    pump, after the lines printed before it, a `tasks:` line), and sent as a LogLine right after the
    EvalMetrics, so a front-end that prints the evaluation itself (`--run`'s, with the target's
    forecast) knows the copy for what it is."""
    def emit_and_say(event: object) -> None:
        emit(event)
        if isinstance(event, P.EvalMetrics):
            line = eval_line(event)
            print(_FILE_ONLY + line, flush=True)
            emit(P.LogLine(line))
    return emit_and_say


def train(run_dir: str, config: dict, resume_from: str | None, events, cmds: Commands, group=None,
          emit=None) -> tuple[str, P.Failure | None]:
    """Run the Trainer in this process (the engine itself, or one rank of several): (final state,
    failure or None). A failure is printed (so train.log has it); one process also records it in
    metrics.jsonl (of several, the launcher records the run's verdict instead)."""
    final, failure, trainer = P.FAILED, None, None
    try:
        from ..train.group import Group
        from ..train.trainer import Trainer

        cfg = config_from_dict(config, source=str(Path(run_dir) / "config.toml"))
        ours = group or Group()  # `group` stays None for one process: the failure row below is its to write
        emit = emit or events.put
        trainer = Trainer(cfg, Path(run_dir), saying_evaluations(emit) if ours.is_main else emit, print, cmds.next,
                          ours, resume_from=resume_from)
        final = trainer.run()
        ended = P.Ended(trainer.step, final, trainer.between.take())
        trainer.metrics.write(ended)  # run_summary's status, as the engine names it
        if ours.is_main:  # and the time the last evaluation and checkpoint took, for the front-end's summary
            emit(ended)
    except ConfigError as e:
        failure = P.Failure(str(e), user_error=True)
    except NotOwnFile as e:  # a link or someone else's folder planted where the run writes, found mid-run
        failure = P.Failure(f"{e} (remove it if you did not put it there)", user_error=True)
    except P.RunFailure as e:
        failure = P.Failure(str(e))
    except Exception as e:  # noqa: BLE001 - every failure must reach the front-end
        tb = traceback.format_exc()
        print(tb, end="")
        failure = P.Failure(f"{type(e).__name__}: {e}", tb)
    finally:
        if trainer is not None:
            if failure is not None and group is None:
                trainer.metrics.write(P.Failed(trainer.step, failure.message))
            trainer.close(failed=failure is not None)
    return final, failure


def flush_events(events, timeout: float = 30.0) -> bool:
    """Hand the last events to the front-end, waiting at most `timeout`. A front-end that is gone
    or no longer reading leaves the pipe full, and this process holds the pipe's read end too (a
    queue travels with both), so an unbounded join would never return: give up instead."""
    events.close()
    joiner = threading.Thread(target=events.join_thread, daemon=True)
    joiner.start()
    joiner.join(timeout)
    if joiner.is_alive():
        events.cancel_join_thread()
        return False
    return True


def exit_now(code: int) -> NoReturn:
    """End this process without the interpreter's teardown, once its events are flushed and the
    files it wrote are closed. What teardown would still do is free torch's modules object by object:
    0.9 s after the last event of every engine on 2 CPU cores, and a run's end, the chat window's
    close and each test that starts an engine waited for it. What teardown does that matters is
    done here first: the threads it would wait for are joined, and the exit handlers Python code
    registered run (multiprocessing ends the workers it started, inductor its compile workers).

    The threads are joined by threading._shutdown, what the interpreter calls at exit (and
    multiprocessing at the end of each process it starts): it first tells thread pools to let their
    idle workers go. A plain join of every thread waited forever for inductor's, idle after a
    compiled run's samples."""
    # Both private, and kept: Python has no public way to run its exit-time thread join or its
    # atexit handlers before an os._exit (sys.exit would run the teardown this function skips).
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed stream: nothing left in it to lose
            pass
    os._exit(code)

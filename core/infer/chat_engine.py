"""A chat engine: one checkpoint loaded in a process of its own, answering sample requests.

The front-ends (the cockpit's chat pane on a past run, `lmcockpit chat`) talk to it with the
training engine's protocol: `Sample` commands in, streamed `SampleText` events out, `Abort` to end
it. The process loads torch; this module imports none, so the front-end stays torch-free. Like the
training engine, it sends its stdout and stderr to the front-end as log lines (never to the
terminal), ignores SIGINT and stops on SIGTERM, SIGHUP or a vanished front-end.

Events, in order: `StateChanged(PREPARING)`; then either `RunStarted` (`run_dir` is the checkpoint
folder, `start_step` its step, `config` its run's) and `StateChanged(RUNNING)` when ready, or a
`Failure` (`user_error` for a missing or damaged checkpoint) and `StateChanged(FAILED)`. An `Abort`
ends it with `StateChanged(FINISHED)` and exit code 0.

Requests are answered one at a time, and commands are still heard while one is being generated:
a `Cancel` of it stops it after the current token (its `done` marker follows at once, after the
text so far), and an `Abort` stops it and then the engine. A `Cancel` of a request still waiting
drops it (its `done` marker is sent too); one of a request already answered is ignored.
"""

from __future__ import annotations

import os
import threading
import traceback
from collections import deque
from pathlib import Path

from .. import protocol as P
from ..config import ConfigError
from ..process.runner import ProcessHandle


class ChatEngine(ProcessHandle):
    """The front-end's handle on a chat engine process."""

    process_name = "lmcockpit-chat"
    preload = ("lmcockpit.core.infer.chat_engine", "lmcockpit.core.infer.load", "lmcockpit.core.model.gpt",
               "lmcockpit.core.model.sampling")

    def __init__(self, checkpoint: str | Path, device: str = "auto"):
        super().__init__(main, (str(checkpoint), device))
        self.loaded: P.RunStarted | None = None

    def observe(self, event: object) -> None:
        if isinstance(event, P.RunStarted):
            self.loaded = event

    def cancel(self, request_id: str) -> None:
        """Stop that request's generation: its `done` marker comes after the current token."""
        self.send(P.Cancel(request_id))


class _Stopped(Exception):
    """Raised out of a generation by a command heard while it ran."""

    def __init__(self, command: object):
        super().__init__()
        self.command = command


def answer_heeding(loaded, request: P.Sample, cmds, pending: deque, events) -> P.Abort | None:
    """Answer `request`, listening for commands between its pieces of text: a Cancel of it or an
    Abort ends it early (the Abort is returned); a Cancel of a request waiting in `pending` drops
    that one; other commands wait in `pending` for after it."""

    def emit(event: object) -> None:
        events.put(event)
        if isinstance(event, P.SampleText) and event.done:
            return
        while (cmd := cmds.next(False)) is not None:
            if isinstance(cmd, P.Abort) or isinstance(cmd, P.Cancel) and cmd.request_id == request.request_id:
                raise _Stopped(cmd)
            if isinstance(cmd, P.Cancel):
                drop_waiting(cmd.request_id, pending, loaded.step, events)
            else:
                pending.append(cmd)

    try:
        loaded.answer(request, emit, print)
    except _Stopped as stop:
        events.put(P.SampleText(request.request_id, loaded.step, request.prompt, "", done=True))
        return stop.command if isinstance(stop.command, P.Abort) else None
    return None


def drop_waiting(request_id: str, pending: deque, step: int, events) -> None:
    for waiting in [c for c in pending if isinstance(c, P.Sample) and c.request_id == request_id]:
        pending.remove(waiting)
        events.put(P.SampleText(waiting.request_id, step, waiting.prompt, "", done=True))


def main(checkpoint: str, device: str, events, commands) -> None:
    """Spawn target. Exit code 0 after an Abort, 1 when the checkpoint could not be loaded."""
    from ..process.child import Commands, LogPump, exit_now, flush_events

    pump = LogPump(Path(os.devnull), events)
    cmds = Commands(commands)
    failure = None
    try:
        events.put(P.StateChanged(P.PREPARING, f"loading {checkpoint}"))
        from ..run.checkpoint_folder import find_checkpoint
        from .load import load

        _test_hold()
        loaded = load(find_checkpoint(checkpoint), device)
        cfg = loaded.cfg
        events.put(P.RunStarted(str(loaded.checkpoint), cfg.to_dict(), loaded.model.num_params(), str(loaded.device),
                                loaded.precision, loaded.step, cfg.training.max_steps, cfg.tokens_per_step))
        events.put(P.StateChanged(P.RUNNING, f"step {loaded.step} loaded"))
        pending: deque = deque()  # commands heard during a generation, for after it
        while not isinstance(cmd := pending.popleft() if pending else cmds.next(True), P.Abort):
            # (a Cancel heard here is of a request already answered: nothing waits when idle)
            if isinstance(cmd, P.Sample) and answer_heeding(loaded, cmd, cmds, pending, events) is not None:
                break
    except ConfigError as e:
        failure = P.Failure(str(e), user_error=True)
    except Exception as e:  # noqa: BLE001 - every failure must reach the front-end
        failure = P.Failure(f"{type(e).__name__}: {e}", traceback.format_exc())
    pump.close()
    if failure is not None:
        events.put(failure)
    events.put(P.StateChanged(P.FAILED if failure else P.FINISHED, failure.message if failure else ""))
    flush_events(events)
    exit_now(1 if failure is not None else 0)


def _test_hold() -> None:
    """Tests only: with LMCOCKPIT_TEST_HOLD_LOAD=1 the checkpoint's load never ends, as a long one
    would hold it (from the forkserver the real load takes a tenth of a second: no window to type in)."""
    if os.environ.get("LMCOCKPIT_TEST_HOLD_LOAD") == "1":
        threading.Event().wait()

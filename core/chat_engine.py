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
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from . import protocol as P
from .config import ConfigError
from .runner import ProcessHandle


class ChatEngine(ProcessHandle):
    """The front-end's handle on a chat engine process."""

    process_name = "lmcockpit-chat"

    def __init__(self, checkpoint: str | Path, device: str = "auto"):
        super().__init__(main, (str(checkpoint), device))
        self.loaded: P.RunStarted | None = None

    def observe(self, event: object) -> None:
        if isinstance(event, P.RunStarted):
            self.loaded = event


def main(checkpoint: str, device: str, events, commands) -> None:
    """Spawn target. Exit code 0 after an Abort, 1 when the checkpoint could not be loaded."""
    from .engine import Commands, LogPump, flush_events

    pump = LogPump(Path(os.devnull), events)
    cmds = Commands(commands)
    failure = None
    try:
        events.put(P.StateChanged(P.PREPARING, f"loading {checkpoint}"))
        from .inference import find_checkpoint, load

        loaded = load(find_checkpoint(checkpoint), device)
        cfg = loaded.cfg
        events.put(P.RunStarted(str(loaded.checkpoint), cfg.to_dict(), loaded.model.num_params(), str(loaded.device),
                                loaded.precision, loaded.step, cfg.training.max_steps, cfg.tokens_per_step))
        events.put(P.StateChanged(P.RUNNING, f"step {loaded.step} loaded"))
        while not isinstance(cmd := cmds.next(True), P.Abort):
            if isinstance(cmd, P.Sample):
                loaded.answer(cmd, events.put, print)
    except ConfigError as e:
        failure = P.Failure(str(e), user_error=True)
    except Exception as e:  # noqa: BLE001 - every failure must reach the front-end
        failure = P.Failure(f"{type(e).__name__}: {e}", traceback.format_exc())
    pump.close()
    if failure is not None:
        events.put(failure)
    events.put(P.StateChanged(P.FAILED if failure else P.FINISHED, failure.message if failure else ""))
    flush_events(events)
    sys.exit(1 if failure is not None else 0)

"""`lmcockpit PRESET --detach`: start a run in the background, and say how its start went.

The run host (core/process/host.py) serves as soon as its engine process exists; the engine then
imports torch, checks the config against the machine and prepares the data, and the mistakes
one types (a data path, a GPU that is not there) end the run in its first seconds. So --detach
waits, through the host's start report (core/process/report.py), for the engine to start
training (RunStarted) or to end, and reports an end as `--run` would: the engine's message, exit 2
for a user error (the folder made for the run removed, so that the corrected command can have the
same --out), 1 for a failure. The wait is bounded by START_WAIT: preparing a large corpus takes
minutes to hours, the mistakes worth waiting for show long before, and past the bound the run is
left to `lmcockpit attach`, still preparing. Ctrl-C while it waits stops the waiting, not the run,
which goes on in the background as asked (its host ignores a reader that is gone).
"""

from __future__ import annotations

import json
import subprocess
import time

from rich.live import Live
from rich.text import Text

from ..core import protocol as P
from ..core.process import host
from ..core.process.detached import Detached
from ..core.process.report import Reports
from .headless import EXIT_CODES, progress_line
from .runplan import RunPlan, discard_unstarted_run
from ..core.run.state import RunState
from .usage import error, new_console

START_WAIT = 30.0  # seconds --detach waits for the engine to start training
QUIET_FOR = 2.0  # seconds before the wait is shown


def start_detached(plan: RunPlan) -> int:
    try:
        proc, reports = host.start_with_reports(plan.run_dir, plan.resume_from, plan.rendezvous, plan.title)
    except host.HostError as e:
        return error(str(e))
    except KeyboardInterrupt:
        return stopped_waiting(plan)
    try:
        # Several machines meet before any starts training, which takes as long as the slowest
        # to come: nothing to wait for here.
        outcome = wait_for_start(reports) if plan.cfg.distributed.nnodes == 1 else {"started": True}
    except KeyboardInterrupt:
        return stopped_waiting(plan)
    finally:
        reports.close()
    attach = f"`lmcockpit attach {plan.run_dir}` shows it, `lmcockpit ps` lists every run"
    if outcome.get("waiting"):
        print(f"run folder: {plan.run_dir}\nstill starting after {START_WAIT:.0f} s ({outcome['waiting']}); it goes "
              f"on in the background: {attach}")
        return 0
    if outcome.get("gone") and not ended(proc, 10):  # the pipe closed, but the host serves: it goes on
        outcome = {"started": True}
    if outcome.get("started"):
        print(f"run folder: {plan.run_dir}\ntraining in the background: {attach}")
        return 0
    if outcome.get("gone"):
        failed(f"its host ended without a word: {host.last_words(plan.run_dir)}")
        print(f"run folder: {plan.run_dir}")
        return 1
    ended(proc, 60)  # its files in the run folder (the socket, live.json) are gone with it
    if outcome.get("user_error"):
        code = error(outcome["message"])
        discard_unstarted_run(plan)
        return code
    state = outcome.get("ended") or P.FAILED
    if outcome.get("message"):
        failed(outcome["message"])
    else:
        print(f"{state} before training started")
    print(f"run folder: {plan.run_dir}")
    return 1 if outcome.get("message") else EXIT_CODES.get(state, 1)


def failed(why: str) -> None:
    new_console(stderr=True).print(Text(f"run failed: {why}"), style="bold red")


def ended(proc: Detached, timeout: float) -> bool:
    """Whether the host has exited, waiting `timeout` seconds at most."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


def wait_for_start(reports: Reports) -> dict:
    """The host's last word on the start: {"started": True}, {"ended": state, "message": ...,
    "user_error": ...}, {"gone": True} (it died without one) or {"waiting": what it is doing} once
    START_WAIT has passed. Shown on stderr after QUIET_FOR: a line redrawn on a terminal, one line
    when piped."""
    console = new_console(stderr=True)
    view = RunState()
    t0 = time.monotonic()

    def doing() -> str:
        return progress_line(view, None, None) if view.progress else "starting the engine"

    def shown() -> str:
        return f"{doing()} · {time.monotonic() - t0:.0f} s (Ctrl-C stops waiting; the run goes on)"

    live = None
    try:
        while (left := START_WAIT - (time.monotonic() - t0)) > 0:
            try:
                line = reports.next(min(left, 0.25))
            except EOFError:
                return {"gone": True}
            said = json.loads(line) if line else {}
            if "progress" in said:
                view.apply(P.Progress(*said["progress"]))
            elif said:
                return said
            if live is None and time.monotonic() - t0 >= QUIET_FOR:
                if console.is_terminal:
                    live = Live(Text(shown()), console=console, refresh_per_second=4, transient=True)
                    live.start()
                else:
                    console.print(Text(f"waiting for the run to start training, {START_WAIT:.0f} s at most…"))
                    live = False
            if live:
                live.update(Text(shown()))
    finally:
        if live:
            live.stop()
    return {"waiting": doing()}


def stopped_waiting(plan: RunPlan) -> int:
    print(f"\nrun folder: {plan.run_dir}\nstopped waiting; the run goes on in the background: "
          f"`lmcockpit attach {plan.run_dir}` shows it, `lmcockpit ps` lists every run")
    return 130

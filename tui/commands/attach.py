"""`lmcockpit attach [RUN]`: the cockpit's dashboard on a run that trains in the background.

A run started from the cockpit, or with `lmcockpit PRESET --detach`, is served by its run host
(core/process/host.py) until it ends, whatever happens to front-ends. Attaching shows its whole
history (from the run folder) and then live events, with every control: pause, checkpoint, abort,
chat on the live weights. `d` (or the quit dialog's "leave it training") detaches again. Any
number of cockpits may attach to one run at once.
"""

from __future__ import annotations

from pathlib import Path

from ...core.process import live
from ...core.process.viewer import NotLive, RunViewer
from .. import completers
from . import command_parser
from ..usage import Parser, UsageError, error


def build_parser() -> Parser:
    parser = command_parser(__name__, description=__doc__.split("\n\n")[0])
    parser.add_argument("run", metavar="RUN", nargs="?",
                        help="the run folder (default: the only live run; `lmcockpit ps` lists them)"
                        ).completer = completers.run_folders
    return parser


def choose_run(arg: str | None) -> Path:
    """The run folder to attach to: RUN, or the only live run; a UsageError naming the choices
    otherwise."""
    if arg:
        path = Path(arg).expanduser()
        if not path.is_dir() and (Path("runs") / arg).is_dir():
            path = Path("runs") / arg
        if not path.is_dir():
            raise UsageError(f"{arg}: no such run folder (`lmcockpit ps` lists the runs training in the background)")
        return path
    running = [r for r in live.live_runs() if r.live]
    if len(running) == 1:
        return running[0].run_dir
    if not running:
        raise UsageError("no run is training in the background; start one with `lmcockpit PRESET --detach`, "
                         "or from the cockpit")
    listed = "; ".join(str(r.run_dir) for r in running)
    raise UsageError(f"{len(running)} runs are training: give one, as in `lmcockpit attach RUN` ({listed})")


def main(argv: list[str]) -> int:
    run_dir = choose_run(build_parser().parse_args(argv).run)
    try:
        RunViewer(run_dir).close()  # here, before the cockpit takes the terminal: a dead run says so plainly
    except NotLive as e:
        return error(str(e))
    from ..app import CockpitApp

    app = CockpitApp(attach=run_dir)
    app.run()
    return app.exit_code

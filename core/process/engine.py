"""The engine process: owns torch, the model and the GPU; speaks only the protocol.

`main` is the target of a process forked from the forkserver (warm_start.py). It points its own
stdout and stderr, at the file descriptor level (so compiler and C++ warnings too), into a pipe
that a thread copies to `train.log` and forwards as log events. It ignores SIGINT (Ctrl-C
reaches the whole foreground process group: the front-end turns it into a command), turns SIGTERM
and SIGHUP into "checkpoint and stop", and does the same when its parent vanishes. With a
rendezvous (several processes) it trains nothing itself: it becomes torchrun's launcher
(launcher.py) and reports how the ranks ended. Importing this module imports no torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .. import protocol as P
from ..config import ConfigError
from ..hardware import gpu_env
from ..run.folder import TRAIN_LOG, hold_run_dir
from ..run.safe_files import NotOwnFile
from .child import Commands, LogPump, exit_now, flush_events, hold_signals, run_header, train


def main(run_dir: str, config: dict, resume_from: str | None, rendezvous, events, commands) -> None:
    """Spawn target. Exit code 0 for any orderly end (finished, aborted, interrupted), 1 on failure.
    `rendezvous` (a rendezvous.Rendezvous) means several processes, started through torchrun."""
    hold_signals()
    # While torch is not even imported: the CUDA allocator reads its settings once, when CUDA
    # initialises. expandable_segments goes in PYTORCH_ALLOC_CONF for torch 2.11 and later and in
    # PYTORCH_CUDA_ALLOC_CONF before (the version comes from package metadata, not an import;
    # gpu_env says why 2.11), and a variable the user set is left exactly as it is.
    allocator = gpu_env.configure_allocator()
    try:
        # Held until this process exits. Several machines share one run folder, each with an
        # engine of its own: no claim there.
        _claim = hold_run_dir(Path(run_dir)) if config["distributed"]["nnodes"] == 1 else None
        pump = LogPump(Path(run_dir) / TRAIN_LOG, events)
    except ConfigError as e:
        return finish(events, P.FAILED, P.Failure(str(e), user_error=True))
    except NotOwnFile as e:  # train.log a link or someone else's: hold_run_dir says so where it runs
        return finish(events, P.FAILED, P.Failure(f"{e} (remove it if you did not put it there)", user_error=True))
    print(run_header(run_dir))
    print(f"allocator: {allocator.describe()}")
    if rendezvous is not None:
        from .launcher import train_on_ranks

        final, failure = train_on_ranks(run_dir, config, resume_from, rendezvous, events, commands)
    else:
        final, failure = train(run_dir, config, resume_from, events, Commands(commands))
    if failure is not None:
        print(f"{P.FAILED_LINE}{failure.message}")
    print(f"engine: {final}")
    pump.close()
    finish(events, final, failure)


def finish(events, final: str, failure: P.Failure | None) -> None:
    if failure is not None:
        events.put(failure)
    events.put(P.StateChanged(final, failure.message if failure else ""))
    flush_events(events)
    exit_now(1 if failure is not None else 0)


if __name__ == "__main__":  # pragma: no cover - only ever started through runner.EngineProcess
    sys.exit("the engine is started by the lmcockpit front-end")


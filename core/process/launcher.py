"""Several training processes: torchrun's launcher inside the engine process, and each rank's entry.

The engine process (started by the front-end, holding its two queues) calls torch's elastic
launcher, the code `torchrun` runs, with the run's rendezvous: it starts distributed.nproc ranks on
this machine, each running `worker`, and meets the other machines' launchers for a multi-node run.
The ranks are forks of one forkserver the engine starts first (warm_start: torch imported once, not
in each rank; a fresh interpreter, no CUDA context), born as `spawn` made them: the engine's
environment and signal dispositions of the moment, SIGHUP and SIGTERM unblocked first thing. The
queues travel into the ranks: rank 0 reads the front-end's commands and emits the run's events;
every rank's stdout and stderr lines reach train.log and the log pane tagged `rankN: `.

Ending. Ranks return their final state; rank 0's is the run's. SIGTERM or SIGHUP to the engine,
or a front-end that vanished, become "checkpoint and stop" for rank 0, which the ranks agree on
between steps. When a rank fails, torchrun stops the others (SIGTERM, then SIGKILL after
SHUTDOWN_GRACE) and every failing rank leaves a record of what went wrong and when, so the run's
message names the rank that failed first, not the ones that merely lost contact with it.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing import forkserver
from pathlib import Path

from .. import protocol as P
from ..config import config_from_dict
from ..run.folder import METRICS, MetricsLog, TRAIN_LOG, tail_rows
from .child import Commands, LogPump, early_signal, flush_events, run_header, stop_signals, train
from . import warm_start
from .rendezvous import Rendezvous

SHUTDOWN_GRACE = 15  # s from torchrun's SIGTERM to its SIGKILL, when one rank failed
STOP_GRACE = 20  # s a rank told to stop (SIGTERM) may take before it exits regardless
# Errors a rank meets because another rank died: not the cause, whatever their timestamps say.
LOST_PEER = re.compile(r"Connection (reset|closed) by peer|Broken pipe|\bgloo\b|\bNCCL\b|DistNetworkError|"
                       r"DistBackendError|DistStoreError")


def train_on_ranks(run_dir: str, config: dict, resume_from: str | None, rendezvous: Rendezvous, events,
                   commands) -> tuple[str, P.Failure | None]:
    """The run, on distributed.nproc ranks here started by torch's elastic launcher (torchrun's
    code) and met by the other machines' launchers: the run's final state, and its first failure."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    cfg = config_from_dict(config, source=str(Path(run_dir) / "config.toml"))
    d = cfg.distributed
    _quiet_torch_launcher()
    _forward_stops(commands)
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun's rule, but sharing the cores rather than 1 each
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // d.nproc))
    # Started now, with the environment the ranks are to have (the forkserver keeps the one it starts
    # with) and deaf: a hang-up to the process group must reach the ranks, not the process that
    # tells torchrun how they ended.
    warm_start.context(warm_start.ENGINE)
    with warm_start.deaf_helpers():
        forkserver.ensure_running()
    endpoint = rendezvous.endpoint_or_local
    launch_cfg = LaunchConfig(
        min_nodes=d.nnodes, max_nodes=d.nnodes, nproc_per_node=d.nproc, run_id=rendezvous.run_id,
        rdzv_backend=rendezvous.backend, rdzv_endpoint=endpoint,
        rdzv_configs={"rank": rendezvous.node_rank} if rendezvous.backend == "static" else {},
        max_restarts=0, monitor_interval=0.1, start_method="forkserver",
        # The agent's own handlers would SIGTERM the ranks at once; SIGTERM and SIGHUP go through
        # _forward_stops instead (an agreed stop with a checkpoint). SIGQUIT stays "stop now".
        signals_to_handle="SIGQUIT", shutdown_timeout=SHUTDOWN_GRACE)
    print(f"launcher: torchrun with {d.nproc} process(es) on this machine, {d.nnodes} machine(s), "
          f"{d.strategy.upper()}; rendezvous {rendezvous.backend} at {endpoint}")
    records = Path(tempfile.mkdtemp(prefix="lmcockpit-ranks-"))
    try:
        results = elastic_launch(launch_cfg, worker)(run_dir, config, resume_from, events, commands, str(records))
        return results[min(results)] if results else P.FINISHED, None
    except ChildFailedError as e:
        failure = first_failure(e.failures, records)
        _record_verdict(Path(run_dir), failure)
        return P.FAILED, failure
    except Exception as e:  # noqa: BLE001 - rendezvous and start-up errors, reported as the run's failure
        print(traceback.format_exc(), end="")
        return P.FAILED, P.Failure(f"torchrun could not start the ranks: {type(e).__name__}: {e}")
    finally:
        shutil.rmtree(records, ignore_errors=True)


def _record_verdict(run_dir: Path, failure: P.Failure) -> None:
    steps = [row["step"] for row in tail_rows(run_dir / METRICS) if row.get("kind") == "step"]
    try:
        metrics = MetricsLog(run_dir / METRICS)
    except OSError as e:  # a link or someone else's file at metrics.jsonl: the failure is still reported
        print(f"launcher: the failure is not in {METRICS}: {e}")
        return
    metrics.write(P.Failed(steps[-1] if steps else 0, failure.message))
    metrics.close()


def _quiet_torch_launcher() -> None:
    """The agent logs each rank's failure with a traceback of its own machinery, and that it
    terminates the others: the run's failure message says it better, in one line."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _forward_stops(commands) -> None:
    """SIGTERM and SIGHUP to the engine, and a front-end that is gone, reach rank 0 as a command."""
    def stop(why: str) -> None:
        print(f"launcher: {why}; the ranks write a checkpoint and stop")
        commands.put(P.Abort(save=True, interrupted=True))

    for sig in stop_signals():
        signal.signal(sig, lambda signum, frame: stop(f"{signal.Signals(signum).name} received"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front-end's to turn into a command
    if (early := early_signal()) is not None:
        stop(f"{early} received")
    parent = mp.parent_process()
    if parent is not None:
        def watch() -> None:
            multiprocessing.connection.wait([parent.sentinel])
            stop("the front-end is gone")

        threading.Thread(target=watch, name="front-end-watch", daemon=True).start()


# ----------------------------------------------------------------------------------- a rank
def worker(run_dir: str, config: dict, resume_from: str | None, events, commands, records: str) -> str:
    """One rank (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK). Returns its final state; a failure
    is recorded for the launcher and ends the process with exit code 1."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, warm_start.DEAF)  # the forkserver's, not spawn's
    rank = int(os.environ["RANK"])
    pump = LogPump(Path(run_dir) / TRAIN_LOG, events, prefix=f"rank{rank}: ")
    cmds = Commands(commands if rank == 0 else None)
    _exit_if_stuck_after_sigterm(rank, Path(records))
    print(run_header(run_dir))
    from ..train.group import ProcessGroup

    group = ProcessGroup(config["distributed"]["strategy"])
    final, failure = train(run_dir, config, resume_from, events, cmds, group,
                           emit=events.put if rank == 0 else _ignore)
    if failure is not None:
        secondary = cmds.stop_signal is not None or bool(LOST_PEER.search(failure.message))
        write_record(Path(records), rank, failure.message, failure.traceback, failure.user_error, secondary)
    pump.close()
    flush_events(events)
    if failure is not None:
        sys.exit(1)
    return final


def _ignore(event: object) -> None:
    pass


def write_record(records: Path, rank: int, message: str, tb: str = "", user_error: bool = False,
                 secondary: bool = False) -> None:
    tmp = records / f".rank{rank}.json"
    tmp.write_text(json.dumps({"rank": rank, "time": time.time(), "message": message, "traceback": tb,
                               "user_error": user_error, "secondary": secondary}))
    os.replace(tmp, records / f"rank{rank}.json")


def _exit_if_stuck_after_sigterm(rank: int, records: Path) -> None:
    """A rank told to stop while blocked in a collective on a dead peer (NCCL waits in C, where no
    Python signal handler runs) would sit until SIGKILL. Python's wakeup fd is written by the
    C-level handler at once, so a thread sees the SIGTERM and ends the rank STOP_GRACE later if it
    is still here: an orderly stop (agree, checkpoint, exit) has that long."""
    r, w = socket.socketpair()
    w.setblocking(False)
    signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)

    def watch() -> None:
        _ = w  # the write end must live as long as the process: Python only holds its number
        while signal.SIGTERM not in r.recv(64):
            pass
        threading.Event().wait(STOP_GRACE)
        write_record(records, rank, f"did not stop within {STOP_GRACE} s of SIGTERM", secondary=True)
        os.write(2, f"rank {rank}: did not stop within {STOP_GRACE} s of SIGTERM; exiting\n".encode())
        os._exit(1)

    threading.Thread(target=watch, name="sigterm-watch", daemon=True).start()


# ------------------------------------------------------------------------------ the verdict
def _short(message: str, limit: int = 100) -> str:
    line = re.sub(r"\[/\S+:\d+\] ", "", message.splitlines()[0] if message else "")  # gloo's source paths
    return line if len(line) <= limit else line[:limit - 1] + "…"



def first_failure(failures: dict, records: Path) -> P.Failure:
    """One failure for the run: the rank that failed first, then the others. `failures` is
    torchrun's (global rank → ProcessFailure, for the ranks it saw end badly); the records are
    the ranks' own, with their error and whether it came after a stop or a lost peer."""
    found = {}
    for f in records.glob("rank*.json"):
        row = json.loads(f.read_text())
        found[row["rank"]] = row
    for rank, f in failures.items():
        if rank not in found:  # died without a word: killed, segfault, the OOM killer
            how = (f"was killed by {f.signal_name()}" if f.exitcode is not None and f.exitcode < 0
                   else f"exited with code {f.exitcode} without saying why")
            found[rank] = {"rank": rank, "time": f.timestamp, "message": f"the process (pid {f.pid}) {how}",
                           "traceback": "", "user_error": False, "secondary": False}
    if not found:
        return P.Failure("a rank failed without a record (see train.log)")
    order = sorted(found.values(), key=lambda row: (row["secondary"], row["time"], row["rank"]))
    first = order[0]
    if first["user_error"]:
        return P.Failure(first["message"], user_error=True)
    message = f"rank {first['rank']} failed first: {first['message']}"
    if len(order) > 1:
        message += " (then " + "; ".join(f"rank {row['rank']}: {_short(row['message'])}" for row in order[1:]) + ")"
    return P.Failure(message, first["traceback"])

"""What starting a run needs, however it was asked for (command line, launch screen, resume)."""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..core.config import Config
from ..core.process.rendezvous import Rendezvous
from ..core.run.folder import CONFIG, LOCK, METRICS, TOKENIZER, TRAIN_LOG


@dataclass(frozen=True)
class RunPlan:
    cfg: Config
    run_dir: Path
    resume_from: Path | None
    title: str
    rendezvous: Rendezvous | None = None  # torchrun's settings; None: decided by the config
    in_place: bool = False  # an existing run folder resumed in place; else a folder made for this run


def check_before_start(cfg: Config) -> None:
    """What a run's config names that only a look outside the config can refuse (task files and Hub
    tasks, notification targets and their env:NAME), refused before any run folder is made."""
    from ..core.process import notify
    from ..core.tasks import catalog

    catalog.check(cfg)
    notify.check(cfg)


def discard_unstarted_run(plan: RunPlan) -> None:
    """A run folder made for a run that the engine refused (a GPU that is not there, data it cannot
    read, a checkpoint that does not fit), a new run's or a checkpoint's continuation's, holds only
    the attempt's own files: left behind, they would block the same --out next time and list a
    failed run among the recent ones. A run folder resumed in place was there before, and one
    that several machines share is not this machine's to remove; a folder with anything more
    than the attempt's files is left as it is."""
    run_dir = plan.run_dir
    if plan.in_place or plan.cfg.distributed.nnodes > 1:
        return
    from ..core.process.host import HOST_LOG  # here: a command that starts no run needs none of its imports

    # the tokenizer is a copy of the token cache's, made before the checkpoint is loaded
    ours = {CONFIG, METRICS, TRAIN_LOG, LOCK, HOST_LOG, TOKENIZER}
    if not run_dir.is_dir() or any(p.name not in ours for p in run_dir.iterdir()):
        return
    shutil.rmtree(run_dir / TOKENIZER, ignore_errors=True)
    for name in ours - {TOKENIZER}:
        (run_dir / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        run_dir.rmdir()

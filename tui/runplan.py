"""What starting a run needs, however it was asked for (command line, launch screen, resume)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lmcockpit.core.config import Config
from lmcockpit.core.process.rendezvous import Rendezvous


@dataclass(frozen=True)
class RunPlan:
    cfg: Config
    run_dir: Path
    resume_from: Path | None
    title: str
    rendezvous: Rendezvous | None = None  # torchrun's settings; None: decided by the config
    in_place: bool = False  # an existing run folder resumed in place; else a folder made for this run

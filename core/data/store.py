"""Where token caches live on disk: `$XDG_CACHE_HOME/lmcockpit` (or `data.cache_dir`). No numpy,
no tokenizers: the front-end reads it (the doctor's free-disk line) without the engine's imports."""

from __future__ import annotations

import os
from pathlib import Path

from ..config import Config


def cache_root(cfg: Config) -> Path:
    if cfg.data.cache_dir:
        return Path(cfg.data.cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lmcockpit"

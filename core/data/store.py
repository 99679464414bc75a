"""Token caches on disk, without numpy or tokenizers: where they live (`$XDG_CACHE_HOME/lmcockpit`
or `data.cache_dir`), which there are (complete, or a build a kill left to resume), and removing
one. The front-end reads it (`lmcockpit data info/rm`, the doctor's free-disk line)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import Config, ConfigError

BUILD_PREFIX = ".build-"  # a build under way, or one a kill left behind: the next prepare resumes it


def cache_root(cfg: Config) -> Path:
    if cfg.data.cache_dir:
        return Path(cfg.data.cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lmcockpit"


def lock_path(root: Path, key: str) -> Path:
    return root / f"{BUILD_PREFIX}{key}.lock"


@dataclass(frozen=True)
class CacheInfo:
    key: str
    folder: Path
    complete: bool
    source: str
    vocab_size: int | None
    train_tokens: int | None
    val_tokens: int | None
    size: int  # bytes on disk
    modified: float  # seconds since the epoch
    pieces_done: int = 0
    pieces: int = 0

    @property
    def state(self) -> str:
        return "complete" if self.complete else f"partial ({self.pieces_done}/{self.pieces} pieces)"


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def list_caches(root: Path) -> list[CacheInfo]:
    """Every cache under `root`, newest first."""
    out = []
    for folder in root.iterdir() if root.is_dir() else ():
        if not folder.is_dir():
            continue
        if folder.name.startswith(BUILD_PREFIX):
            plan = _json(folder / "plan.json")
            out.append(CacheInfo(folder.name[len(BUILD_PREFIX):], folder, False, plan.get("source", "?"),
                                 plan.get("vocab_size"), None, None, _size(folder), folder.stat().st_mtime,
                                 len(list((folder / "pieces").glob("*.json"))), plan.get("pieces", 0)))
        elif (meta := _json(folder / "meta.json")):
            out.append(CacheInfo(folder.name, folder, True, str(meta.get("source", "?")), meta.get("vocab_size"),
                                 meta.get("train_tokens"), meta.get("val_tokens"), _size(folder),
                                 (folder / "meta.json").stat().st_mtime))
    return sorted(out, key=lambda c: -c.modified)


def remove(root: Path, key: str) -> CacheInfo:
    """Remove the cache `key` (a unique prefix will do); a ConfigError if there is none, or if a
    process is building it right now."""
    found = [c for c in list_caches(root) if c.key.startswith(key)] if key else []
    if len(found) != 1:
        known = ", ".join(c.key for c in list_caches(root)) or "none"
        what = "no token cache" if not found else f"{len(found)} token caches"
        raise ConfigError(f"{key!r}: {what} under {root} has that key (there: {known})")
    cache = found[0]
    lock = lock_path(root, cache.key)
    with open(lock, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"{cache.key}: a process is preparing this token cache right now; stop it first") from None
        shutil.rmtree(cache.folder)
        lock.unlink(missing_ok=True)
    return cache


def age(seconds_since: float) -> str:
    s = max(0, time.time() - seconds_since)
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.0f} {unit}"
    return f"{s:.0f} s"

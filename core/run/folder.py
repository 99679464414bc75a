"""The run folder: where a run's config, metrics, log, tokenizer and checkpoints live.

Created by the front-end before the engine starts (so a bad `--out` is a usage error, and the
folder is known even if the engine dies at once); filled by the engine. No torch here.

A run folder may be writable by another account: its logs and lock are opened never through a
link and only as the user's own files (safe_files), and its metrics rows are read for what they
are, never taken on trust (`well_formed`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import protocol as P
from ..config import Config, ConfigError, config_from_dict, read_toml
from .extras import require_logger_packages
from .rows import is_count, line_of, loads, well_formed
from .safe_files import NotOwnFile, open_append, open_own, own_or_absent, pinned_dir, write_whole

CONFIG = "config.toml"
METRICS = "metrics.jsonl"
TRAIN_LOG = "train.log"
TOKENIZER = "tokenizer"
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tensorboard"  # TensorBoard's event files
NAN_DEBUG = "nan_debug"  # the report of a step whose loss or gradients were not finite
WANDB = "wandb"  # W&B's own files (wandb.init's dir is the run folder)
PROFILES = "profiles"  # torch.profiler's traces, a folder per profile (core/train/profiling.py)
# The folders a run writes into: a link or someone else's folder at any of these names (planted
# in a run folder other accounts can write) would have checkpoints written, and old ones pruned,
# in whatever folder it names.
RUN_FOLDERS = (CHECKPOINTS, TOKENIZER, TENSORBOARD, NAN_DEBUG, WANDB, PROFILES)
STEP_DIR = re.compile(r"step_(\d+)")
PRUNED = ".pruned-"  # a checkpoint being deleted (list_checkpoints sees only step_N folders)
LOCK = ".training"  # flock'ed by the engine while it trains here; holds its pid
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk, a full quota
HELD_ROWS = 100_000  # metrics rows kept in memory while the disk is full (about 20 MB)


def write_config(cfg: Config, path: Path) -> None:
    """Atomically (a fresh temporary file, then rename): another machine of the run may be reading
    it, and another account may have planted a link at any name we could guess (run.safe_files)."""
    write_whole(path, f"# resolved lmcockpit config: `lmcockpit --run {path}` repeats this run\n" + cfg.to_toml(),
                mode=cfg.file_mode())


def default_run_dir(name: str, runs_root: Path = Path("runs")) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = runs_root / f"{name}-{stamp}"
    n = 1
    while path.exists():  # two runs started within the same second
        n += 1
        path = runs_root / f"{name}-{stamp}-{n}"
    return path


def create_run_dir(cfg: Config, name: str, out: str | None, check: Callable[[Config], None] | None = None) -> Path:
    """A new run's folder, made once `cfg` has passed the checks that need more than the config:
    its optional packages, and `check`, the front-end's (the task files the run will score)."""
    require_logger_packages(cfg)  # every front-end starts a new run through here
    if check is not None:
        check(cfg)
    path = Path(out).expanduser() if out else default_run_dir(name)
    if cfg.distributed.nnodes > 1:
        return join_run_dir(cfg, path, out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {path}: is a file; give a folder for the run (a new or an empty one)")
    if path.exists() and any(path.iterdir()):
        raise ConfigError(f"--out {path}: already exists and is not an empty folder; "
                          "choose a new folder (or --resume to continue a run)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        write_config(cfg, path / CONFIG)
    except OSError as e:
        raise ConfigError(f"--out {path}: cannot create the run folder ({e.strerror})") from None
    return path


def join_run_dir(cfg: Config, path: Path, out: str | None) -> Path:
    """Several machines write one run folder (each rank its checkpoint shards beside the others'):
    it must be named, the same path on a filesystem they share. The first machine creates it; the
    others join it if it holds the same run's config."""
    if not out:
        raise ConfigError(f"distributed.nnodes = {cfg.distributed.nnodes}: name the run folder with --out, the same "
                          "path on every machine, on a filesystem they all share")
    existing = path / CONFIG
    if existing.is_file():
        theirs = config_from_dict(read_toml(existing), source=str(existing))
        if theirs.hash() != cfg.hash():
            raise ConfigError(f"--out {path}: holds another run's config.toml (this machine's config differs); "
                              "give every machine the same preset and --set values")
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
        write_config(cfg, existing)
    except OSError as e:
        raise ConfigError(f"--out {path}: cannot create the run folder ({e.strerror})") from None
    return path


def hold_run_dir(run_dir: Path):
    """Claim the run folder for this process's training, until the returned file is closed or the
    process ends (a killed one too: the kernel drops an flock with its owner). A second training,
    or a resume planned while this one runs, would rewrite config.toml and metrics.jsonl under it
    and delete its half-written checkpoints: refused instead, naming who holds it. So is a folder
    where a link (or someone else's file) waits at the lock's or a log's name: the training's
    writes would land in whatever it points to."""
    try:
        for log in (TRAIN_LOG, METRICS):  # their own opens refuse them too, but in a traceback
            own_or_absent(run_dir / log)
        for folder in RUN_FOLDERS:  # checked again where each is written (safe_files.pinned_dir)
            own_or_absent(run_dir / folder, "folder")
        fd = open_own(run_dir / LOCK, os.O_RDWR | os.O_CREAT)
    except NotOwnFile as e:
        raise ConfigError(f"{e} (remove it if you did not put it there)") from None
    except OSError as e:
        raise ConfigError(f"{run_dir}: cannot write in the run folder ({e.strerror})") from None
    fh = os.fdopen(fd, "r+", encoding="utf-8")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "?"
        fh.close()
        raise ConfigError(f"{run_dir}: a training is running in this run folder (pid {holder}); stop it, "
                          "or wait for it to end, before resuming it") from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


def check_not_training(run_dir: Path) -> None:
    hold_run_dir(run_dir).close()


def step_dirs(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Every `step_N` folder, complete or not, by step: by number, since step_1000000 sorts before
    step_999999 as text."""
    found = [(int(m[1]), p) for p in ckpt_root.glob("step_*")
             if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir() and not p.is_symlink()]
    return sorted(found)


def remove_later_checkpoints(ckpt_root: Path, step: int) -> None:
    """Delete the checkpoints past `step` (a resume in place redoes those steps), through a
    descriptor of `ckpt_root` (safe_files.pinned_dir): never in a folder a link there points to."""
    if not os.path.lexists(ckpt_root):
        return
    with pinned_dir(ckpt_root, make=False) as root:
        remove_checkpoints(root, [later for later_step, later in step_dirs(root) if later_step > step])


def remove_checkpoints(ckpt_root: Path, doomed: list[Path], hold=None) -> None:
    """Delete these checkpoint folders of `ckpt_root` (a folder checked as the user's own, as
    safe_files.pinned_dir gives it), each renamed out of sight (`.pruned-*`)
    first: a kill part way never leaves one listed as complete with files lost, nor one whose
    state.json went first (unlisted, so never deleted). What a kill left is deleted first.
    `hold(name)`: a test's pause between a rename and its deletion."""
    for left in ckpt_root.glob(f"{PRUNED}*"):
        shutil.rmtree(left, ignore_errors=True)
    for path in doomed:
        hidden = ckpt_root / f"{PRUNED}{path.name}"
        path = ckpt_root / path.name
        try:
            os.rename(path, hidden)
        except OSError:  # a leftover of that name the loop above could not delete: keep this one whole
            continue
        if hold:
            hold(path.name)
        shutil.rmtree(hidden, ignore_errors=True)


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints (state.json is written before the folder is renamed into place), oldest first."""
    return [p for _, p in step_dirs(ckpt_root) if (p / "state.json").is_file()]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The highest complete checkpoint. Not the `latest` pointer, which is for people: a kill
    between a checkpoint's rename and the pointer's update leaves it one checkpoint behind."""
    found = list_checkpoints(Path(run_dir) / CHECKPOINTS)
    return found[-1] if found else None


def append_whole(fd: int, data: bytes) -> bool:
    """`data` appended to the file open at `fd` in one write, or, on a full disk, not at all (what
    fitted of it taken back): False then. A row cut short would join the next one into a line
    that is neither."""
    try:
        written = os.write(fd, data)
    except OSError as e:
        if e.errno not in DISK_FULL:
            raise
        return False
    if written < len(data):
        os.ftruncate(fd, os.fstat(fd).st_size - written)
        return False
    return True


class MetricsLog:
    """`metrics.jsonl`: one JSON object per line, each with `kind` and `time`, written as it comes
    so a crash loses nothing that was reported. A full disk stops no run and costs no row: rows
    wait in memory (up to HELD_ROWS, the rest counted in a note) and go out, in order, with the
    first write that fits."""

    def __init__(self, path: Path, on_written: Callable[[bytes], None] | None = None):
        """`on_written`: told each row once it is in the file (the engine's history summary)."""
        self._fd = open_append(path)  # NotOwnFile where a link or someone else's file waits
        self._held: deque[bytes] = deque()
        self._dropped = 0
        self._on_written = on_written or (lambda row: None)

    def write(self, event: Any) -> None:
        """`event`'s row (rows.py): one of protocol's events with a `kind`."""
        if len(self._held) < HELD_ROWS:
            self._held.append(line_of(event))
        else:
            self._dropped += 1
        self._write_held()

    def _write_held(self) -> None:
        while self._held and append_whole(self._fd, self._held[0]):
            self._on_written(self._held.popleft())
        if self._dropped and not self._held:
            note = line_of(P.Note(f"{self._dropped} rows not written: the disk was full"))
            if append_whole(self._fd, note):
                self._dropped = 0
                self._on_written(note)

    def close(self) -> None:
        self._write_held()
        os.close(self._fd)


def read_metrics(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The well-formed rows of metrics.jsonl (`well_formed`), of `kind` if given."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    # Every row ends with a newline: what follows the last one is a row the engine is writing now
    # (a viewer attaching, a comparison of a live run), not yet a row.
    whole = path.read_text(encoding="utf-8", errors="replace").rpartition("\n")[0]
    return [r for r in _rows(whole.splitlines()) if well_formed(r) and (kind is None or r.get("kind") == kind)]


def _rows(lines: list[str]) -> list[dict[str, Any]]:
    """The rows of these lines, past those that are not one: an engine killed mid-row leaves half
    a line, and whoever writes next (the front-end's failure row, a resumed run) goes on from it."""
    return [row for row in map(loads, lines) if isinstance(row, dict)]


def tail_lines(path: Path, max_bytes: int = 65536) -> list[str]:
    """The whole lines in the last `max_bytes` of a file (train.log, metrics.jsonl), reading only
    its end: run folders can hold millions of lines."""
    if not path.is_file():
        return []
    with open(path, "rb") as fh:
        fh.seek(0, 2)
        size = fh.tell()
        fh.seek(max(0, size - max_bytes))
        return fh.read().decode("utf-8", errors="replace").splitlines()[1 if size > max_bytes else 0:]


def tail_rows(path: Path, max_bytes: int = 65536) -> list[dict[str, Any]]:
    """The last well-formed metrics rows."""
    return [r for r in _rows(tail_lines(path, max_bytes)) if well_formed(r)]


UNREADABLE = "unreadable"  # run_summary's status for a run whose metrics.jsonl holds rows lmcockpit never writes
# ...and for one with steps whose training has not said how it ended: training headless now,
# killed outright (SIGKILL, a power cut), or written before `end` rows were.
STOPPED = "stopped"


def run_summary(run_dir: Path) -> dict[str, Any]:
    """{name, status, step, loss, max_steps, checkpoint} of a run folder, for the launch screen,
    compare and the baseline list. The status is the engine's final state where it wrote one
    (finished, aborted, interrupted, failed), else STOPPED, or "empty" with no step.
    A metrics.jsonl whose last rows are not all well-formed is UNREADABLE, with no step or loss:
    figures read past the rows that are not would be wrong without a word (a run at step 0, at
    an older step), and such rows mean a damaged file, or one someone else wrote into."""
    run_dir = Path(run_dir)
    try:
        max_steps = read_toml(run_dir / CONFIG)["training"]["max_steps"]
    except (ConfigError, KeyError, TypeError):  # ConfigError: unreadable, not TOML, nested past reading
        max_steps = None
    if not is_count(max_steps):
        max_steps = None
    rows = _rows(tail_lines(run_dir / METRICS))
    ckpt = latest_checkpoint(run_dir)
    if not all(well_formed(r) for r in rows):
        return {"name": run_dir.name, "status": UNREADABLE, "step": 0, "max_steps": max_steps, "loss": None,
                "checkpoint": ckpt}
    steps = [r for r in rows if r.get("kind") == "step"]
    step = steps[-1]["step"] if steps else 0
    # The last of these says how the run's latest training ended, if it did: a resumed run's new
    # steps come after the end row of the training before (notes and samples may follow any).
    last = next((r for r in reversed(rows) if r.get("kind") in ("step", "end", "failure")), {})
    if last.get("kind") == "failure":
        status = P.FAILED
    elif last.get("kind") == "end":
        status = last["state"]  # the engine's own word: what the dashboard and the exit line said
    elif max_steps and step >= max_steps and ckpt is not None:  # a folder from before end rows
        status = P.FINISHED
    elif step:
        status = STOPPED
    else:
        status = "empty"
    return {"name": run_dir.name, "status": status, "step": step, "max_steps": max_steps,
            "loss": steps[-1]["loss"] if steps else None, "checkpoint": ckpt}


def recent_runs(runs_root: Path, limit: int = 20) -> list[Path]:
    """Run folders under `runs_root`, newest first."""
    if not runs_root.is_dir():
        return []
    runs = [p for p in runs_root.iterdir() if (p / CONFIG).is_file()]
    return sorted(runs, key=lambda p: p.stat().st_mtime, reverse=True)[:limit]

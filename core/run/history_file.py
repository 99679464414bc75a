"""A run folder's history (history.py), kept beside its metrics.jsonl in history.json.

So that no reader folds a million rows again, `history.json` holds a history as it stood after
some line of metrics.jsonl: the byte offset of the line's end and the line itself. A reader takes
it, checks that metrics.jsonl still holds that line there (a resume rewrites the file: rows past
the checkpoint go), and folds only the rows after it, each read and checked by rows.py. The
engine writes it with each checkpoint row (`Summarised`), so a resume from the
latest checkpoint finds it whole; a folder without one (older runs), or whose one no longer fits
its metrics.jsonl, is folded whole once, and the result written for the next reader where the
folder is the user's own.

metrics.jsonl is streamed a line at a time: a long run's file holds hundreds of megabytes. A line
not yet ended by a newline is a row being written: not folded. No torch.
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import IO

from .folder import METRICS
from .history import History
from .resume import KEPT_ROWS  # what happened to a run stays, whatever it redid
from .rows import read
from .safe_files import NotOwnFile, read_own, write_whole

SUMMARY = "history.json"
VERSION = 1
WRITE_AFTER = 10_000  # rows a reader had to fold before it writes the summary it built


class Summarised:
    """The engine's side: each row written to metrics.jsonl folded into a history, which is
    saved with every checkpoint row. Never stops a run: a summary that cannot be written leaves
    readers to fold more of the file."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        # Written at once where a whole older metrics.jsonl had to be folded: a viewer attaching
        # before the first checkpoint reads it instead of folding it all again.
        self.history, self.offset, self.line = load(self.run_dir)
        # Past a row cut short by a kill, the next row is appended to it: where it ends counts.
        self.offset = max(self.offset, _size(self.run_dir / METRICS))

    def written(self, line: bytes) -> None:
        """`line` (with its newline) is now at the end of metrics.jsonl."""
        self.offset += len(line)
        self.line = line
        row = read(line)
        if row is None:
            return
        h = self.history
        if row.get("kind") == "step" and h.count and row["step"] <= h.last_step and not h.cut(row["step"]):
            # A rollback behind the rows the history keeps exact (checkpoints further apart than
            # TAIL_MAX steps): the file, this row included, folded again with every cut known.
            self.history, self.offset, self.line = load(self.run_dir, write=False)
            return
        h.fold(row)
        if row.get("kind") == "checkpoint":
            self.save()

    def save(self) -> None:
        try:
            save(self.run_dir, self.history, self.offset, self.line)
        except OSError:
            pass  # a full disk or a folder gone: readers fold from the last summary that was written


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def save(run_dir: Path, history: History, offset: int, line: bytes) -> None:
    data = {"version": VERSION, "offset": offset, "line": line.decode("utf-8", errors="replace"),
            "history": history.state()}
    write_whole(Path(run_dir) / SUMMARY, json.dumps(data, separators=(",", ":")))


def load(run_dir: Path, write: bool = True) -> tuple[History, int, bytes]:
    """The folder's history through the last whole line of metrics.jsonl, with that line's end
    offset and the line. `write`: save what was built where the summary was missing or stale
    and WRITE_AFTER rows or more had to be folded (never in someone else's folder)."""
    run_dir = Path(run_dir)
    path = run_dir / METRICS
    if not path.is_file():
        return History(), 0, b""
    history, offset, line = _summary(run_dir, path)
    with open(path, "rb") as fh:
        fh.seek(offset)
        folded, offset, line, exact = _fold(fh, history, offset, line)
    if not exact:  # a cut reached rows already in buckets: again from the start, every cut known
        history, offset, line, folded = _fold_whole(path)
    if write and folded >= WRITE_AFTER:
        try:
            save(run_dir, history, offset, line)
        except OSError:
            pass  # not ours to write, or no room: the next reader folds it again
    return history, offset, line


def _summary(run_dir: Path, path: Path) -> tuple[History, int, bytes]:
    """The saved history and where it ends, if it is this user's and still fits metrics.jsonl;
    else an empty history from the start."""
    try:
        data = json.loads(read_own(run_dir / SUMMARY))
        offset, line = int(data["offset"]), str(data["line"]).encode()
        if data["version"] != VERSION or offset < len(line):
            raise ValueError("another version")
        with open(path, "rb") as fh:
            fh.seek(offset - len(line))
            if fh.read(len(line)) != line:
                raise ValueError("metrics.jsonl was rewritten since")
        return History.from_state(data["history"]), offset, line
    except (OSError, NotOwnFile, ValueError, KeyError, TypeError, RecursionError):
        return History(), 0, b""


def _fold(fh: IO[bytes], history: History, offset: int, last: bytes,
          dropped: set[int] | None = None) -> tuple[int, int, bytes, bool]:
    """Fold the whole lines from `fh`'s position on: (rows folded, the end offset, the last
    line, whether every cut was exact). `dropped`: line numbers (from this position) to skip."""
    folded, exact = 0, True
    for number, line in enumerate(fh):
        if not line.endswith(b"\n"):
            break  # being written
        offset += len(line)
        last = line
        if dropped is not None and number in dropped:
            continue
        row = read(line)
        if row is None:
            continue
        if row["kind"] == "step" and history.count and row["step"] <= history.last_step:
            exact = history.cut(row["step"]) and exact
        history.fold(row)
        folded += 1
    return folded, offset, last, exact


def _fold_whole(path: Path) -> tuple[History, int, bytes, int]:
    """metrics.jsonl folded from the start with every row that a later one redoes left out: a
    step row cuts, from the rows before it, the steps, evaluations, checkpoints, targets and
    samples at or past its step (History.cut). Two passes: the first finds the cuts, keeping a
    number a line (its step, or -1 for a row no cut drops)."""
    steps, last_step = array("q"), None
    with open(path, "rb") as fh:
        for line in fh:
            if not line.endswith(b"\n"):
                break
            row = read(line)
            cuttable = row is not None and isinstance(row.get("step"), int) and row["kind"] not in KEPT_ROWS
            steps.append(row["step"] if cuttable else -1)
            if cuttable and row["kind"] == "step":
                # A step row that goes back: marked by its step negated, below -1.
                if last_step is not None and row["step"] <= last_step:
                    steps[-1] = -2 - row["step"]
                last_step = row["step"]
    dropped: set[int] = set()
    lowest_after = float("inf")  # the lowest step cut by a line after this one
    for number in range(len(steps) - 1, -1, -1):
        step = steps[number]
        if step <= -2:  # the cut happens before this row is folded: it is kept
            step = -2 - step
            if step >= lowest_after:
                dropped.add(number)
            lowest_after = min(lowest_after, step)
        elif step >= lowest_after:
            dropped.add(number)
    history = History()
    with open(path, "rb") as fh:
        folded, offset, line, _ = _fold(fh, history, 0, b"", dropped)
    return history, offset, line, folded

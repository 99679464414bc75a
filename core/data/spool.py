"""A large compressed file's pieces, decompressed once, in order, a piece at a time into plain files.

A compressed stream is read from its start: a worker given the 900th piece of a 40 GB `.jsonl.zst`
would decompress the 899 before it to find its own, and the file's pieces together would cost the
square of its size. So the process that hands out the pieces reads such a file once, in order, and
writes each piece's decompressed bytes to a spool file when the piece is handed out, not before;
the worker reads the spool as a plain file's byte range (readers.Spool) and deletes it.

* A spool holds its range [start, end) with the margins the range's cuts look at: CUT_WINDOW bytes
  before `start`; after `end`, the JSON line under way to its end, or LINE_BYTES of text.
  What a piece reads from its spool is what it would read from the decompressed file.
* On disk at once: the spools the workers hold, and the next one being written.
* A resumed build decompresses through the pieces already done without writing them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Sequence, TypeVar

from .readers import CUT_WINDOW, LINE_BYTES, Spool, damaged_as_config_error, is_spooled, open_binary
from .sources import Piece

BLOCK_BYTES = 1 << 20  # decompressed at once, at most
SEARCH_BYTES = 1 << 16  # read at once looking for the end of the JSON line under way at a range's end
Item = TypeVar("Item")


def spooled(items: Sequence[Item], piece_of: Callable[[Item], Piece], folder: Path,
            skipping: Callable[[int, int], None] = lambda done, to: None) -> Iterator[tuple[Item, Spool | None]]:
    """Each item, in order, with its piece's spool (written into `folder`), or None for a piece
    read from its own file. The items of one compressed file must come together and in order, as
    a plan's do (its pieces already done left out); its spools are written only as they are
    asked for. `skipping(done, to)`: decompressing through text not wanted, before a spool."""
    i = 0
    while i < len(items):
        if not is_spooled(piece_of(items[i])):
            yield items[i], None
            i += 1
            continue
        f = piece_of(items[i]).files[0]
        j = i + 1
        while j < len(items) and is_spooled(piece_of(items[j])) and piece_of(items[j]).files[0] == f:
            j += 1
        yield from _spool_file(items[i:j], [piece_of(item) for item in items[i:j]], folder, skipping)
        i = j


def _spool_file(items: Sequence[Item], pieces: list[Piece], folder: Path,
                skipping: Callable[[int, int], None]) -> Iterator[tuple[Item, Spool]]:
    f = pieces[0].files[0]
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{p.index:05d}.spool" for p in pieces]
    lo = [max(0, p.start - CUT_WINDOW) for p in pieces]
    # Where each spool ends, where that is known before reading: text LINE_BYTES past its end; a
    # JSON line's end is found as the stream goes (None); -1: the stream's end.
    hi = [-1 if p.end < 0 else p.end + LINE_BYTES if f.kind == "text" else None for p in pieces]
    writing: dict[int, object] = {}
    pos, opened, given = 0, 0, 0  # pos: the stream's offset read up to

    def open_before(x: int) -> None:
        nonlocal opened
        while opened < len(pieces) and lo[opened] < x:
            writing[opened] = new_file(paths[opened])
            opened += 1

    try:
        with damaged_as_config_error(f), open_binary(f.path, f.compression) as fh:
            while given < len(pieces):
                open_before(pos + 1)
                if given in writing and hi[given] is not None and 0 <= hi[given] <= pos:
                    writing.pop(given).close()
                    yield items[given], Spool(str(paths[given]), lo[given], -1)
                    given += 1
                    continue
                # No further than the next spool needs: later ones are opened only as it ends.
                if given >= opened:
                    want = lo[given] - pos
                elif hi[given] is None:
                    want = pieces[given].end - 1 - pos if pos < pieces[given].end - 1 else SEARCH_BYTES
                else:
                    want = hi[given] - pos if hi[given] >= 0 else BLOCK_BYTES
                block = fh.read(max(1, min(BLOCK_BYTES, want)))
                if not block:  # the stream's end: what is left ends here
                    break
                end = pos + len(block)
                open_before(end)
                if not writing:
                    skipping(end, lo[given])
                for k, out in writing.items():
                    if hi[k] is None and (at := block.find(b"\n", max(0, pieces[k].end - 1 - pos))) >= 0:
                        hi[k] = pos + at + 1
                    stop = end if hi[k] is None or hi[k] < 0 else min(end, hi[k])
                    if stop > max(lo[k], pos):
                        out.write(block[max(lo[k], pos) - pos:stop - pos])
                pos = end
        while given < len(pieces):
            if given in writing:
                writing.pop(given).close()
            else:  # past the stream's end (its size was estimated): an empty piece
                new_file(paths[given]).close()
            yield items[given], Spool(str(paths[given]), min(lo[given], pos), pos)
            given += 1
    finally:
        for k, out in writing.items():  # not given out: this generator's own
            out.close()
            paths[k].unlink(missing_ok=True)


def new_file(path: Path) -> BinaryIO:
    """`path` made afresh and open for writing. What a killed process left at the name is removed
    first (a link itself, not what it points to); O_EXCL and O_NOFOLLOW then make sure the file
    written is the one just made, never a link or a file that appeared there since: the name is
    one anyone can guess, in a cache folder others may be able to write to."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    return os.fdopen(fd, "wb")


def remove(spool: Spool | None) -> None:
    """A spool read: deleted by its reader."""
    if spool is not None:
        try:
            os.unlink(spool.path)
        except FileNotFoundError:
            pass

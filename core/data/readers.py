"""Documents read from a piece, streamed: nothing holds more than one batch of records.

Each document has an id that is stable across machines, worker counts and runs (the split and the
`max_bytes` selection hash it): a whole text file's id is its path in the source; a text cut at
line boundaries (a line longer than LINE_BYTES at whitespace within it) is `path@offset`; a JSON
line is `path@offset` of its first byte (in the decompressed stream for a compressed file); a
Parquet or Arrow row is `path#row`. A record that cannot be read is a ConfigError naming the file,
the line or row group, and what was expected; so is a damaged or truncated file (an interrupted
download), wherever it is first read.

A byte range of a compressed file is read from its spool (spool.py): the range's decompressed
bytes, with the margins its cuts look at, in a plain file that is read at the stream's offsets.
"""

from __future__ import annotations

import bz2
import functools
import gzip
import io
import json
import lzma
import re
import sys
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from ..config import ConfigError
from .sources import Piece, SourceFile, parquet_row_group_bytes

CHUNK_BYTES = 64 * 1024  # a long text is cut into documents of about this size
WHOLE_TEXT_BYTES = 2 * CHUNK_BYTES  # a text file up to this size is one document
LINE_BYTES = CHUNK_BYTES  # a text's line longer than this is cut in segments (a JSON line never is)
CUT_WINDOW = 4096  # where a long line is cut: after its last whitespace among these last bytes
BATCH_ROWS = 4096
BATCH_TEXT_BYTES = 1 << 20  # text a Parquet record batch holds, about
ESTIMATE_OUTPUT = 8 << 20  # decompressed bytes read to estimate a compressed file's text size
ZSTD_FEED = 1 << 17  # a zstd file's bytes decompressed at once: its output, at text's ratios, about a megabyte
# A surrogate in a JSON line, escaped ("\\ud800") or as raw bytes (CESU-8, WTF-8: json.loads reads
# bytes with "surrogatepass"): either decodes to a str that has no UTF-8.
SURROGATE = re.compile(rb"\\u[dD][89abcdefABCDEF]|\xed[\xa0-\xbf]")


@dataclass(frozen=True)
class Spool:
    """A plain file holding a compressed file's decompressed bytes from offset `base` on."""
    path: str
    base: int
    size: int  # the decompressed stream's length, where the spool reaches its end; else -1


@dataclass(frozen=True)
class Document:
    id: str
    text: str


# Whether a document is wanted, from its id alone: a reader skips reading what is not.
Wanted = Callable[[str], bool]


def open_binary(raw: BinaryIO | Path, compression: str) -> BinaryIO:
    if compression == "gzip":
        return gzip.open(raw, "rb")
    if compression == "xz":
        return lzma.open(raw, "rb")
    if compression == "bzip2":
        return bz2.open(raw, "rb")
    if compression == "zstd":
        # Buffered for readline; the reader closes the file it opened.
        fh = open(raw, "rb") if isinstance(raw, Path) else raw
        return io.BufferedReader(_ZstdFrames(fh, closefd=isinstance(raw, Path)), 1 << 16)
    return open(raw, "rb") if isinstance(raw, Path) else raw


class _ZstdFrames(io.RawIOBase):
    """A zstd file's frames, one after another; one that its file ends inside is an error, as a cut
    .gz, .xz or .bz2 is. zstandard's stream_reader says nothing there: it stops at the last whole
    block, and a download cut short was read as a shorter text."""

    def __init__(self, fh: BinaryIO, closefd: bool):
        import zstandard

        self.fh, self.closefd = fh, closefd
        self.dctx, self.frame = zstandard.ZstdDecompressor(), None
        self.out, self.at = b"", 0  # decompressed, and how much of it was read

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self.at == len(self.out):
            if not self._decompress_more():
                return 0
        n = min(len(b), len(self.out) - self.at)
        b[:n] = self.out[self.at:self.at + n]
        self.at += n
        return n

    def _decompress_more(self) -> bool:
        import zstandard

        data = self.fh.read(ZSTD_FEED)
        if not data:
            if self.frame is not None and not self.frame.eof:
                raise zstandard.ZstdError("the file ends inside a frame")
            return False
        out = []
        while data:
            if self.frame is None or self.frame.eof:
                self.frame = self.dctx.decompressobj()
            out.append(self.frame.decompress(data))
            data = self.frame.unused_data if self.frame.eof else b""  # the next frame's start
        self.out, self.at = b"".join(out), 0
        return True

    def close(self) -> None:
        if not self.closed and self.closefd:
            self.fh.close()
        super().close()


@contextmanager
def damaged_as_config_error(f: SourceFile):
    """A decompressor's complaint about `f` as a ConfigError that names it: a traceback of EOFError
    or BadGzipFile says neither which file nor that downloading it again is the cure."""
    import zstandard

    try:
        yield
    except (EOFError, zlib.error, lzma.LZMAError, zstandard.ZstdError, OSError) as e:
        if isinstance(e, OSError) and e.errno is not None:  # the disk's or the system's, not the file's
            raise
        raise ConfigError(f"{f.path}: damaged or truncated {f.compression + ' ' if f.compression else ''}file "
                          f"(an interrupted download? fetch it again): {e}") from None


def sized_by_reading(f: SourceFile) -> bool:
    """Whether `f`'s text is known only by reading some of it (text_bytes): compressed, or Parquet."""
    return bool(f.compression) or f.kind == "parquet"


@functools.lru_cache(maxsize=100_000)
def text_bytes(f: SourceFile, text_field: str) -> int:
    """About how many bytes of text `f` holds: its size; a compressed file's size times the
    ratio of its first ESTIMATE_OUTPUT bytes of text; a Parquet file's text column, uncompressed.
    Kept per file as listed (its path, size and mtime): the launch screen asks again at every
    change of setting, and a mixture's build asks for its BPE's sample and again for its caches."""
    if f.kind == "parquet":
        return sum(parquet_row_group_bytes(f, text_field))
    if not f.compression:
        return f.size
    with open(f.path, "rb") as raw, damaged_as_config_error(f):
        counted = _Counting(raw)
        with open_binary(counted, f.compression) as stream:
            out = len(stream.read(ESTIMATE_OUTPUT)) if f.size else 0
            consumed = counted.consumed
    return f.size if consumed == 0 else int(f.size * out / consumed) if consumed < f.size else out


class _Counting(io.RawIOBase):
    """A binary file that counts what a decompressor has read from it."""

    def __init__(self, raw):
        self.raw, self.consumed = raw, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.raw.readinto(b)
        self.consumed += n or 0
        return n


def is_spooled(piece: Piece) -> bool:
    """Whether `piece` is a byte range of a compressed file, read from a spool (spool.py)."""
    return bool(piece.files[0].compression) and (piece.start > 0 or piece.end >= 0)


def read_piece(piece: Piece, text_field: str, wanted: Wanted, spool: Spool | None = None) -> Iterator[Document]:
    if is_spooled(piece) and spool is None:
        raise ValueError(f"{piece.files[0].path}: a compressed file's byte range is read from its spool (spool.py)")
    for f in piece.files:
        if f.kind == "parquet":
            yield from _parquet(f, piece.row_group, text_field, wanted)
        elif f.kind == "arrow":
            yield from _arrow(f, text_field, wanted)
        elif f.kind == "jsonl":
            yield from _jsonl(f, piece.start, piece.end, text_field, wanted, spool)
        elif piece.chunked or f.compression or f.size > WHOLE_TEXT_BYTES:
            yield from _chunks(f, piece.start, piece.end, wanted, spool)
        elif wanted(f.rel):
            yield Document(f.rel, f.path.read_bytes().decode("utf-8", errors="replace"))


class _Shifted:
    """A spool read at the offsets of the stream it was taken from."""

    def __init__(self, fh: BinaryIO, base: int):
        self.fh, self.base = fh, base

    def seek(self, offset: int) -> None:
        self.fh.seek(offset - self.base)

    def read(self, n: int = -1) -> bytes:
        return self.fh.read(n)

    def readline(self, n: int = -1) -> bytes:
        return self.fh.readline(n)

    def __iter__(self):
        return iter(self.fh)


@contextmanager
def _opened(f: SourceFile, spool: Spool | None):
    """(a binary file of `f`'s bytes, their size, -1 if unknown): its spool's, or its own."""
    with damaged_as_config_error(f):
        if spool is None:
            with open_binary(f.path, f.compression) as fh:
                yield fh, -1 if f.compression else f.size
        else:
            with open(spool.path, "rb") as fh:
                yield _Shifted(fh, spool.base), spool.size


def _lines(f: SourceFile, start: int, end: int, spool: Spool | None = None) -> Iterator[tuple[int, bytes]]:
    """(offset, line) for each JSON line whose first byte lies in [start, end); end -1: to the end.
    A record is never cut: the line under way at `end` is read to its end."""
    with _opened(f, spool) as (fh, _):
        offset = 0
        if start > 0:  # the line under way belongs to the range before: skipped a block at a time
            fh.seek(start - 1)
            offset = start - 1
            while (block := fh.read(1 << 20)) and (at := block.find(b"\n")) < 0:
                offset += len(block)
            offset += at + 1 if block else 0
            fh.seek(offset)
        for line in fh:
            if end >= 0 and offset >= end:
                return
            yield offset, line
            offset += len(line)


def _segments(f: SourceFile, start: int, end: int, spool: Spool | None = None) -> Iterator[tuple[int, bytes]]:
    """(offset, segment) for a text's byte range [start, end) (end -1: to the end), its cuts moved by
    _text_cut: its lines, each line longer than LINE_BYTES cut in segments of at most that (text8
    is 100 MB on one line, an old Mac's text has only CRs): memory held and bytes read stay bounded,
    a range after the first reading no more than LINE_BYTES before its own."""
    with _opened(f, spool) as (fh, size):
        first, stop = 0, -1
        if start > 0 or end >= 0:  # a range of a plain file or of a spool: seekable
            first = _text_cut(fh, start, size) if start > 0 else 0
            stop = _text_cut(fh, end, size) if end >= 0 else -1
            fh.seek(first)
        offset, carry, readline = first, b"", fh.readline
        while True:  # by line, as a text mostly is: the loop is lean
            segment = readline(LINE_BYTES - len(carry))
            if carry:
                segment, carry = carry + segment, b""
            if stop >= 0 and offset + len(segment) >= stop:  # the range's last: it ends at its cut
                if offset < stop:
                    yield offset, segment[:stop - offset]
                return
            if not segment:
                return
            if len(segment) == LINE_BYTES and segment[-1] != 10:  # no "\n": a line this long is cut
                at = _cut(segment)
                segment, carry = segment[:at], segment[at:]
            yield offset, segment
            offset += len(segment)


def _text_cut(fh, x: int, size: int) -> int:
    """Where a text's byte ranges meet near `x`, the same for the range that ends there and the one
    that starts there: after the line under way at x, if it ends within LINE_BYTES (as for JSON
    lines); else, in a line that long, where _cut cuts the CUT_WINDOW bytes before x. `size`: the
    text's, -1 where not known (a spool short of the stream's end holds LINE_BYTES past x)."""
    if 0 <= size <= x:
        return size
    fh.seek(x - 1)
    ahead = fh.read(LINE_BYTES + 1)
    if (at := ahead.find(b"\n")) >= 0 or len(ahead) <= LINE_BYTES:
        return x + at if at >= 0 else x - 1 + len(ahead)
    fh.seek(max(0, x - CUT_WINDOW))
    behind = fh.read(x - max(0, x - CUT_WINDOW))
    return x - len(behind) + _cut(behind)


def _cut(block: bytes) -> int:
    """Where a long line's `block` ends: after its last whitespace among its last CUT_WINDOW bytes
    (a word is not split), else at its end, moved back to the start of a character it would split."""
    at = max(block.rfind(space, max(0, len(block) - CUT_WINDOW)) for space in (b" ", b"\t", b"\r", b"\n", b"\f", b"\v"))
    if at >= 0:
        return at + 1
    for back in range(1, min(4, len(block)) + 1):
        byte = block[-back]
        if byte < 0x80:  # ASCII: whole
            break
        if byte >= 0xC0:  # a UTF-8 character's first byte: the end splits it unless its bytes are all there
            return len(block) - back if back < (2 if byte < 0xE0 else 3 if byte < 0xF0 else 4) else len(block)
    return len(block)


def _chunks(f: SourceFile, start: int, end: int, wanted: Wanted, spool: Spool | None = None) -> Iterator[Document]:
    """Consecutive lines (or segments of a long line) grouped into documents of about CHUNK_BYTES."""
    parts: list[bytes] = []
    size, first = 0, start
    for offset, line in _segments(f, start, end, spool):
        if not parts:
            first = offset
        parts.append(line)
        size += len(line)
        if size >= CHUNK_BYTES:
            doc_id = f"{f.rel}@{first}"
            if wanted(doc_id):
                yield Document(doc_id, b"".join(parts).decode("utf-8", errors="replace"))
            parts, size = [], 0
    if parts and wanted(doc_id := f"{f.rel}@{first}"):
        yield Document(doc_id, b"".join(parts).decode("utf-8", errors="replace"))


def _jsonl(f: SourceFile, start: int, end: int, field: str, wanted: Wanted,
           spool: Spool | None = None) -> Iterator[Document]:
    for offset, line in _lines(f, start, end, spool):
        doc_id = f"{f.rel}@{offset}"
        if not line.strip() or not wanted(doc_id):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            # A line with no end is the file's last: a download cut short.
            cut = "" if line.endswith(b"\n") else (", and the file ends inside it: truncated? (an interrupted "
                                                   "download: fetch it again)")
            raise ConfigError(f"{f.path}:{_line_number(f, offset)}: not valid JSON ({e.msg}){cut}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{f.path}:{_line_number(f, offset)}: not UTF-8 text") from None
        except RecursionError:  # json recurses once per level, as far as the interpreter's stack allows
            raise ConfigError(f"{f.path}:{_line_number(f, offset)}: a JSON record nested too deeply to read "
                              f"(arrays or objects hundreds of levels deep); expected an object with a string "
                              f"field {field!r} (data.text_field)") from None
        except ValueError:  # an integer of more digits than int() reads: not a JSONDecodeError
            raise ConfigError(f"{f.path}:{_line_number(f, offset)}: not readable as JSON (an integer of more than "
                              f"{sys.get_int_max_str_digits():,} digits); expected an object with a string field "
                              f"{field!r} (data.text_field)") from None
        text = record.get(field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ConfigError(f"{f.path}:{_line_number(f, offset)}: expected an object with a string field "
                              f"{field!r} (data.text_field)")
        if SURROGATE.search(line):  # a lone one has no UTF-8, no tokens: replaced; a pair joined
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        yield Document(doc_id, text)


def _line_number(f: SourceFile, offset: int) -> int:
    """The 1-based line at `offset`: counted only when an error needs it."""
    n = 1
    with damaged_as_config_error(f), open_binary(f.path, f.compression) as fh:
        while offset > 0:
            block = fh.read(min(offset, 1 << 20))
            if not block:
                break
            n += block.count(b"\n")
            offset -= len(block)
    return n


def _column_texts(f: SourceFile, batch, field: str, where: str) -> list:
    import pyarrow as pa

    if field not in batch.schema.names:
        raise ConfigError(f"{f.path}: no column {field!r} (data.text_field); it has {', '.join(batch.schema.names)}")
    column = batch.column(batch.schema.get_field_index(field))
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ConfigError(f"{f.path}: {where}: column {field!r} (data.text_field) holds {column.type}, "
                          "expected strings")
    return column.to_pylist()


def _rows(f: SourceFile, batches, field: str, row: int, wanted: Wanted, where) -> Iterator[Document]:
    """The documents of a table's record batches, numbered on from `row`; `where(row)` names the
    place in an error."""
    for batch in batches:
        for text in _column_texts(f, batch, field, where(row)):
            doc_id = f"{f.rel}#{row}"
            row += 1
            if text and wanted(doc_id):
                yield Document(doc_id, text)


def _arrow_memory():
    """pyarrow, its allocations made with malloc: its default pool (jemalloc or mimalloc) keeps what
    a row group took long after it is freed, 2-3× a worker's memory (bench/RESULTS.md)."""
    import pyarrow as pa

    if pa.default_memory_pool().backend_name != "system":
        pa.set_memory_pool(pa.system_memory_pool())
    return pa


def _parquet(f: SourceFile, row_group: int, field: str, wanted: Wanted) -> Iterator[Document]:
    pa = _arrow_memory()
    import pyarrow.parquet as pq

    try:
        # Read a page at a time, in record batches of about BATCH_TEXT_BYTES of text: a row group
        # (FineWeb's hold hundreds of MB) is never held whole.
        pf = pq.ParquetFile(f.path, buffer_size=1 << 20, pre_buffer=False)
        first = sum(pf.metadata.row_group(i).num_rows for i in range(row_group))
        rows = pf.metadata.row_group(row_group).num_rows
        text = parquet_row_group_bytes(f, field, pf.metadata)[row_group]  # the footer read once
        batch_rows = max(16, min(BATCH_ROWS, rows * BATCH_TEXT_BYTES // max(1, text)))
        batches = pf.iter_batches(batch_size=batch_rows, row_groups=[row_group], columns=[field], use_threads=False)
        yield from _rows(f, batches, field, first, wanted, lambda row: f"row group {row_group}")
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{f.path}: row group {row_group}: unreadable Parquet ({e})") from None


def _arrow(f: SourceFile, field: str, wanted: Wanted) -> Iterator[Document]:
    """An Arrow IPC file as save_to_disk writes it (the stream format), or the file format."""
    pa = _arrow_memory()

    try:
        with pa.memory_map(str(f.path)) as source:
            try:
                reader = pa.ipc.open_stream(source)
            except pa.ArrowInvalid:
                source.seek(0)
                file_reader = pa.ipc.open_file(source)
                reader = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
            yield from _rows(f, reader, field, 0, wanted, lambda row: f"rows from {row}")
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{f.path}: unreadable Arrow file ({e})") from None

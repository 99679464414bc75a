"""The files a task is made from, read so that none can hang or exhaust the reader.

A task file, a CORE bundle's, a harness task's YAML: each is opened only as a regular file (a FIFO
would block the open or the read forever, /dev/zero never ends) and read to a stated size. Their
YAML: bounded_yaml.py (apart, so that importing this costs no YAML parser).

`others_can_change` says why another account could change a file lmcockpit is about to hand to
code that runs it (a harness task's `!function`).
Torch: never.
"""

from __future__ import annotations

import itertools
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

from ..config import ConfigError

MiB = 2**20
MAX_FILE_BYTES = 256 * MiB  # a task file, as JSON lines: CORE's largest is a few MiB
MAX_LINE_BYTES = 1 * MiB  # one item: json.loads of a line holds several times its size in objects
MAX_SMALL_BYTES = 1 * MiB  # core.yaml, eval_meta_data.csv, a harness task's YAML and its Python

KINDS = {stat.S_IFIFO: "a named pipe", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
         stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder"}


def size_text(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB and n % MiB == 0 else f"{n:,} bytes"


def open_regular(path: Path) -> int:
    """A descriptor on `path` (its links followed first: a user's own link is fine), refused unless
    it is a regular file. O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer;
    O_NOFOLLOW: the name resolved may not become a link between the resolving and the opening."""
    real = os.path.realpath(path)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ConfigError(f"{path}: cannot be opened ({e.strerror})") from None
    kind = stat.S_IFMT(os.fstat(fd).st_mode)
    if kind != stat.S_IFREG:
        os.close(fd)
        raise ConfigError(f"{path}: {KINDS.get(kind, 'not a file')}: expected a regular file")
    os.set_blocking(fd, True)
    return fd


def read_bytes(path: Path, limit: int = MAX_SMALL_BYTES) -> bytes:
    """The whole of the regular file `path`, refused past `limit` bytes. FileNotFoundError as open's."""
    with os.fdopen(open_regular(path), "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise ConfigError(f"{path}: larger than {size_text(limit)}, more than lmcockpit reads of such a file")
    return data


def read_text(path: Path, limit: int = MAX_SMALL_BYTES) -> str:
    try:
        return read_bytes(path, limit).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start:,})") from None


def read_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(number, text) of each line of the regular file `path`, each at most MAX_LINE_BYTES and all
    of them at most MAX_FILE_BYTES: a file is read as it is used, never held whole as bytes."""
    total = 0
    with os.fdopen(open_regular(path), "rb") as fh:
        for number in itertools.count(1):
            line = fh.readline(MAX_LINE_BYTES + 1)
            if not line:
                return
            total += len(line)
            if total > MAX_FILE_BYTES:
                raise ConfigError(f"{path}: larger than {size_text(MAX_FILE_BYTES)}, more than lmcockpit reads "
                                  "of a task file")
            if len(line.rstrip(b"\r\n")) > MAX_LINE_BYTES:
                raise ConfigError(f"{path}:{number}: a line longer than {size_text(MAX_LINE_BYTES)}; "
                                  "expected one item a line")
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                raise ConfigError(f"{path}:{number}: not UTF-8 text") from None
            yield number, text


def digits_limit() -> int:
    """The most digits int() and json.loads read of an integer (a ValueError past them)."""
    return sys.get_int_max_str_digits()


def others_can_change(path: Path, st: os.stat_result | None = None) -> str | None:
    """Why another account could change `path` (the file as found, or the folder that holds it, or
    one above), or None: owned by an account other than this one or root, or writable by its group
    or by anyone, except a folder with the sticky bit (as /tmp), where only a file's owner may
    rename or remove it."""
    me = os.geteuid()
    real = Path(os.path.realpath(path))
    named = [p for p in Path(os.path.abspath(path)).parents if p not in real.parents]  # a link's folders too
    for i, p in enumerate([real, *real.parents, *named]):
        s = st if i == 0 and st is not None else os.stat(p)
        what = "the file" if i == 0 else f"the folder {p}"
        if s.st_uid not in (me, 0):
            return f"{what} is owned by uid {s.st_uid}, another account"
        sticky = stat.S_ISDIR(s.st_mode) and s.st_mode & stat.S_ISVTX
        if s.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky:
            return f"{what} is writable by other accounts (mode {stat.S_IMODE(s.st_mode):o})"
    return None

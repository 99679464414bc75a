"""Files and folders written where another account may have planted a name first. Torch-free.

A run folder, a token cache or /tmp can be writable by others on a shared machine (a lab's GPU
box), or copied from someone else. A symlink planted at the name lmcockpit writes would have the
write land in whatever it points to, with the user's rights; a file planted there would be read
as lmcockpit's own. So:

* a file written whole goes to a fresh name from `mkstemp` (O_EXCL: never an existing file or
  link) beside its destination, and is renamed over it (a rename replaces a link, never follows it);
* a log appended to, or a lock file, is opened with O_NOFOLLOW and kept only if it is a regular
  file of the user's;
* a file lmcockpit trusts (a run's `live.json` and `live.key`) is read only if the user owns it and
  no one else may write it;
* a private folder (for sockets) is the user's own with mode 0700, checked after `lstat` as tmux
  checks its own; where that name is taken, a fresh folder from `mkdtemp`;
* a folder written into (a run's checkpoints/, tensorboard/, nan_debug/) is opened without
  following a link and must be the user's own; where the writes take a while, they go through the
  descriptor opened then (`pinned_dir`), so a link swapped in later at the name changes nothing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class NotOwnFile(OSError):
    """A path that is a link, not a regular file or folder, someone else's, or writable by others:
    lmcockpit neither writes through it nor trusts what it holds. The message says which."""


def write_whole(path: Path, data: str | bytes | Iterable[bytes], mode: int = 0o644, fsync: bool = False) -> None:
    """`data` at `path`, whole or not at all: written under a fresh temporary name, then renamed.
    `mode` holds from the first byte (0o600 for a secret), less the umask's bits. `data` may be
    pieces of bytes, written as they come: a file of hundreds of megabytes need not be held."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:  # owns the descriptor from here, whatever fails next
            os.fchmod(fh.fileno(), mode & ~current_umask())
            if isinstance(data, (str, bytes)):
                fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            else:
                fh.writelines(data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def current_umask() -> int:
    """The process's umask, read without changing it: os.umask can only be read by setting it, and
    for that moment a file another thread creates would get the mode it asks for, unmasked (a log
    writable by every account)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            return next(int(line.split()[1], 8) for line in fh if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):  # no /proc (or a kernel before 4.7): the old way
        umask = os.umask(0o077)  # the narrow one, for that moment
        os.umask(umask)
        return umask


def _own(st: os.stat_result, path: Path) -> None:
    if st.st_uid != os.geteuid():
        raise NotOwnFile(f"{path}: owned by uid {st.st_uid}, not by this user: refused")
    if st.st_mode & 0o022:
        raise NotOwnFile(f"{path}: writable by other accounts (mode {stat.S_IMODE(st.st_mode):o}): refused")


def _open(path: Path, flags: int, mode: int = 0o644) -> int:
    """os.open, never through a link, never blocking on a planted FIFO (no effect on a file)."""
    try:
        return os.open(path, flags | NOFOLLOW | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotOwnFile(f"{path}: a symbolic link where lmcockpit keeps a file of its own: refused") from None
        raise


def open_own(path: Path, flags: int, mode: int = 0o644) -> int:
    """os.open of a file of lmcockpit's own at `path`: never through a link, and only a regular
    file this user owns (a planted FIFO, device or someone else's file is refused unopened or
    closed at once). The descriptor blocks as any file's does."""
    fd = _open(path, flags, mode)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise NotOwnFile(f"{path}: not a regular file of this user's where lmcockpit keeps its own: refused")
    os.set_blocking(fd, True)  # O_NONBLOCK was only for a planted FIFO's open; children may inherit it
    return fd


def open_append(path: Path, mode: int = 0o644) -> int:
    """A descriptor that appends to the log at `path` (made if missing), never through a link,
    and only to a regular file this user owns."""
    return open_own(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)


def own_or_absent(path: Path, what: str = "file") -> None:
    """NotOwnFile unless `path` is missing or a regular file of this user's (not a link): a check
    made before a process that will open it, so that it says so in words, not a traceback.
    `what` = "folder": a link, or anything of another account's, is refused (what someone else
    may have put there for lmcockpit to write through); a file of the user's own where a folder
    belongs is left for its writer to name."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise NotOwnFile(f"{path}: a symbolic link where lmcockpit keeps a {what} of its own: refused")
    if what == "folder" and st.st_uid != os.geteuid():
        raise NotOwnFile(f"{path}: owned by uid {st.st_uid}, not by this user: refused")
    if what == "file" and (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()):
        raise NotOwnFile(f"{path}: not a regular file of this user's where lmcockpit keeps its own: refused")


def open_log(path: Path, mode: str = "a"):
    """`open_append` as a text file (mode "a") or binary ("ab")."""
    fd = open_append(path)
    return os.fdopen(fd, mode) if "b" in mode else os.fdopen(fd, mode, encoding="utf-8")


def read_own(path: Path) -> bytes:
    """The bytes of a file this user owns, that no one else may write and that is no link:
    what lmcockpit acts on without further proof (which socket to trust, which key to show)."""
    fd = _open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotOwnFile(f"{path}: not a regular file: refused")
        _own(st, Path(path))
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read()
    finally:
        os.close(fd)


def private_dir(path: Path) -> Path:
    """`path` as a folder only this user can enter: made 0700 if missing; an existing one must be
    a real folder (not a link) of this user's (open_own_dir), and is narrowed to 0700 if wider."""
    path = Path(path)
    path.mkdir(parents=True, mode=0o700, exist_ok=True)
    fd = open_own_dir(path, make=False)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def cache_home() -> Path:
    """Where lmcockpit keeps what it can make again (token caches, the CPU's precision verdict,
    lm-eval's task index): `$XDG_CACHE_HOME/lmcockpit`, else `~/.cache/lmcockpit`."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lmcockpit"


def runtime_dir() -> Path:
    """A folder of this user's alone for sockets: `$XDG_RUNTIME_DIR/lmcockpit`, else
    `/tmp/lmcockpit-UID` when it is (or can be made) the user's own, else a fresh `mkdtemp`
    folder: a name someone else took first in /tmp is never used, nor does it stop lmcockpit."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    candidates = [Path(runtime) / "lmcockpit"] if runtime and os.access(runtime, os.W_OK) else []
    candidates.append(Path(tempfile.gettempdir()) / f"lmcockpit-{os.geteuid()}")
    for candidate in candidates:
        try:
            return private_dir(candidate)
        except OSError:  # NotOwnFile, ELOOP (a link), ENOTDIR (a file), EACCES
            continue
    return Path(tempfile.mkdtemp(prefix=_fresh_prefix()))


def _fresh_prefix() -> str:
    return f"lmcockpit-{os.geteuid()}-"


def fresh_runtime_dir(folder: Path) -> bool:
    """Whether `folder` is one of runtime_dir's fresh `mkdtemp` folders (its fallback where the
    shared names are taken), which no one else knows of: whoever made it removes it when done,
    unlike the folder every lmcockpit of this user's shares."""
    folder = Path(folder).absolute()
    return folder.parent == Path(tempfile.gettempdir()).absolute() and folder.name.startswith(_fresh_prefix())


def open_own_dir(path: Path, make: bool = True) -> int:
    """A descriptor of the folder at `path` (made if missing and `make`), opened without following
    a link, only if it is a folder of this user's; write bits it gives other accounts are taken
    away (a folder of an older run made under a umask of 002), since others could plant names in it."""
    path = Path(path)
    if make:
        try:
            path.mkdir(mode=0o755)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):  # ENOTDIR: a link to a file, or a file
            kind = "a symbolic link" if os.path.islink(path) else "not a folder"
            raise NotOwnFile(f"{path}: {kind} where lmcockpit keeps a folder of its own: refused") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise NotOwnFile(f"{path}: owned by uid {st.st_uid}, not by this user: refused")
        if st.st_mode & 0o022:
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~0o022)
    except BaseException:
        os.close(fd)
        raise
    return fd


def own_dir(path: Path, make: bool = True) -> Path:
    """`path`, checked as `open_own_dir` checks it (and made if missing and `make`)."""
    os.close(open_own_dir(path, make))
    return Path(path)


@contextlib.contextmanager
def pinned_dir(path: Path, make: bool = True) -> Iterator[Path]:
    """The folder at `path` (`open_own_dir`) as a path through the descriptor opened now
    (/proc/self/fd/N): what is written, renamed or deleted under it lands in that folder, whatever
    another account renames or links at `path` meanwhile. Without /proc, `path` itself, checked."""
    fd = open_own_dir(path, make)
    try:
        through = Path(f"/proc/self/fd/{fd}")
        yield through if through.is_dir() else Path(path)
    finally:
        os.close(fd)

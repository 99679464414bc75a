"""Where a detachable run can be found while it trains, and whether it still does: torch-free.

Its `live.json` says where to connect; a run is live while its host answers there, and only
the user's own run host is believed.

A run started from the cockpit (or with `--detach`) is owned by a run host (host.py) that
outlives every front-end. The host serves the run on a Unix socket with a random key and says so
in three places:

* `live.key` in the run folder, mode 0600: the authkey a viewer must present (only the user who
  started the run can read it, so only they can attach);
* `live.json` in the run folder: the host's pid and machine, the socket's path, and a summary
  (step, loss, state, viewers) rewritten as the run goes, which `lmcockpit ps` and the launch
  screen read without connecting;
* a pointer in the user's registry (`$XDG_STATE_HOME/lmcockpit/live/`, a 0700 folder), so
  `lmcockpit attach` and `ps` find the run from any directory.

What a viewer trusts, and why. A run folder may be writable by another account (a shared
project folder, a copied run), and what a host sends is unpickled (multiprocessing's Connection):
whoever answers on the socket could run code as the user who attaches. So a viewer acts on
`live.json` and `live.key` only if they are no links, are the user's own, and no one else may
write them (safe_files.read_own), and on a `live.json` only if each field has its type (a damaged
or planted one is "unreadable", never a crash). Then, before a byte is unpickled, it asks the
kernel who holds the socket (SO_PEERCRED, `peer`): a process of another uid is refused, and so, on
this machine, is one whose pid is not the pid `live.json` names. The host asks the same of every
connection and refuses any of another uid before the handshake. The key stays: the host asks it of
every viewer, and a host on another machine (a shared run folder) has a pid no one here can check.

Each file is written whole through a fresh name (safe_files.write_whole), never through a link.
The socket lives in the run folder when its path fits a Unix socket's 108 bytes, else in a
0700 folder of the user's (safe_files.runtime_dir: `$XDG_RUNTIME_DIR/lmcockpit`, or
`/tmp/lmcockpit-UID` when that is the user's own, else a fresh one): the kernel's limit, not a
choice. An orderly host removes all three when its engine ends, those that are still its own (a
run resumed at that moment has written its own). One that died leaves them: its run is listed as
dead, with the command that resumes it.

The figures live.json's summary shares with every view of the run (the smoothed step time, the
ETA) come from the one fold of the run's events, core/run/state.py's RunState, which the host keeps.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from ..run.safe_files import private_dir, read_own, runtime_dir, write_whole

KEY = "live.key"
RECORD = "live.json"
SOCKET = "live.sock"
SOCKET_PATH_MAX = 100  # sun_path holds 108 bytes with its NUL; leave room


def state_home() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "lmcockpit" / "live"


def run_key(run_dir: Path) -> str:
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:20]


def socket_path(run_dir: Path) -> Path:
    inside = Path(run_dir).resolve() / SOCKET
    if len(os.fsencode(str(inside))) <= SOCKET_PATH_MAX:
        return inside
    return runtime_dir() / f"{run_key(run_dir)}.sock"


def new_key(run_dir: Path) -> bytes:
    key = secrets.token_hex(32)
    write_whole(Path(run_dir) / KEY, key + "\n", mode=0o600)
    return key.encode()


def read_key(run_dir: Path) -> bytes:
    """The run's key, from a file of the user's own (NotOwnFile otherwise): a key someone else
    wrote would open the handshake to a host they run. Bytes as they are: a key that is not text
    (damaged, replaced) is a key the host refuses."""
    return read_own(Path(run_dir) / KEY).strip()


class WrongPeer(ConnectionRefusedError):
    """The socket's other end is not the process it should be: another account's, or not the pid
    live.json names."""


def peer(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket, as the kernel
    recorded it when that process connected or listened: nothing the peer says can change it."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)


def check_peer(sock: socket.socket, pid: int | None = None) -> None:
    """WrongPeer unless the other end runs as this user (and, where `pid` is given, is that process)."""
    their_pid, uid, _ = peer(sock)
    if uid != os.geteuid():
        raise WrongPeer(f"a process of uid {uid} (pid {their_pid}), not of this user's")
    if pid is not None and their_pid != pid:
        raise WrongPeer(f"pid {their_pid}, not the run host live.json names (pid {pid})")


@dataclass
class LiveRecord:
    """live.json: who serves the run and where, and what a listing shows of it."""
    run_dir: str
    pid: int  # the run host's
    machine: str
    socket: str
    preset: str = ""
    state: str = "preparing"
    step: int = 0
    max_steps: int = 0
    loss: float | None = None
    eta_s: float | None = None
    viewers: int = 0
    started: float = 0.0
    target: str = ""  # when the validation loss should reach training.target_val_loss (run/target.py)

    def write(self) -> None:
        write_whole(Path(self.run_dir) / RECORD, json.dumps(self.__dict__), mode=0o600)

    @staticmethod
    def load(run_dir: Path) -> LiveRecord:
        """The run folder's live.json: FileNotFoundError where there is none, NotOwnFile where it
        is not the user's own to trust, BadRecord where it is not one a host wrote."""
        try:
            raw = json.loads(read_own(Path(run_dir) / RECORD).decode("utf-8"))
        except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested past reading
            raise BadRecord(f"{Path(run_dir) / RECORD}: unreadable ({e})") from None
        if not isinstance(raw, dict) or set(raw) - set(_FIELDS) or set(_REQUIRED) - set(raw):
            raise BadRecord(f"{Path(run_dir) / RECORD}: not the fields a run host writes")
        wrong = [name for name, value in raw.items() if not _FIELDS[name](value)]
        if wrong:
            raise BadRecord(f"{Path(run_dir) / RECORD}: {', '.join(wrong)} of the wrong type or out of range")
        return LiveRecord(**raw)

    @staticmethod
    def read(run_dir: Path) -> LiveRecord | None:
        """`load`, or None where there is no live.json this user can act on."""
        try:
            return LiveRecord.load(run_dir)
        except (OSError, ValueError):
            return None


class BadRecord(ValueError):
    """A live.json that is not one a run host wrote: damaged, or planted."""


def _text(value: object) -> bool:
    return isinstance(value, str) and "\0" not in value  # a NUL in a path raises where paths are used


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # NaN too: a loss that diverged


def _number(value: object) -> bool:
    return _real(value) and math.isfinite(value)  # what a time left or a start time can be


def _pid(value: object) -> bool:
    return _count(value) and 0 < value < 2 ** 31  # os.kill takes 0 and below as process groups, and a C int


# What each of live.json's fields must be for a listing or an attach to use it as it is.
_FIELDS = {
    "run_dir": _text, "pid": _pid, "machine": _text, "socket": _text, "preset": _text, "state": _text,
    "target": _text,
    "step": _count, "max_steps": _count, "viewers": _count, "started": _number,
    "loss": lambda v: v is None or _real(v),
    "eta_s": lambda v: v is None or _number(v),
}
_REQUIRED = ("run_dir", "pid", "machine", "socket")


def alive(pid: int) -> bool:
    """Whether `pid` runs: not gone, not someone else's, not a zombie (a host that ended but whose
    parent, the front-end that started it, has not reaped it yet)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or someone else's process has that pid now
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: the signal test is all there is
    return state != "Z"


@dataclass(frozen=True)
class LiveRun:
    record: LiveRecord
    live: bool  # its host is running; False: the engine and host died without cleaning up

    @property
    def run_dir(self) -> Path:
        return Path(self.record.run_dir)

    @property
    def resume_command(self) -> str:
        return f"lmcockpit --run --resume {self.record.run_dir}"


def is_live(record: LiveRecord) -> bool:
    """Whether the host that wrote `record` still runs. A host on another machine (a shared run
    folder) cannot be asked from here: taken as live while its socket file is there."""
    if record.machine != socket.gethostname():
        return Path(record.socket).exists()
    return alive(record.pid)


def register(run_dir: Path) -> None:
    write_whole(private_dir(state_home()) / f"{run_key(run_dir)}.json",
                json.dumps({"run_dir": str(Path(run_dir).resolve())}), mode=0o600)


def unregister(run_dir: Path) -> None:
    (state_home() / f"{run_key(run_dir)}.json").unlink(missing_ok=True)


def forget(run_dir: Path) -> None:
    """A run that is being resumed, or whose host ended in order: listed no more."""
    unregister(run_dir)
    for name in (RECORD, KEY):
        (Path(run_dir) / name).unlink(missing_ok=True)


def release(run_dir: Path, pid: int, key: bytes) -> None:
    """What an ended host removes: live.json and live.key while they are still its own (its pid,
    its key), and the registry's pointer unless another host's live.json is there. A run resumed
    as this host ends writes the same files: they are that run's, and it must stay listed and
    attachable."""
    record = LiveRecord.read(run_dir)
    if record is not None and record.pid == pid and record.machine == socket.gethostname():
        (Path(run_dir) / RECORD).unlink(missing_ok=True)
    try:
        if read_key(run_dir) == key:
            (Path(run_dir) / KEY).unlink(missing_ok=True)
    except OSError:
        pass  # none: nothing to remove
    if LiveRecord.read(run_dir) is None:
        unregister(run_dir)


@dataclass(frozen=True)
class Unreadable:
    """A run the registry knows whose live.json is there but not to be acted on: `why` says how."""
    run_dir: Path
    why: str


def survey() -> tuple[list[LiveRun], list[Unreadable]]:
    """Every run the registry knows: those whose live.json reads, live ones first (newest first),
    then dead ones; and those whose live.json is refused or damaged, kept listed (their pointer
    too) so that `ps` says so rather than lose a run without a word. Pointers to folders that are
    gone, or that no longer hold a live.json, are dropped."""
    found, unreadable = [], []
    home = state_home()
    for pointer in sorted(home.glob("*.json")) if home.is_dir() else []:
        try:
            run_dir = Path(json.loads(pointer.read_text(encoding="utf-8"))["run_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            pointer.unlink(missing_ok=True)
            continue
        try:
            record = LiveRecord.load(run_dir)
        except (FileNotFoundError, NotADirectoryError):
            pointer.unlink(missing_ok=True)
            continue
        except (OSError, ValueError) as e:
            unreadable.append(Unreadable(run_dir, str(e)))
            continue
        found.append(LiveRun(record, is_live(record)))
    return sorted(found, key=lambda r: (not r.live, -r.record.started)), unreadable


def live_runs() -> list[LiveRun]:
    """The runs of `survey` whose live.json reads."""
    return survey()[0]


def time_limits(conn_or_sock, seconds: float) -> None:
    """Reads and writes on the socket fail (EAGAIN) after `seconds` without progress; 0: never.
    Both ends' handshakes have one: a peer that connects and says nothing must hold up no one.
    Set through a copy of the descriptor: the socket stays blocking, as multiprocessing's
    Connection reads it."""
    limit = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
    with socket.socket(fileno=os.dup(conn_or_sock.fileno())) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)

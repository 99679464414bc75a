"""Where a detachable run can be found while it trains, and whether it still is: torch-free.

A run started from the cockpit (or with `--detach`) is owned by a run host (host.py) that
outlives every front-end. The host serves the run on a Unix socket with a random key and says so
in three places:

* `live.key` in the run folder, mode 0600: the authkey a viewer must present (only the user who
  started the run can read it, so only they can attach);
* `live.json` in the run folder: the host's pid and machine, the socket's path, and a summary
  (step, loss, state, viewers) rewritten as the run goes, which `lmcockpit ps` and the launch
  screen read without connecting;
* a pointer in the user's registry (`$XDG_STATE_HOME/lmcockpit/live/`), so `lmcockpit attach` and
  `ps` find the run from any directory.

The socket lives in the run folder when its path fits a Unix socket's 108 bytes, else under
`$XDG_RUNTIME_DIR` (or a 0700 folder of the user's in /tmp): the kernel's limit, not a choice.
An orderly host removes all three when its engine ends, those that are still its own (a run
resumed at that moment has written its own). One that died leaves them: its run is listed as
dead, with the command that resumes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

KEY = "live.key"
RECORD = "live.json"
SOCKET = "live.sock"
SOCKET_PATH_MAX = 100  # sun_path holds 108 bytes with its NUL; leave room


def state_home() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "lmcockpit" / "live"


def private_dir(path: Path) -> Path:
    """`path`, created 0700 (and made so if it exists and is ours)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def write_private(path: Path, text: str) -> None:
    """Written whole or not at all, readable by its owner only from the first byte."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def run_key(run_dir: Path) -> str:
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:20]


def socket_path(run_dir: Path) -> Path:
    inside = Path(run_dir).resolve() / SOCKET
    if len(os.fsencode(str(inside))) <= SOCKET_PATH_MAX:
        return inside
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "lmcockpit" if runtime and os.access(runtime, os.W_OK) else \
        Path("/tmp") / f"lmcockpit-{os.getuid()}"
    return private_dir(base) / f"{run_key(run_dir)}.sock"


def new_key(run_dir: Path) -> bytes:
    key = secrets.token_hex(32)
    write_private(Path(run_dir) / KEY, key + "\n")
    return key.encode()


def read_key(run_dir: Path) -> bytes:
    # bytes as they are: a key that is not text (damaged, replaced) is a key the host refuses
    return (Path(run_dir) / KEY).read_bytes().strip()


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

    def write(self) -> None:
        write_private(Path(self.run_dir) / RECORD, json.dumps(self.__dict__))

    @staticmethod
    def read(run_dir: Path) -> LiveRecord | None:
        try:
            raw = json.loads((Path(run_dir) / RECORD).read_text(encoding="utf-8"))
            return LiveRecord(**raw)
        except (OSError, ValueError, TypeError):
            return None


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
    write_private(private_dir(state_home()) / f"{run_key(run_dir)}.json",
                  json.dumps({"run_dir": str(Path(run_dir).resolve())}))


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


def live_runs() -> list[LiveRun]:
    """Every run the registry knows, live ones first (newest first), then dead ones. Pointers to
    folders that are gone, or that no longer hold a record, are dropped."""
    found = []
    home = state_home()
    for pointer in sorted(home.glob("*.json")) if home.is_dir() else []:
        try:
            run_dir = Path(json.loads(pointer.read_text(encoding="utf-8"))["run_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            pointer.unlink(missing_ok=True)
            continue
        record = LiveRecord.read(run_dir)
        if record is None:
            pointer.unlink(missing_ok=True)
            continue
        found.append(LiveRun(record, is_live(record)))
    return sorted(found, key=lambda r: (not r.live, -r.record.started))

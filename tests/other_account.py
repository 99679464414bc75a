"""A second account on this machine, for the tests of what another user can and cannot reach: a
forked child that drops to `nobody`'s uid and gid, then runs a function of the test's. Forked, not
exec'd, so it needs no interpreter or checkout that account may read. CI runs as root, so there
these tests always run; elsewhere (not root) they say why they cannot."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import select
import signal
import time
from collections.abc import Callable, Iterator

import pytest


def other_account() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("acting as a second account needs root (CI runs as root)")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this machine has no 'nobody' account to act as a second one")


def _fork_as_other(fn: Callable, args: tuple, out: int | None) -> int:
    pw = other_account()
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        os.setgroups([])
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)
        result = ["ok", fn(*args)]
    except BaseException as e:  # noqa: BLE001 - whatever it was, the test reads it as text
        result, code = ["raised", f"{type(e).__name__}: {e}"], 1
    try:
        if out is not None:
            os.write(out, json.dumps(result, default=str).encode())
    finally:
        os._exit(code)


def run_as_other(fn: Callable, *args, timeout: float = 30):
    """`fn(*args)` as `nobody`; what it returned (JSON-able), or OtherRaised with what it raised."""
    r, w = os.pipe()
    pid = _fork_as_other(fn, args, w)
    os.close(w)
    data, deadline = b"", time.monotonic() + timeout
    try:
        while select.select([r], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
        else:
            os.kill(pid, signal.SIGKILL)
            raise TimeoutError(f"the other account's call did not end within {timeout} s")
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    status, value = json.loads(data)
    if status == "raised":
        raise OtherRaised(value)
    return value


class OtherRaised(Exception):
    """What the other account's call raised, as text."""


@contextlib.contextmanager
def held_by_other(fn: Callable, *args) -> Iterator[int]:
    """`fn(*args)` left running as `nobody` (a server that account holds) while the block runs;
    killed at its end. Yields its pid."""
    pid = _fork_as_other(fn, args, None)
    try:
        yield pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)

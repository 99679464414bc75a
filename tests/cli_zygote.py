"""`lmcockpit` commands for the tests, each a process forked from one that imported the front-end once.

`helpers.cli()` runs the real command in a process of its own, as a user's shell would, hundreds of
times a suite; a new interpreter importing lmcockpit's front-end (argparse, rich, the config's and the
protocol's dataclasses) spent ~0.3 s of CPU on each before the command did anything. Here one server
per test worker imports it once, and each command is a fork of the server: a process of its own with
the test's argv, working folder, environment and standard streams (passed over a Unix socket), the
command run as `python -m lmcockpit.tui.cli` runs it (`lmcockpit.tui.cli` as `__main__`, so the engine
a command starts prepares itself as it does for a user), and its exit status reported back. What the
command starts (an engine, a run host) it starts itself, as from a shell.

Its engines come from one forkserver the server started (core/process/warm_start.py, torch imported
in it once; a command's own took ~4.5 s of CPU: ~280 CPU-s of a whole suite, bench/RESULTS.md), as a user's
second engine comes from the forkserver their first one started: an engine is born with its
command's environment, umask, folder, streams and signals all the same (warm_start.as_if_spawned),
and tests/test_warm_start.py and every test that starts the command as a plain subprocess keep the
command's own forkserver tested. A command whose environment differs from the server's (a variable
torch or the Hub reads as it is imported) starts its own, as from a shell.

The server imports only the torch-free front-end (tests/test_layout.py keeps it torch-free), and
nothing it imports reads the environment or the working folder at import, so a fork runs the
command as a new interpreter would. A test that reads and signals a command as it runs has it as
`Forked`, with subprocess.Popen's face (helpers.cli_popen); one that signals a whole process group
(a terminal's hang-up, Ctrl-C to a job) starts a plain subprocess in a session of its own, whose own
forkserver the signal then reaches too (helpers.start_cli_run(session=True)).
"""

from __future__ import annotations

import importlib
import json
import locale
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# What `python -m lmcockpit.tui.cli` imports before a command runs: the entry point, every command's
# module (imported when its command runs), and the headless front-end of `--run`.
PRELOAD = ("lmcockpit.tui.cli", "lmcockpit.tui.headless")


# ---------------------------------------------------------------------------------------- server
def _preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    from lmcockpit.tui.commands import COMMANDS

    for command in COMMANDS.values():
        importlib.import_module(command.module)
    assert "torch" not in sys.modules, "the front-end imported torch: a fork would not start as an interpreter does"
    imported = set(NOT_IMPORTED) & {name.partition(".")[0] for name in sys.modules}
    assert not imported, f"the front-end imported {sorted(imported)}: a command could not differ from us in UNREAD"


def _warm_forkserver() -> dict[str, str]:
    """Start the forkserver the commands share, as a front-end starts its own (warm_start); returns
    the environment it was started with, which a command must have to use it."""
    from multiprocessing import forkserver

    from lmcockpit.core.process import warm_start

    warm_start.context(warm_start.ENGINE)
    with warm_start.deaf_helpers():
        forkserver.ensure_running()
    return dict(os.environ)


# Read only after an engine is forked, so a command may differ in them and share the forkserver:
# pytest's name of the test; the inductor cache's folder, which torch writes into the environment at
# a process's first compile (the test worker's, some time after the server started); the GPUs CUDA
# may number (read as CUDA starts, never in a forkserver: warm_start says why); lmcockpit's test hooks;
# the Hub's settings and the proxies, read by the Hub's and HTTP clients as they are imported or
# connect, which neither this server nor the forkserver imports (NOT_IMPORTED: test_warm_start and
# _preload hold them to it).
UNREAD = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "CUDA_VISIBLE_DEVICES",
          "NO_PROXY", "no_proxy", "HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy")
UNREAD_PREFIXES = ("LMCOCKPIT_TEST_", "HF_", "TRANSFORMERS_")
NOT_IMPORTED = ("huggingface_hub", "transformers", "datasets", "tokenizers", "requests", "httpx", "urllib3")


def _read_before_fork(env: dict[str, str]) -> dict[str, str]:
    """The variables a forkserver may have read as it imported torch: those a sharer must match."""
    return {k: v for k, v in env.items() if k not in UNREAD and not k.startswith(UNREAD_PREFIXES)}


def _same_environment(a: dict[str, str], b: dict[str, str]) -> bool:
    return _read_before_fork(a) == _read_before_fork(b)


def _adopt_forkserver(shared: bool) -> None:
    """In a command's fork: use the server's forkserver (it is not this process's child, so
    multiprocessing's check of it would fail: it lives as long as any of us holds its alive pipe), or
    forget it and the resource tracker, for the command to start its own."""
    from multiprocessing import forkserver, resource_tracker

    from lmcockpit.core.process import warm_start

    if shared:
        forkserver._forkserver.ensure_running = resource_tracker.ensure_running
        return
    warm_start.forget_helpers()


def _serve(path: str):
    """Accept requests until the test worker (our stdin's writer) goes; return in a forked child,
    with (request, fds), for it to become the command."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears of each exit
    children: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")
    while True:
        for key, _ in sel.select():
            if key.data == "parent":  # EOF: the worker has gone; so do we (our children run on)
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)  # the socket's own folder
                os._exit(0)
            if key.data == "child":
                os.read(wake_r, 4096)
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if not pid:
                        break
                    conn = children.pop(pid, None)
                    if conn is not None:
                        code = os.waitstatus_to_exitcode(status)
                        try:
                            conn.sendall(struct.pack("!i", code))
                        except OSError:
                            pass
                        conn.close()
                continue
            conn, _ = listener.accept()
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
            while len(msg) < struct.unpack("!I", msg[:4])[0] + 4:  # a large environment comes in pieces
                msg += conn.recv(1 << 22)
            request = json.loads(msg[4:])
            pid = os.fork()
            if pid == 0:
                sel.close()
                listener.close()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w):
                    os.close(fd)
                for other in children.values():
                    other.close()
                conn.close()
                return request, fds
            for fd in fds:
                os.close(fd)
            conn.sendall(struct.pack("!i", pid))
            children[pid] = conn


def _become(request: dict, fds: list[int], server_env: dict[str, str]) -> None:
    """This fork as the command: its streams, folder, environment and argv; then run, then exit."""
    _adopt_forkserver(_same_environment(request["env"], server_env))
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # as `python -m` puts the working folder first
    os.environ.clear()
    os.environ.update(request["env"])
    cli = sys.modules["lmcockpit.tui.cli"]
    sys.argv = [cli.__file__, *request["args"]]
    sys.modules["__main__"] = cli  # as `python -m`: a spawned engine prepares itself from it
    sys.exit(cli.main())


# ---------------------------------------------------------------------------------------- client
class _Server:
    def __init__(self):
        self.env = dict(os.environ)  # its forkserver's, which a command must have to share it
        self.folder = tempfile.mkdtemp(prefix="lmcockpit-zygote-")
        self.path = os.path.join(self.folder, "s")
        # Our stdin is its stdin: when this process ends, the server reads EOF and ends too.
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cli_zygote", self.path],
                                     stdin=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1])
        deadline = time.monotonic() + 60
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the test CLI server did not start (exit {self.proc.poll()})")
            time.sleep(0.01)


# A server per environment the worker has had, the latest few: a test that changes the worker's
# environment for good (test_export's HF_HUB_OFFLINE) gets a server whose forkserver its commands share,
# and one that changes it for a while finds the first one again after.
_servers: dict[tuple, _Server] = {}
KEPT = 3
_lock = threading.Lock()


def _the_server() -> _Server:
    key = tuple(sorted(_read_before_fork(dict(os.environ)).items()))
    with _lock:
        server = _servers.pop(key, None)
        if server is None or server.proc.poll() is not None:
            server = _Server()
        _servers[key] = server  # the newest last
        while len(_servers) > KEPT:
            oldest = _servers.pop(next(iter(_servers)))
            oldest.proc.stdin.close()  # EOF: it goes; the commands it started run on
            oldest.proc.wait(30)
        return server


def _start(args: list[str], cwd: Path | None, env: dict[str, str] | None, stdin: int
           ) -> tuple[socket.socket, int, int, int]:
    """The command forked, `stdin` its standard input: the connection its exit status comes on, its
    pid, and the read ends of its stdout and stderr."""
    server = _the_server()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    body = json.dumps({"args": list(args), "cwd": str(cwd or os.getcwd()),
                       "env": dict(os.environ) if env is None else env}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(server.path)
        socket.send_fds(conn, [struct.pack("!I", len(body)) + body], [stdin, out_w, err_w])
        pid = struct.unpack("!i", _exactly(conn, 4))[0]
    except BaseException:
        conn.close()
        for fd in (out_r, err_r):
            os.close(fd)
        raise
    finally:
        for fd in (out_w, err_w):
            os.close(fd)
    return conn, pid, out_r, err_r


def run(args: list[str], cwd: Path | None, env: dict[str, str] | None, timeout: float, input: str | None = None
        ) -> subprocess.CompletedProcess:
    """subprocess.run([python, -m, lmcockpit.tui.cli, *args], input=input, capture_output=True, text=True)
    as a fork."""
    in_r, in_w = os.pipe() if input is not None else (0, None)
    try:
        conn, pid, out_r, err_r = _start(args, cwd, env, in_r)
    except BaseException:
        if in_w is not None:
            os.close(in_w)
        raise
    finally:
        if in_w is not None:
            os.close(in_r)
    with conn:
        out, err = [], []
        readers = [threading.Thread(target=_drain, args=(fd, into), daemon=True) for fd, into in ((out_r, out), (err_r, err))]
        if in_w is not None:
            readers.append(threading.Thread(target=_feed, args=(in_w, input.encode(locale.getencoding())), daemon=True))
        for reader in readers:
            reader.start()
        conn.settimeout(timeout)
        try:
            code = struct.unpack("!i", _exactly(conn, 4))[0]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(["lmcockpit", *args], timeout) from None
        for reader in readers:
            reader.join()
    return subprocess.CompletedProcess([sys.executable, "-m", "lmcockpit.tui.cli", *args], code,
                                       _text(b"".join(out)), _text(b"".join(err)))


class Forked:
    """subprocess.Popen([python, -m, lmcockpit.tui.cli, *args], stdout=PIPE, stderr=PIPE, text=True)
    as a fork: the same pid to signal, text streams to read, poll, wait and communicate. Its process
    group is the server's, itself in the test worker's, as a Popen'd command's is the worker's; a test
    that needs a session of its own (a terminal's hang-up, Ctrl-C to the whole job) starts a real
    subprocess, whose forkserver then meets the signal too."""

    def __init__(self, args: list[str], cwd: Path | None = None, env: dict[str, str] | None = None):
        self.args = [sys.executable, "-m", "lmcockpit.tui.cli", *args]
        self._conn, self.pid, out_r, err_r = _start(args, cwd, env, 0)
        # Text mode as subprocess's: the locale's encoding, universal newlines.
        self.stdout = open(out_r, encoding=locale.getencoding())
        self.stderr = open(err_r, encoding=locale.getencoding())
        self.returncode: int | None = None
        self._ended = threading.Event()
        threading.Thread(target=self._await_exit, daemon=True).start()

    def _await_exit(self) -> None:
        with self._conn:
            try:
                self.returncode = struct.unpack("!i", _exactly(self._conn, 4))[0]
            finally:
                self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # once reaped, its pid may be another process's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """The rest of stdout and stderr, once the command has ended; each stream closed after."""
        got: dict[str, str] = {}

        def read(name: str, stream) -> None:
            got[name] = "" if stream.closed else stream.read()
            stream.close()

        readers = [threading.Thread(target=read, args=(name, stream), daemon=True)
                   for name, stream in (("out", self.stdout), ("err", self.stderr))]
        for reader in readers:
            reader.start()
        self.wait(timeout)
        for reader in readers:
            reader.join(timeout)
            if reader.is_alive():  # a child of the command still holds the stream open
                raise subprocess.TimeoutExpired(self.args, timeout)
        return got["out"], got["err"]


def _text(data: bytes) -> str:
    """As subprocess's text mode reads a stream: the locale's encoding, every newline a \\n."""
    return data.decode(locale.getencoding()).replace("\r\n", "\n").replace("\r", "\n")


def _feed(fd: int, data: bytes) -> None:
    """The command's standard input, then its end (a command that exits before reading it all is fine)."""
    with open(fd, "wb", closefd=True) as stream:
        try:
            stream.write(data)
        except BrokenPipeError:
            pass


def _drain(fd: int, into: list[bytes]) -> None:
    with open(fd, "rb", closefd=True) as stream:
        while chunk := stream.read1(1 << 16):
            into.append(chunk)


def _exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise RuntimeError("the test CLI server closed the connection")
        data += chunk
    return data


if __name__ == "__main__":
    _preload()
    env = _warm_forkserver()
    request, fds = _serve(sys.argv[1])
    _become(request, fds, env)

"""`lmcockpit serve`: the cockpit in a browser.

Each browser tab gets its own `lmcockpit` process (the launch screen, as in a terminal), run by
textual-serve under Textual's web driver; closing the tab quits that cockpit the way closing a
terminal does.

Whoever reaches the server drives the cockpit, and through it this machine's GPUs and files as
this user, and textual-serve has no login. A TCP port, even on 127.0.0.1, is open to every account
on the machine, so by default there is none: the server listens on a Unix socket, 0600 from its
first instant, in a 0700 folder of the user's own (safe_files.runtime_dir), and a laptop reaches it
through OpenSSH's socket forwarding (`ssh -L 8000:/path/serve.sock`), which needs no port on this
machine either. `--port` or `--host` opts into TCP, and then every request must carry a random
token, as Jupyter's do: the printed URL has it, and the browser keeps it in a cookie. A browser
sends a host's cookies to all its ports, another account's server's too, so on TCP the cockpit is
served under a random path of its own, the cookie's Path (`webserver` checks both, and fits
textual-serve's server to both setups). `session` is one browser tab's cockpit, which quits with
the server.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import getpass
import ipaddress
import os
import secrets
import shlex
import signal
import socket
import stat
import sys
from pathlib import Path

from .. import command_parser
from ...usage import UsageError, error

LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 8000  # textual-serve's own default; also the laptop's end of the tunnel
SOCKET_NAME = "serve.sock"

TUNNEL = f"""\
from a laptop, through an SSH tunnel to the socket (OpenSSH 6.7 or later):
  on the GPU machine:  lmcockpit serve        (prints the socket's path, SOCKET, and this tunnel)
  on the laptop:       ssh -N -L {DEFAULT_PORT}:SOCKET you@gpu-box
  then open http://localhost:{DEFAULT_PORT} in the laptop's browser

a browser on this machine itself: lmcockpit serve --port {DEFAULT_PORT}, and open the URL it prints
(with its ?token=: other accounts here can reach the port, not the token)"""


def build_parser() -> argparse.ArgumentParser:
    p = command_parser(__name__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Serve the cockpit to web browsers through textual-serve: each browser tab opens\n"
                                   "the launch screen, as `lmcockpit` does in a terminal (run folders under runs/\n"
                                   "here). Whoever reaches the server drives the cockpit, so by default it opens no\n"
                                   "TCP port: it listens on a Unix socket only this user can open, reached from a\n"
                                   "laptop through an SSH tunnel. --port or --host serve on TCP instead, and then\n"
                                   "the printed URL carries a token that every request must present.",
                       epilog=TUNNEL)
    p.add_argument("--socket", metavar="PATH", type=Path,
                   help=f"the Unix socket to listen on (default {SOCKET_NAME} in a folder of this user's alone: "
                        "$XDG_RUNTIME_DIR/lmcockpit, else /tmp/lmcockpit-UID); made 0600")
    p.add_argument("--port", metavar="N", type=int,
                   help=f"serve on TCP port N instead of the socket (with --host alone: {DEFAULT_PORT}); "
                        "the printed URL's token is required")
    p.add_argument("--host", metavar="ADDRESS",
                   help=f"the address to serve TCP on (default {LOOPBACK}); any other sends the token and every "
                        "keystroke over the network unencrypted")
    return p


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it could resolve anywhere
        return False


def cockpit_command() -> str:
    """The command each browser tab runs, as a shell line (textual-serve runs it through a shell,
    whose `exec` makes the cockpit this server's own child): this interpreter, so the cockpit is
    the installation serving it (-P: not a lmcockpit/ in the working folder), given this server's pid
    to quit with (`session`)."""
    return "exec " + shlex.join([sys.executable, "-P", "-m", "lmcockpit.tui.commands.serve.session", str(os.getpid())])


def bind_failure(host: str, port: int, e: OSError) -> str:
    if isinstance(e, socket.gaierror):
        return f"--host {host}: not an address of this machine ({e.strerror})"
    if e.errno == errno.EADDRINUSE:
        return (f"port {port} is taken on {host} (another `lmcockpit serve`, or another server): "
                f"pick a free one with --port N")
    if e.errno == errno.EACCES:
        return f"port {port}: not allowed to listen on it here (ports below 1024 need root): pick another with --port N"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine"
    return f"cannot listen on {host}:{port}: {e.strerror or e}"


class SocketTaken(Exception):
    """The socket's path holds what this serve may not replace: a server that answers there, or
    a file that is no socket. The message says which."""


def listen_unix(path: Path) -> tuple[socket.socket, int]:
    """A socket listening at `path`, 0600 from its first instant, and its file's inode. A socket
    file nothing answers on is a dead serve's, and is replaced."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except FileNotFoundError:
        pass
    except ConnectionRefusedError:  # what a socket with no server says, and a file that is no socket
        if not stat.S_ISSOCK(os.lstat(path).st_mode):  # --socket naming a file by mistake: not ours to delete
            raise SocketTaken(f"{path}: not a socket; give --socket a path of its own") from None
        path.unlink()
    else:
        raise SocketTaken(f"{path}: a server answers there already (another `lmcockpit serve`?): open that "
                          f"one, stop it first, or give this one --socket PATH")
    finally:
        probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    saved = os.umask(0o177)
    try:
        sock.bind(str(path))
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(saved)
    sock.listen(128)
    return sock, os.stat(path).st_ino


def announce(where: str, tunnel: str | None = None, opened: str = "", warning: str | None = None) -> None:
    """Once the server listens: where, and from a laptop, the tunnel and the address to open."""
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    print(f"lmcockpit serve: the cockpit on {where} (Ctrl-C stops it and every cockpit it opened)")
    if tunnel:
        print(f"from a laptop:   {tunnel}\nthen open        {opened}")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.port is not None and not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port}: expected a port number, 1 to 65535")
    if args.socket is not None and (args.port is not None or args.host is not None):
        raise UsageError("--socket serves on a Unix socket, --port and --host on TCP: give one or the other")
    if args.port is not None or args.host is not None:
        return serve_tcp(args.host or LOOPBACK, args.port or DEFAULT_PORT)
    if args.socket is not None:
        return serve_unix(args.socket.absolute())
    from ....core.run.safe_files import fresh_runtime_dir, runtime_dir

    folder = runtime_dir().absolute()
    if not fresh_runtime_dir(folder):
        return serve_unix(folder / SOCKET_NAME)
    # Until the server's own handler takes over, SIGTERM too ends in the `finally`, as Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return serve_unix(folder / SOCKET_NAME)
    finally:
        # No one else knows this folder; once its socket is gone, each serve would leave one more behind.
        with contextlib.suppress(OSError):
            folder.rmdir()


def serve_unix(path: Path) -> int:
    try:
        sock, inode = listen_unix(path)
    except SocketTaken as e:
        return error(str(e))
    except OSError as e:  # its folder missing or not this user's to write, a path too long for a socket
        return error(f"cannot listen on {path}: {e.strerror or e}")
    tunnel = f"ssh -N -L {DEFAULT_PORT}:{shlex.quote(str(path))} {getpass.getuser()}@{socket.gethostname()}"
    try:
        return run({"sock": sock}, loopback=True, token=None,  # the laptop's browser asks for localhost:8000
                   on_open=lambda: announce(str(path), tunnel, f"http://localhost:{DEFAULT_PORT}"))
    finally:
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(path).st_ino == inode:  # not a file another serve has bound there since
                path.unlink()


def serve_tcp(host: str, port: int) -> int:
    # Every account on the machine reaches a TCP port: the token is what only this user has seen,
    # and base the path that keeps its cookie from the servers on this host's other ports.
    token = secrets.token_hex(24)
    base = f"/{secrets.token_hex(16)}/"
    here = socket.gethostname()
    shown = here if host in ("0.0.0.0", "::") else f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}{base}?token={token}"
    if is_loopback(host):
        def on_open() -> None:
            announce(url, f"ssh -N -L {port}:127.0.0.1:{port} {getpass.getuser()}@{here}",
                     f"http://localhost:{port}{base}?token={token}")
    else:
        def on_open() -> None:
            announce(url, warning=f"listening on {host} over plain HTTP: anyone who can watch the network "
                                  f"between a browser and this machine can read the token and drive the cockpit "
                                  f"(and train on this machine's GPUs); the safe way is the default Unix socket "
                                  f"and an SSH tunnel (ssh -L)")
    try:
        return run({"host": host, "port": port}, loopback=is_loopback(host), token=token, on_open=on_open,
                   base=base)
    except OSError as e:  # the port taken, or not one of ours to listen on: before anything was served
        return error(bind_failure(host, port, e))


def run(listen: dict, **options) -> int:
    from .webserver import CockpitServer

    CockpitServer(cockpit_command(), listen, **options).serve()  # until Ctrl-C or SIGTERM, a graceful exit
    return 130  # it serves until a signal stops it: interrupted, as every command exits then

"""`lmcockpit serve`: the cockpit in a browser. Each browser tab gets its own `lmcockpit` process
(the launch screen, as in a terminal), run by textual-serve under Textual's web driver; closing
the tab quits that cockpit the way closing a terminal does.

textual-serve has no login: whoever reaches the port drives the cockpit, and through it this
machine's GPUs and files. So it listens on 127.0.0.1 unless `--host` says otherwise, and a laptop
reaches it through an SSH tunnel. webserver.py fits textual-serve's server to that setup.
"""

from __future__ import annotations

import argparse
import errno
import getpass
import ipaddress
import os
import shlex
import socket
import sys

from lmcockpit.tui.usage import Parser, UsageError, error

LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 8000  # textual-serve's own default

TUNNEL = f"""\
from a laptop, through an SSH tunnel:
  on the GPU machine:  lmcockpit serve
  on the laptop:       ssh -N -L {DEFAULT_PORT}:127.0.0.1:{DEFAULT_PORT} you@gpu-box
  then open http://localhost:{DEFAULT_PORT} in the laptop's browser"""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="lmcockpit serve", formatter_class=argparse.RawDescriptionHelpFormatter,
               description="Serve the cockpit to web browsers through textual-serve: each browser tab opens\n"
                           "the launch screen, as `lmcockpit` does in a terminal (run folders under runs/\n"
                           "here). textual-serve has no login, so it listens on 127.0.0.1 unless --host\n"
                           "says otherwise: reach it through an SSH tunnel.",
               epilog=TUNNEL)
    p.add_argument("--port", metavar="N", type=int, default=DEFAULT_PORT,
                   help=f"the port to listen on (default {DEFAULT_PORT}, as textual-serve's)")
    p.add_argument("--host", metavar="ADDRESS", default=LOOPBACK,
                   help=f"the address to listen on (default {LOOPBACK}); any other lets anyone who can reach "
                        "the port drive the cockpit, with no login")
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
    the installation serving it, given this server's pid to quit with (serve_session.py)."""
    return "exec " + shlex.join([sys.executable, "-m", "lmcockpit.tui.serve_session", str(os.getpid())])


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


def announce(host: str, port: int) -> None:
    """Once the port is open: where to point a browser, and on loopback the tunnel from a laptop;
    on any other address, the warning that nothing stands between that address and the cockpit."""
    here = socket.gethostname()
    shown = here if host in ("0.0.0.0", "::") else f"[{host}]" if ":" in host else host
    if not is_loopback(host):
        print(f"warning: listening on {host}: textual-serve has no login, so anyone who can reach port {port} "
              f"can drive the cockpit (and train on this machine's GPUs); the safe way is the default "
              f"127.0.0.1 and an SSH tunnel (ssh -L)", file=sys.stderr, flush=True)
    print(f"lmcockpit serve: the cockpit on http://{shown}:{port} (Ctrl-C stops it and every cockpit it opened)")
    if is_loopback(host):
        print(f"from a laptop:   ssh -N -L {port}:127.0.0.1:{port} {getpass.getuser()}@{here}\n"
              f"then open        http://localhost:{port}")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
        if not 0 < args.port < 65536:
            raise UsageError(f"--port {args.port}: expected a port number, 1 to 65535")
    except UsageError as e:
        return error(str(e))
    try:
        from lmcockpit.tui.webserver import CockpitServer

        server = CockpitServer(cockpit_command(), args.host, args.port, is_loopback(args.host),
                               on_open=lambda: announce(args.host, args.port))
        server.serve()  # until Ctrl-C or SIGTERM, which it turns into a graceful exit itself
    except OSError as e:  # the port taken, or not one of ours to listen on: before anything was served
        return error(bind_failure(args.host, args.port, e))
    except KeyboardInterrupt:  # before the server took Ctrl-C over
        return 130
    return 0

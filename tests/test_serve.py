"""`lmcockpit serve`: the real command in a subprocess, and a real browser (the system's Chromium,
driven by Playwright) that opens the launch screen and drives it with keys, on TCP with the printed
token and through a tunnel to the default Unix socket; that what the browser keeps reaches no server
on another port of the host, and that a download comes under the cockpit's path; what it binds (and
the fallback folder it removes), what it refuses, and that neither a stopped nor a killed server
leaves a cockpit running. What another account can reach is tests/test_serve_access.py's.

The terminal in the page is drawn on a canvas, so its text is read from xterm.js's own screen
buffer: the page's script, as served, is given one hook that names its terminal
(`window.lmcockpitTerminal`). Every wait is on the screen, the page or the processes, never a sleep.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import re
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from .helpers import WEBSOCKET, Served, free_port, http_get, token_cookie

pytestmark = pytest.mark.slow

CHROMIUM_MISSING = ("no `chromium` on PATH: the browser test needs the system's Chromium "
                    "(apt-get install chromium; .ci/run installs it)")
# textual-serve's front end keeps its xterm.js Terminal as `this.terminal`; the hook also names it.
TERMINAL_CREATED = "this.terminal=new "
SCREEN_TEXT = """() => {
  const t = window.lmcockpitTerminal;
  if (!t) return "";
  const b = t.buffer.active, rows = [];
  for (let y = 0; y < b.length; y++) rows.push(b.getLine(y).translateToString(true));
  return rows.join("\\n");
}"""
WAIT_MS = 60_000  # a cockpit's first screen takes seconds; on 2 busy cores, more


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail(CHROMIUM_MISSING)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium, headless=True)
        try:
            yield launched
        finally:
            launched.close()


def hooked_script(port: int, base: str, token: str | None) -> str:
    """textual-serve's script as the server serves it, with its terminal also named on `window`."""
    query = f"?token={token}" if token else ""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{base}static/js/textual.js{query}", timeout=30) as response:
        script = response.read().decode()
    assert script.count(TERMINAL_CREATED) == 1, f"textual-serve's front end no longer says {TERMINAL_CREATED!r}"
    return script.replace(TERMINAL_CREATED, "this.terminal=window.lmcockpitTerminal=new ")


@pytest.fixture
def open_cockpit(browser):
    """Open the cockpit at a port in a new tab, by the URL `served` printed (on TCP; none: the
    root, with no token), as `host`; returns the page once the launch screen is drawn."""
    contexts = []

    def open_(port: int, served: Served | None, host: str = "localhost"):
        base, token = (served.base, served.token) if served else ("/", None)
        contexts.append(browser.new_context(viewport={"width": 1280, "height": 800}))
        page = contexts[-1].new_page()
        page.set_default_timeout(WAIT_MS)
        script = hooked_script(port, base, token)
        page.route("**/static/js/textual.js", lambda route: route.fulfill(body=script, content_type="text/javascript"))
        page.route(re.compile(r"^https?://(?!localhost|127\.0\.0\.1)"), lambda route: route.abort())  # offline
        page.goto(f"http://{host}:{port}{base}" + (f"?token={token}" if token else ""), wait_until="domcontentloaded")
        assert page.url == f"http://{host}:{port}{base}"  # the token exchanged for a cookie, out of the address bar
        wait_for_screen(page, "presets · Enter launches")  # drawn through the WebSocket: the cookie went with it
        return page
    yield open_
    for context in contexts:
        context.close()


def screen(page) -> str:
    return page.evaluate(SCREEN_TEXT)


def wait_for_screen(page, text: str, gone: bool = False) -> None:
    try:
        page.wait_for_function(f"text => ({SCREEN_TEXT})().includes(text) === {'false' if gone else 'true'}", arg=text)
    except Exception as e:
        raise AssertionError(f"{text!r} {'still' if gone else 'never'} on screen:\n{screen(page)}") from e


def wait_until(condition, timeout: float, what: str) -> None:
    """Poll a process's state (nothing to wait on: it is another process's exit)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {timeout}s"
        time.sleep(0.1)


# ------------------------------------------------------------------------------ in a browser
def test_a_browser_opens_the_launch_screen_and_drives_it_with_keys(serve, open_cockpit):
    port = free_port()
    served = serve("--port", str(port))
    page = open_cockpit(port, served)
    text = screen(page)
    assert "settings · cpu" in text and re.search(r"│ debug\s", text), text  # the shipped presets, cpu selected
    assert len(served.cockpits()) == 1  # the tab's own cockpit process

    page.locator(".xterm-helper-textarea").focus()  # where xterm.js takes keys, as a click on the page gives it
    page.keyboard.press("ArrowDown")
    wait_for_screen(page, "settings · cpu", gone=True)  # the next preset's settings
    assert re.search(r"settings · (?!cpu)\S+", screen(page)), screen(page)
    page.keyboard.press("ArrowUp")
    wait_for_screen(page, "settings · cpu")
    page.keyboard.press("?")
    wait_for_screen(page, "Esc closes this help")
    page.keyboard.press("Escape")
    wait_for_screen(page, "Esc closes this help", gone=True)

    page.keyboard.press("q")  # quits this cockpit; the server goes on for the next tab
    page.get_by_text("Session ended.").wait_for(state="visible")
    wait_until(lambda: not served.cockpits(), 30, "the cockpit's exit")
    assert served.proc.poll() is None
    served.expect("a cockpit opened for 127.0.0.1")


def test_ctrl_c_ends_every_cockpit_and_the_server_cleanly(serve, open_cockpit):
    """Each cockpit quits with the server, which exits 130, interrupted, as every command does on
    Ctrl-C (it exited 0)."""
    port = free_port()
    served = serve("--port", str(port))
    page = open_cockpit(port, served)
    cockpits = served.cockpits()
    assert cockpits
    served.proc.send_signal(signal.SIGINT)
    assert served.wait(20) == 130  # each cockpit told to quit at once (aiohttp alone waits ~25 s for open tabs)
    page.get_by_text("Session ended.").wait_for(state="visible")
    assert not [p for p in cockpits if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert "Traceback" not in served.stdout + served.stderr, served.stdout + served.stderr
    assert served.stderr == ""


def test_a_killed_server_takes_its_cockpits_with_it(serve, open_cockpit):
    port = free_port()
    served = serve("--port", str(port))
    open_cockpit(port, served)
    cockpits = served.cockpits()
    assert cockpits
    served.proc.kill()  # no chance to tell them to quit: each quits on its own (tui/commands/serve/session.py)
    served.wait(30)
    wait_until(lambda: not [p for p in cockpits if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], 30,
               "the cockpit's exit after its server was killed")


@contextlib.contextmanager
def another_server() -> Iterator[tuple[int, list[tuple[str, dict[str, str]]]]]:
    """A plain HTTP server on another port of 127.0.0.1, as another account's could be: it answers
    every GET with a page and records what each one brought (path and headers). Yields its port
    and that record."""
    received: list[tuple[str, dict[str, str]]] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            received.append((self.path, dict(self.headers)))
            body = b"<!DOCTYPE html><title>another server</title><p>another server</p>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1], received
    finally:
        server.shutdown()
        server.server_close()


def test_the_token_reaches_no_server_on_another_port_of_the_host(serve, open_cockpit):
    port = free_port()
    served = serve("--port", str(port))
    page = open_cockpit(port, served, host="127.0.0.1")  # the URL as printed: a cookie for 127.0.0.1 now
    with another_server() as (other, received):
        # The same browser visits another server of this host; a browser gives it this host's
        # cookies whatever the port. It asks for the paths textual-serve serves at the root.
        visitor = page.context.new_page()
        for path in ("/", "/ws", "/static/js/textual.js", "/download/any"):
            assert visitor.goto(f"http://127.0.0.1:{other}{path}").ok
        got = list(received)
    assert {path for path, _ in got} >= {"/", "/ws", "/static/js/textual.js", "/download/any"}
    assert served.token not in repr(got), got
    assert served.base.strip("/") not in repr(got), got
    # All it was given, replayed against the cockpit as that server could: nothing opens.
    for path, headers in got:
        cookie = {"Cookie": headers["Cookie"]} if "Cookie" in headers else {}
        for target in ("/", "/ws", path):
            assert http_get(port, target, {**cookie, **WEBSOCKET})[0] in (403, 404), (target, cookie)
            assert http_get(port, target, cookie)[0] in (403, 404), (target, cookie)
    assert len(served.cockpits()) == 1  # the tab's own, and no other
    assert "settings · cpu" in screen(page)  # the cockpit's own tab is none the worse


# A Textual app that hands the browser a file, as App.deliver_text does through textual-serve.
DELIVERING_APP = """\
import io
from textual.app import App

class Delivering(App):
    def on_mount(self) -> None:
        self.deliver_text(io.StringIO("delivered under the cockpit's path"), save_filename="note.txt",
                          open_method="browser")

Delivering().run()
"""
# lmcockpit serve's web server running that app in place of the cockpit, on TCP under a path.
SERVER_OF = """\
import sys
from lmcockpit.tui.commands.serve.webserver import CockpitServer


command, port, token, base = sys.argv[1:]
CockpitServer(command, {"host": "127.0.0.1", "port": int(port)}, loopback=True, token=token, base=base,
              on_open=lambda: print("listening", flush=True)).serve()
"""


def test_a_download_is_asked_for_and_served_under_the_cockpits_path(serve, browser, tmp_path):
    app = tmp_path / "delivering.py"
    app.write_text(DELIVERING_APP)
    port, token, base = free_port(), "5" * 48, "/" + "a" * 32 + "/"
    serve(f"exec {sys.executable} {app}", str(port), token, base, program=[sys.executable, "-c", SERVER_OF],
          ready_line="listening")
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        page.route(re.compile(r"^https?://(?!127\.0\.0\.1)"), lambda route: route.abort())  # offline
        with context.expect_page(timeout=WAIT_MS) as opened:  # textual-serve's front end opens a tab for it
            page.goto(f"http://127.0.0.1:{port}{base}?token={token}")
        download = opened.value
        download.wait_for_load_state()
        assert download.url.startswith(f"http://127.0.0.1:{port}{base}download/"), download.url
        assert download.inner_text("body") == "delivered under the cockpit's path"
    finally:
        context.close()


@contextlib.contextmanager
def tunnel(path: Path) -> Iterator[int]:
    """What `ssh -N -L PORT:PATH` does at the laptop's end, here: each connection to a port on
    loopback relayed, both ways, to the Unix socket at `path`. Yields the port."""
    def pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)

    def accept() -> None:
        with contextlib.suppress(OSError):  # the listener shut down: the tunnel is closed
            while True:
                laptop, _ = listener.accept()
                server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                server.connect(str(path))
                relayed.extend((laptop, server))
                for ends in ((laptop, server), (server, laptop)):
                    threading.Thread(target=pump, args=ends, daemon=True).start()

    listener = socket.create_server(("127.0.0.1", 0))
    relayed: list[socket.socket] = []
    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        # Closed as ssh closes a tunnel: its connections too. Left open, the server's stop would
        # wait out aiohttp's grace for the page's WebSocket (10 s).
        for sock in [listener, *relayed]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes accept() and the pumps, which close() alone would not
            sock.close()


def test_a_browser_through_a_tunnel_to_the_socket_opens_the_launch_screen(serve, runtime, open_cockpit):
    served = serve(env={"XDG_RUNTIME_DIR": str(runtime)})
    with tunnel(runtime / "lmcockpit" / "serve.sock") as port:
        page = open_cockpit(port, None)  # no token, no path: whoever can open the socket is its owner
        assert "settings · cpu" in screen(page)
        assert len(served.cockpits()) == 1
        served.expect("a cockpit opened for a client of the socket")


# ------------------------------------------------------------------------ what it listens on
def test_by_default_it_opens_no_port_only_a_socket_of_the_users_own(serve, runtime):
    served = serve(env={"XDG_RUNTIME_DIR": str(runtime)})
    path = runtime / "lmcockpit" / "serve.sock"
    served.expect(f"lmcockpit serve: the cockpit on {path} (Ctrl-C")
    served.expect(f"from a laptop:   ssh -N -L 8000:{path} ")  # OpenSSH's forwarding of a port to a socket
    served.expect("then open        http://localhost:8000\n")
    assert not [c for c in psutil.net_connections(kind="inet") if c.pid == served.proc.pid]
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_ISSOCK(path.lstat().st_mode) and stat.S_IMODE(path.lstat().st_mode) == 0o600
    served.proc.send_signal(signal.SIGINT)
    assert served.wait(30) == 130  # interrupted, as every command is by Ctrl-C
    assert not path.exists()  # gone with the server
    assert served.stderr == ""


@pytest.fixture
def tmpdir_taken():
    """A $TMPDIR of the test's own (short: a socket's path holds about 107 bytes) where the name
    runtime_dir shares, lmcockpit-UID, is taken by a file: there it falls back to a fresh mkdtemp folder."""
    folder = Path(tempfile.mkdtemp(prefix="lmcockpit-tmp-"))
    (folder / f"lmcockpit-{os.geteuid()}").write_text("taken")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_a_fallback_socket_folder_goes_with_the_server(serve, tmpdir_taken, stop):
    served = serve(env={"XDG_RUNTIME_DIR": "", "TMPDIR": str(tmpdir_taken)})
    [folder] = [path for path in tmpdir_taken.iterdir() if path.is_dir()]
    assert folder.name.startswith(f"lmcockpit-{os.geteuid()}-")
    served.expect(f"the cockpit on {folder / 'serve.sock'} (Ctrl-C")
    assert http_get(str(folder / "serve.sock"))[0] == 200
    served.proc.send_signal(stop)
    assert served.wait(30) == 130  # interrupted: SIGTERM as Ctrl-C, as for every command
    assert list(tmpdir_taken.iterdir()) == [tmpdir_taken / f"lmcockpit-{os.geteuid()}"]  # the folder gone, too
    assert served.stderr == ""


def test_a_fallback_socket_folder_goes_when_its_socket_cannot_be_made(serve, tmpdir_taken):
    deep = tmpdir_taken / ("d" * 120)  # a socket's path in there would be too long
    deep.mkdir()
    (deep / f"lmcockpit-{os.geteuid()}").write_text("taken")
    served = serve(env={"XDG_RUNTIME_DIR": "", "TMPDIR": str(deep)}, ready=False)
    assert served.wait(60) == 2
    assert served.stderr.startswith(f"error: cannot listen on {deep}/lmcockpit-{os.geteuid()}-"), served.stderr
    assert list(deep.iterdir()) == [deep / f"lmcockpit-{os.geteuid()}"]


def test_a_live_socket_is_refused_a_dead_ones_replaced_and_a_file_left_alone(serve, runtime):
    path = runtime / "serve.sock"
    first = serve("--socket", str(path))
    second = serve("--socket", str(path), ready=False)
    assert second.wait(60) == 2
    assert second.stderr == (f"error: {path}: a server answers there already (another `lmcockpit serve`?): open "
                             f"that one, stop it first, or give this one --socket PATH\n")
    assert http_get(str(path))[0] == 200  # the first serves on, its socket untouched
    first.proc.kill()  # no chance to remove its socket file
    first.wait(30)
    assert path.exists()
    serve("--socket", str(path))  # a file nothing answers on: replaced
    assert http_get(str(path))[0] == 200

    planted = runtime / "notes.txt"
    planted.write_text("mine")
    taken = serve("--socket", str(planted), ready=False)
    assert taken.wait(60) == 2
    assert taken.stderr == f"error: {planted}: not a socket; give --socket a path of its own\n"
    assert planted.read_text() == "mine"


def test_port_serves_on_tcp_on_loopback_only_with_a_token(serve):
    port = free_port()
    served = serve("--port", str(port))
    listening = {c.laddr.ip for c in psutil.net_connections(kind="inet")
                 if c.pid == served.proc.pid and c.status == psutil.CONN_LISTEN}
    assert listening == {"127.0.0.1"}
    assert re.fullmatch(r"/[0-9a-f]{32}/", served.base)  # 128 random bits: no other server is asked for it
    served.expect(f"lmcockpit serve: the cockpit on http://127.0.0.1:{port}{served.base}?token={served.token} (Ctrl-C")
    served.expect(f"ssh -N -L {port}:127.0.0.1:{port} ")  # the banner's tunnel line, then the URL
    served.expect(f"then open        http://localhost:{port}{served.base}?token={served.token}\n")
    outward = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
               if a.family == socket.AF_INET and not a.address.startswith("127.")]
    for address in outward:  # where the machine has an outward address, nothing answers there
        with pytest.raises(ConnectionRefusedError), socket.create_connection((address, port), timeout=10):
            pass
    assert served.stderr == ""  # no warning on loopback


def test_another_host_is_served_with_a_warning_that_plain_http_shows_the_token(serve):
    port = free_port()
    served = serve("--host", "0.0.0.0", "--port", str(port))
    served.expect("drive the cockpit", stderr=True)
    assert served.stderr.startswith("warning: listening on 0.0.0.0 over plain HTTP: anyone who can watch the "
                                    "network between a browser and this machine can read the token")
    served.expect(f":{port}{served.base}?token={served.token} (Ctrl-C")
    served.proc.send_signal(signal.SIGINT)
    assert served.wait(30) == 130


def test_a_taken_port_is_named_with_what_to_do(serve):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        served = serve("--port", str(port), ready=False)
        assert served.wait(60) == 2
    assert served.stderr == (f"error: port {port} is taken on 127.0.0.1 (another `lmcockpit serve`, or another "
                             f"server): pick a free one with --port N\n")
    assert served.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["--port", "0"], "--port 0: expected a port number, 1 to 65535"),
    (["--host", "no-such-host.invalid"], "--host no-such-host.invalid: not an address of this machine"),
    (["--socket", "/no/such/folder/serve.sock"], "cannot listen on /no/such/folder/serve.sock: No such file or "
                                                 "directory"),
    (["--socket", "s.sock", "--port", "8000"], "--socket serves on a Unix socket, --port and --host on TCP: give "
                                               "one or the other"),
])
def test_a_port_host_or_socket_it_cannot_listen_on_is_a_usage_error(serve, args, message):
    served = serve(*args, ready=False)
    assert served.wait(60) == 2
    assert served.stderr.startswith(f"error: {message}") and "Traceback" not in served.stderr


def test_the_page_follows_the_browsers_address_and_other_sites_are_refused(serve):
    port = free_port()
    served = serve("--port", str(port))
    base = served.base
    # Through `ssh -L 9000:127.0.0.1:PORT` the browser asks for localhost:9000: the page's own URLs say so.
    cookie = token_cookie(port, served, host="localhost:9000")
    status, headers, page = http_get(port, base, {"Host": "localhost:9000", "Cookie": cookie})
    assert status == 200
    assert headers["Referrer-Policy"] == "same-origin"  # its address, base and all, goes to no other origin
    assert (f'data-session-websocket-url="ws://localhost:9000{base}ws"' in page
            and f"http://localhost:9000{base}static/" in page)
    # Another site's page opening the WebSocket, or reaching loopback through its own name: the
    # token does not make up for either.
    cookie = token_cookie(port, served)
    status, _, why = http_get(port, f"{base}ws", {"Host": f"localhost:{port}", "Origin": "http://evil.example",
                                                  "Cookie": cookie, **WEBSOCKET})
    assert (status, why) == (403, "refused: a WebSocket from http://evil.example; only this server's own page "
                                  "may open one")
    assert http_get(port, f"{base}ws", {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}",
                                        "Cookie": cookie, **WEBSOCKET})[0] == 403
    assert http_get(port, f"{base}?token={served.token}", {"Host": f"evil.example:{port}"})[0] == 403
    assert not served.cockpits()  # none of them started one

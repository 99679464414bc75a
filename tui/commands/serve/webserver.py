"""The web server behind `lmcockpit serve`: textual-serve's, fitted to a cockpit behind an SSH tunnel.

textual-serve's web server, fitted to a cockpit reached through an SSH tunnel: on a Unix socket
(the command's default), or on a TCP port with a token. Kept apart from the command because aiohttp takes
a quarter of a second to import: `lmcockpit serve --help` and tab completion do without it.

What it changes in textual-serve's `Server`:
- it listens on what the command gives it: a bound Unix socket, or a host and port;
- on TCP it serves under a random path of its own, `base` (`/PREFIX/`), and nowhere else: a
  browser sends a host's cookies to every port of that host, so the token's cookie is scoped to
  `base` (its Path), a path no other server on the machine is ever asked for, and the page's
  Referer goes to no other origin (`referrer_policy`);
- every request passes `gate` (an aiohttp middleware, so no route of textual-serve's is left out,
  its downloads included): on TCP it must be under `base` and carry the token, as `?token=` or as
  the cookie that the first page's `?token=` is exchanged for (`token_refusal`); a WebSocket
  opened by another site's page, or (on loopback and on the socket) a request through a name that
  is not a loopback name, is refused (`refusal`);
- its front end's script asks for a download at the host's root; served here, it asks under the
  page's own path (`adapted_script`);
- the page's URLs follow the address the browser used: textual-serve builds them from the bound
  host and port, which a browser at the far end of `ssh -L 9000:...`, or one reaching
  `--host 0.0.0.0` by the machine's name, cannot open;
- stopping the server ends every browser session at once, each cockpit told to quit and waited
  for; aiohttp alone waits for open WebSockets to close by themselves (25 s and more);
- a short line per session instead of aiohttp's access log, and ours (`on_open`), once it
  listens, instead of its logo.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import signal
from collections.abc import Callable
from urllib.parse import urlsplit

from aiohttp import web
from textual_serve.server import Server

# The names a browser on this machine, or at the laptop end of `ssh -L`, reaches a loopback port by.
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def refusal(request: web.Request, loopback: bool, websocket: str = "/ws") -> str | None:
    """Why a request may not reach the cockpit, or None. A WebSocket is not bound by the browser's
    same-origin rule: any page the user visits could open ws://localhost:PORT/ws while a tunnel is
    up. So a socket is taken only from this server's own page (its Origin is the Host it asks),
    and on loopback the Host must be a loopback name, or a site could point its own name at
    127.0.0.1 and be its own origin (DNS rebinding)."""
    name = urlsplit(f"//{request.host}").hostname or ""
    if loopback and name not in LOOPBACK_NAMES:
        return f"refused: Host {request.host!r} is not a name of this loopback address"
    origin = request.headers.get("Origin")
    if request.path == websocket and origin is not None and urlsplit(origin).netloc != request.host:
        return f"refused: a WebSocket from {origin}; only this server's own page may open one"
    return None


def cookie_name(request: web.Request) -> str:
    """Named for the address the browser used, port and all, so that each serve's cookie is told
    apart: a browser keeps one cookie jar per host name whatever the port (the cookie's Path,
    `base`, is what keeps it from the servers on the other ports)."""
    return "lmcockpit-token-" + re.sub(r"[^A-Za-z0-9]", "-", request.host)


def outside(path: str, base: str) -> bool:
    """Whether `path` is not under `base`. On TCP `base` is as secret as the token, so it is
    compared in constant time too (its length is no secret)."""
    return not hmac.compare_digest(path[:len(base)].encode(errors="surrogatepass"), base.encode())


OUTSIDE = "no such page: open the address `lmcockpit serve` printed, all of it"

# Where textual-serve's front end (1.1) builds a download's URL: the host's root, whatever the page's path.
DOWNLOAD_AT_ROOT = "${window.location.origin}/download/"
DOWNLOAD_UNDER_PAGE = '${new URL("download/", window.location.href).href}'


def adapted_script(script: str) -> str:
    """textual-serve's front end with downloads asked for under the page's own path (`base`),
    the only place this server answers, and the only one its token's cookie goes to."""
    return script.replace(DOWNLOAD_AT_ROOT, DOWNLOAD_UNDER_PAGE)


def token_refusal(request: web.Request, token: str) -> str | None:
    """Why a request on TCP may not reach the cockpit for want of the token, or None. Compared in
    constant time: how long a wrong guess takes to refuse says nothing of how close it came."""
    given = request.query.get("token", request.cookies.get(cookie_name(request)))
    if given is None:
        return "refused: no token; open the address `lmcockpit serve` printed, with its ?token="
    # surrogatepass: a header's bytes that are not UTF-8 come as lone surrogates, a wrong token like any other
    if not hmac.compare_digest(given.encode(errors="surrogatepass"), token.encode()):
        return "refused: a wrong token"
    return None


class CockpitServer(Server):
    def __init__(self, command: str, listen: dict, loopback: bool, token: str | None, on_open: Callable[[], None],
                 base: str = "/"):
        super().__init__(command, title="lmcockpit")  # its host and port: only for public_url, set per request
        self.listen = listen  # run_app's: {"sock": a bound Unix socket} or {"host": ..., "port": ...}
        self.loopback = loopback
        self.token = token  # on TCP only: whoever can open the socket is this user already
        self.base = base  # the path everything is served under: "/PREFIX/" on TCP
        self.script = adapted_script((self.statics_path / "js" / "textual.js").read_text())
        self.on_open = on_open  # says where to point a browser, once it can
        self.sessions: set[asyncio.Task] = set()  # one per open browser tab: its WebSocket's handler

    def initialize_logging(self) -> None:
        super().initialize_logging()
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # each request, in four wrapped lines

    def serve(self, debug: bool = False) -> None:
        """textual-serve's serve(), with `on_open` called once it listens: aiohttp's run_app calls
        `print` when its sites have started (textual-serve silences it, and prints its logo from
        on_startup, before the port is bound: a port that is taken would follow it)."""
        self.debug = debug
        self.initialize_logging()
        loop = asyncio.new_event_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_exit)
        web.run_app(self._make_app(), **self.listen, handle_signals=False, loop=loop, print=lambda _: self.on_open())

    # textual-serve's Server._make_app is private, and overridden all the same: the server has no
    # public hook to add middleware or mount its routes under a base path.
    async def _make_app(self) -> web.Application:
        app = await super()._make_app()
        if self.base != "/":  # textual-serve's routes, and the URLs its page is given, all under base
            cockpit, app = app, web.Application()
            app.add_subapp(self.base, cockpit)
        app.middlewares.extend([self.gate, self.serve_script])
        app.on_response_prepare.append(referrer_policy)
        return app

    @web.middleware
    async def gate(self, request: web.Request, handler) -> web.StreamResponse:
        if outside(request.path, self.base):  # before the token: what is there is no one's business
            raise web.HTTPNotFound(text=OUTSIDE)
        websocket = self.base + "ws"
        why = refusal(request, self.loopback, websocket) or (self.token and token_refusal(request, self.token))
        if why:
            if request.path == websocket:
                self.console.print(f"{why} (from {client(request)})", highlight=False, soft_wrap=True)
            raise web.HTTPForbidden(text=why)
        if self.token and request.path == self.base and "token" in request.query:
            # The token leaves the address bar and the history for a cookie that the page's scripts
            # cannot read (HttpOnly), that no request started by another site's page carries
            # (SameSite=Strict, though a page on another port of this host is the same site), and
            # that goes to no path but base, which no other server of this host is ever asked for;
            # the page's own requests and its WebSocket carry it.
            query = request.query.copy()
            query.popall("token")
            response = web.Response(status=303, headers={"Location": str(request.rel_url.with_query(query))})
            response.set_cookie(cookie_name(request), self.token, path=self.base, httponly=True, samesite="Strict")
            return response
        return await handler(request)

    @web.middleware
    async def serve_script(self, request: web.Request, handler) -> web.StreamResponse:
        # A middleware, not a route: an aiohttp before 3.10 matches routes in order, textual-serve's
        # static folder first.
        if request.path == self.base + "static/js/textual.js":
            return web.Response(text=self.script, content_type="text/javascript")
        return await handler(request)

    async def on_startup(self, app: web.Application) -> None:
        pass  # textual-serve's logo: on_open speaks once the server listens

    async def on_shutdown(self, app: web.Application) -> None:
        # A cancelled session tells its cockpit to quit and waits for it to end (textual-serve's
        # handler does that however it ends); a cockpit with a run waits for its checkpoint.
        for task in self.sessions:
            task.cancel()

    async def handle_index(self, request: web.Request) -> web.StreamResponse:
        # No other request runs between this line and the handler's reading of public_url: it
        # reads it before its first await.
        self.public_url = f"{request.scheme}://{request.host}"
        return await super().handle_index(request)

    async def handle_websocket(self, request: web.Request) -> web.StreamResponse:
        task = asyncio.current_task()
        self.sessions.add(task)
        self.console.print(f"a cockpit opened for {client(request)}", highlight=False)
        try:
            return await super().handle_websocket(request)
        finally:
            self.sessions.discard(task)
            self.console.print(f"a cockpit closed for {client(request)}", highlight=False)


async def referrer_policy(request: web.Request, response: web.StreamResponse) -> None:
    # The page's address holds base: a link the cockpit opens, or a font it loads, tells no other
    # origin where it came from (browsers before 2020 sent the whole URL by default).
    response.headers["Referrer-Policy"] = "same-origin"


def client(request: web.Request) -> str:
    """Who asked, for the log: an address on TCP; on the socket the peer has none (a tunnel's sshd)."""
    return request.remote or "a client of the socket"

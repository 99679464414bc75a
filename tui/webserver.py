"""textual-serve's web server, fitted to a cockpit reached through an SSH tunnel. Kept apart from
serve.py because aiohttp takes a quarter of a second to import: `lmcockpit serve --help` and tab
completion do without it.

What it changes in textual-serve's `Server`:
- the page's URLs follow the address the browser used: textual-serve builds them from the bound
  host and port, which a browser at the far end of `ssh -L 9000:127.0.0.1:8000`, or one reaching
  `--host 0.0.0.0` by the machine's name, cannot open;
- a WebSocket opened by another site's page, or (on loopback) through a name that is not a
  loopback name, is refused (`refusal`);
- stopping the server ends every browser session at once, each cockpit told to quit and waited
  for; aiohttp alone waits for open WebSockets to close by themselves (25 s and more);
- a short line per session instead of aiohttp's access log, and ours (`on_open`), once the port
  is open, instead of its logo.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from urllib.parse import urlsplit

from aiohttp import web
from textual_serve.server import Server

# The names a browser on this machine, or at the laptop end of `ssh -L`, reaches a loopback port by.
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def refusal(request: web.Request, loopback: bool) -> str | None:
    """Why a request may not reach the cockpit, or None. A WebSocket is not bound by the browser's
    same-origin rule: any page the user visits could open ws://localhost:PORT/ws while a tunnel is
    up. So a socket is taken only from this server's own page (its Origin is the Host it asks),
    and on loopback the Host must be a loopback name, or a site could point its own name at
    127.0.0.1 and be its own origin (DNS rebinding)."""
    name = urlsplit(f"//{request.host}").hostname or ""
    if loopback and name not in LOOPBACK_NAMES:
        return f"refused: Host {request.host!r} is not a name of this loopback address"
    origin = request.headers.get("Origin")
    if request.path == "/ws" and origin is not None and urlsplit(origin).netloc != request.host:
        return f"refused: a WebSocket from {origin}; only this server's own page may open one"
    return None


class CockpitServer(Server):
    def __init__(self, command: str, host: str, port: int, loopback: bool, on_open: Callable[[], None]):
        super().__init__(command, host=host, port=port, title="lmcockpit")
        self.loopback = loopback
        self.on_open = on_open  # says where to point a browser, once it can
        self.sessions: set[asyncio.Task] = set()  # one per open browser tab: its WebSocket's handler

    def initialize_logging(self) -> None:
        super().initialize_logging()
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # each request, in four wrapped lines

    def serve(self, debug: bool = False) -> None:
        """textual-serve's serve(), with `on_open` called once the port is open: aiohttp's run_app
        calls `print` when its sites have started (textual-serve silences it, and prints its logo
        from on_startup, before the port is bound: a port that is taken would follow it)."""
        self.debug = debug
        self.initialize_logging()
        loop = asyncio.new_event_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_exit)
        web.run_app(self._make_app(), host=self.host, port=self.port, handle_signals=False, loop=loop,
                    print=lambda _: self.on_open())

    async def on_startup(self, app: web.Application) -> None:
        pass  # textual-serve's logo: on_open speaks once the port is open

    async def on_shutdown(self, app: web.Application) -> None:
        # A cancelled session tells its cockpit to quit and waits for it to end (textual-serve's
        # handler does that however it ends); a cockpit with a run waits for its checkpoint.
        for task in self.sessions:
            task.cancel()

    async def handle_index(self, request: web.Request) -> web.StreamResponse:
        if why := refusal(request, self.loopback):
            raise web.HTTPForbidden(text=why)
        # No other request runs between this line and the handler's reading of public_url: it
        # reads it before its first await.
        self.public_url = f"{request.scheme}://{request.host}"
        return await super().handle_index(request)

    async def handle_websocket(self, request: web.Request) -> web.StreamResponse:
        if why := refusal(request, self.loopback):
            self.console.print(f"{why} (from {request.remote})", highlight=False, soft_wrap=True)
            raise web.HTTPForbidden(text=why)
        task = asyncio.current_task()
        self.sessions.add(task)
        self.console.print(f"a cockpit opened for {request.remote}", highlight=False)
        try:
            return await super().handle_websocket(request)
        finally:
            self.sessions.discard(task)
            self.console.print(f"a cockpit closed for {request.remote}", highlight=False)

"""Word of a run's events sent where its owner is (issue #42): a webhook, an ntfy topic, Apprise URLs.

`Notifier` is what the process that owns the engine hands each event to. An event is a JSON object,
`{"event": "finished" | "failed" | "nan" | "spike" | "rollback" | "stalled" | "target", "run": NAME,
"step": N, ...}`. Sending must never be in training's way: `send` only puts the event on each
target's bounded queue, and each target has a daemon thread of its own that delivers them, so a
target that refuses, hangs or answers a byte at a time costs its own thread its time and neither
training nor another target any: a webhook stuck in an answer never keeps "finished" from ntfy.

Per target:
- webhook: an HTTP POST of the event's JSON (Content-Type application/json).
- ntfy: an HTTP POST of one line of text to the topic URL, the title and tags in headers, as ntfy's
  publishing API takes them (a "failed" or "stalled" event at priority high).
- apprise: each URL through the Apprise library (lmcockpit[notify]), imported only when one is given:
  a maintained library that speaks to a hundred services, rather than a client of ours for each.
- terminal: not sent from here; every attached cockpit shows it, with `terminal_escape`'s escapes.

Delivery: a connection error, a timeout, HTTP 5xx, 408 or 429 (and any Apprise failure, which does
not say which it was) is tried again after 1, 2, 4... seconds (`backoff`, doubled, at most
`max_backoff`), `tries` times in all; another 4xx is not tried again: the target said no.
`timeout` bounds a whole HTTP request, not each read of it: an answer that trickles in never
outlasts it. Of the answer, the status is what counts; at most READ_BYTES of its body are read (a
target that answers gigabytes costs no memory). A redirect is not followed, to the same host or
another: the request would carry the URL's credentials (and the event) somewhere the user never
named. It is refused once, in one log line that names where it pointed (scheme, host, port).

Rate limit: at most `per_minute` messages (10 by default) per target in any 60 seconds. Events
beyond it are dropped, not coalesced, and counted: the next message that target gets carries the
count (`"dropped": N` in the webhook's JSON, "(N earlier events not sent)" in a text), as do the
events the full queue dropped and those that failed every try. "finished", "failed" and "target"
come at most once a run and are the ones worth being woken for: the limit never drops them.

Secrets: a URL may be written `env:NAME`, read from the environment when the Notifier is built. A
URL's path, query and user part may hold a token, so no log line names more than the target's kind
and host (an Apprise URL only its scheme: many services put their token in the host's place), and
an error's text has those parts cut out. user:password@ in a webhook or ntfy URL is sent as HTTP
basic authentication, which urllib would not do by itself.

Before a run (`check`, before its folder is made): every target built as the run will build it, and
each webhook and ntfy host (or the proxy its posts would go through) reachable, else one error that
names the key and the URL's scheme, host and port only.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

from ..config import ConfigError, NotifyConfig
from ..run.target import run_time

if TYPE_CHECKING:
    from ..run.state import RunState

EVENTS = ("finished", "failed", "nan", "spike", "rollback", "stalled", "target")
NEVER_LIMITED = frozenset({"finished", "failed", "target"})  # once a run at most: see the docstring
WINDOW = 60.0  # seconds over which per_minute counts
ENV_NAME = re.compile(r"env:([A-Za-z_][A-Za-z0-9_]*)")
NEEDS_APPRISE = "notify.apprise: needs the apprise package: pip install 'lmcockpit[notify]'"

# What a text says of each event (ntfy, Apprise), with ntfy's tags (emoji short codes).
SAID = {"finished": "finished", "failed": "failed", "nan": "NaN loss", "spike": "loss spike",
        "rollback": "rolled back to a checkpoint", "stalled": "no step for a while",
        "target": "reached the target loss"}
TAGS = {"finished": "white_check_mark", "failed": "x", "nan": "warning", "spike": "chart_with_upwards_trend",
        "rollback": "rewind", "stalled": "hourglass", "target": "dart"}
URGENT = frozenset({"failed", "stalled"})  # a run that no longer trains: worth ntfy's "high"
TEXT_CHARS = 300  # of a text message: an error's whole traceback belongs in train.log, not on a phone
READ_BYTES = 4096  # of an answer's body: its status is all a sender needs, and a target's body may be endless
REDIRECTS = frozenset({301, 302, 303, 307, 308})


ESC = "\x1b"


def terminal_escape(title: str, body: str, tmux: bool = False) -> str:
    """The terminal's own notification: OSC 777 (foot, Ghostty, WezTerm, VTE terminals such as
    GNOME Terminal), OSC 9 (iTerm2, Windows Terminal, kitty, Ghostty, WezTerm) and a bell, which every
    terminal understands in some way. A terminal ignores an OSC it does not know. Control characters
    and ';' are taken out of `title` and `body`: either would end the sequence early or start one of
    the run's choosing.

    `tmux`: written inside tmux (`in_tmux`), whose own parser swallows an OSC it does not know. An
    OSC reaches the outer terminal only wrapped in tmux's passthrough DCS (`ESC P tmux;`, each ESC
    inside doubled), and only where the user allows it (`set -g allow-passthrough on`, tmux 3.3 or
    later); the bell gets through always, and tmux marks the window that rang it."""
    title, body = _clean(title), _clean(body)
    oscs = [f"\x1b]777;notify;{title};{body}\x07", f"\x1b]9;{title}: {body}\x07"]
    if tmux:
        oscs = [f"\x1bPtmux;{osc.replace(ESC, ESC + ESC)}\x1b\\" for osc in oscs]
    return "".join(oscs) + "\x07"


def in_tmux() -> bool:
    """Whether this process writes to a tmux pane: tmux sets TMUX in every pane it starts."""
    return bool(os.environ.get("TMUX"))


def _clean(text: str) -> str:
    return "".join(c for c in str(text) if c != ";" and c.isprintable())


def describe(event: Mapping[str, Any]) -> tuple[str, str]:
    """(title, body) of an event as a person reads it: "RUN: finished", "finished at step 400, loss 2.5"."""
    kind = str(event.get("event", "event"))
    title = f"{event['run']}: {kind}" if event.get("run") else kind
    body = SAID.get(kind, kind)
    if "step" in event:
        body += f" at step {event['step']}"
    extra = [f"{k} {_short(v)}" for k, v in event.items() if k not in ("event", "run", "step", "dropped")]
    if extra:
        body += ", " + ", ".join(extra)
    if event.get("dropped"):
        body += f" ({event['dropped']} earlier events not sent)"
    body = " ".join(body.split())  # one line: an error's message may hold several
    return title, body if len(body) <= TEXT_CHARS else body[:TEXT_CHARS - 1] + "…"


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class _Failure(Exception):
    """One try that did not deliver: `why` is safe to log (no URL in it), `retry` whether to try again."""

    def __init__(self, why: str, retry: bool):
        super().__init__(why)
        self.why, self.retry = why, retry


@dataclass
class _Target:
    label: str  # what a log line names: the kind and the host, never the URL
    deliver: Callable[[dict[str, Any]], None]  # raises _Failure
    cut: Callable[[], None] = lambda: None  # ends the request under way, if it can be ended
    queue: deque[dict[str, Any]] = field(default_factory=deque)  # this target's alone: see the docstring
    thread: threading.Thread | None = None
    sent_at: deque[float] = field(default_factory=deque)  # within the last WINDOW seconds
    unsent: int = 0  # events this target has not had since its last delivery (the Notifier's lock)
    limited: bool = False  # said in the log since its last delivery that the rate limit drops events


class _Request:
    """The sockets of one HTTP request, shut down when its deadline passes or close gives up on it:
    a blocked read then returns at once, where a socket timeout, reset by each byte, never fires.
    Once the request is done its sockets are forgotten: only a request under way is ever cut."""

    def __init__(self):
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.over = False  # cut or done: a socket connected from now on is shut at once
        self.expired = False  # cut, rather than finished

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self.over:
                _shut(sock)

    def cut(self) -> None:
        with self._lock:
            if not self.over:
                self.over = self.expired = True
                for sock in self._sockets:
                    _shut(sock)

    def done(self) -> None:
        with self._lock:
            self.over = True
            self._sockets.clear()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed, or never connected
        pass


class _Watched:
    """One target's connections, each handed to the request under way (`current`) as it connects."""

    def __init__(self):
        self.current: _Request | None = None
        self._classes: dict[type, type] = {}

    def connection(self, base: type) -> type:
        if base not in self._classes:
            watched = self

            class Connection(base):
                def connect(self):
                    super().connect()
                    if watched.current is not None:
                        watched.current.add(self.sock)  # the TLS socket itself, for https
            self._classes[base] = Connection
        return self._classes[base]

    def cut(self) -> None:
        if (request := self.current) is not None:
            request.cut()


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A 3xx is the target's answer, raised as its HTTPError: never followed (see the docstring)."""

    def http_error_302(self, req, fp, code, msg, headers):
        return None

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def _opener(watched: _Watched) -> urllib.request.OpenerDirector:
    """urllib's own (proxies from the environment included), its connections watched, no redirects."""
    class Watching:
        def do_open(self, http_class, req, **kwargs):
            return super().do_open(watched.connection(http_class), req, **kwargs)

    class HTTP(Watching, urllib.request.HTTPHandler):
        pass

    class HTTPS(Watching, urllib.request.HTTPSHandler):
        pass
    return urllib.request.build_opener(_NoRedirects, HTTP, HTTPS)


class Notifier:
    """Sends a run's events to the targets of its [notify] section, each from a daemon thread of its own.

    `send` never blocks and never raises; `close` flushes with a bounded wait. `log` gets a line for
    each delivery given up on and the like, never a URL. The other parameters are for tests and for
    the unusual server: `backoff` the first wait before a retry, `queue_size` the events each target
    holds at most (a full queue drops its oldest), `timeout` each HTTP request's, all of it."""

    terminal_escape = staticmethod(terminal_escape)

    def __init__(self, config: NotifyConfig, run: str, *, log: Callable[[str], None] = lambda line: None,
                 environ: Mapping[str, str] | None = None, tries: int = 4, backoff: float = 1.0,
                 max_backoff: float = 30.0, per_minute: int = 10, queue_size: int = 100, timeout: float = 10.0):
        self.run, self._log = run, log
        self.tries, self.backoff, self.max_backoff = max(1, tries), backoff, max_backoff
        self.per_minute, self.timeout = per_minute, timeout
        # Events given up on before a target was tried with them: one that could not be read, one
        # sent after close, and the oldest of a target's full queue (once for each such target).
        self.dropped = 0
        environ = os.environ if environ is None else environ
        self._targets: list[_Target] = []
        if config.webhook:
            url = _http_url("notify.webhook", _resolve("notify.webhook", config.webhook, environ))
            self._targets.append(self._http(f"webhook {urlsplit(url).hostname}", url, self._webhook))
        if config.ntfy:
            url = _http_url("notify.ntfy", _resolve("notify.ntfy", config.ntfy, environ))
            self._targets.append(self._http(f"ntfy {urlsplit(url).hostname}", url, self._ntfy))
        if config.apprise:
            try:
                import apprise
            except ImportError:
                raise ConfigError(NEEDS_APPRISE) from None
            for i, entry in enumerate(config.apprise):
                key = f"notify.apprise[{i}]"
                self._targets.append(self._apprise(apprise, key, _resolve(key, entry, environ),
                                                   f"apprise[{i}]" if len(config.apprise) > 1 else "apprise"))
        self._queue_size = max(1, queue_size)
        self._cond = threading.Condition()  # guards every target's queue and unsent count
        self._closed = False
        self._abandon = threading.Event()  # close's wait is over: deliver nothing more
        for target in self._targets:  # the terminal alone needs no thread
            target.thread = threading.Thread(target=self._work, args=(target,), daemon=True,
                                             name=f"lmcockpit-notify {target.label}")
            target.thread.start()

    @property
    def targets(self) -> list[str]:
        """What is sent to, as a log line would name each: "webhook hooks.example.com"."""
        return [t.label for t in self._targets]

    def send(self, event: dict[str, Any]) -> None:
        """Queue an event for every target; returns at once. The run's name is filled in if the
        event has none. Values that JSON cannot hold are sent as text (NaN as "nan")."""
        try:
            item = _plain(event)
            if not isinstance(item, dict):
                raise TypeError(f"an event is a JSON object, not {type(event).__name__}")
            item.setdefault("run", self.run)
        # A malformed event must not end the run that sent it: counted, and the owner's log says so.
        except Exception as e:  # noqa: BLE001 -- send never raises, whatever it is given
            with self._cond:
                self.dropped += 1
                for target in self._targets:  # one each target never had: its next message counts it
                    target.unsent += 1
            self._say(f"notify: an event could not be read and was dropped ({type(e).__name__})")
            return
        if not self._targets:
            return
        with self._cond:
            if self._closed:
                self.dropped += 1
                return
            for target in self._targets:
                if len(target.queue) >= self._queue_size:
                    target.queue.popleft()
                    target.unsent += 1
                    self.dropped += 1
                target.queue.append(item)
            self._cond.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        """Deliver what is queued, waiting at most `timeout` seconds in all, then stop. What is still
        undelivered then is given up on (and said in the log), and a request still under way is cut
        short: its thread is gone soon after, and the caller never waits for it."""
        if not self._targets:
            return
        with self._cond:
            if self._closed:  # a second close has nothing left to wait for
                return
            self._closed = True
            self._cond.notify_all()
        deadline = time.monotonic() + max(0.0, timeout)
        for target in self._targets:
            target.thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [target for target in self._targets if target.thread.is_alive()]
        if stuck:
            self._abandon.set()
            with self._cond:
                left = sum(len(target.queue) for target in stuck)
            for target in stuck:
                target.cut()
            names = ", ".join(target.label for target in stuck)
            self._say(f"notify: closed after {timeout:g} s with {'a target' if len(stuck) == 1 else 'targets'} "
                      f"still being tried ({names}) and {left} more event(s) queued: not delivered")

    # ---------------------------------------------------------------- each target's thread
    def _work(self, target: _Target) -> None:
        while True:
            with self._cond:
                while not target.queue and not self._closed:
                    self._cond.wait()
                if not target.queue or self._abandon.is_set():
                    return
                event = target.queue.popleft()
            self._to(target, event)

    def _to(self, target: _Target, event: dict[str, Any]) -> None:
        now = time.monotonic()
        while target.sent_at and now - target.sent_at[0] >= WINDOW:
            target.sent_at.popleft()
        if len(target.sent_at) >= self.per_minute and event.get("event") not in NEVER_LIMITED:
            with self._cond:
                target.unsent += 1
            if not target.limited:
                target.limited = True
                self._say(f"notify: {target.label}: more than {self.per_minute} events a minute; "
                          "dropping them, the next message says how many")
            return
        target.sent_at.append(now)
        with self._cond:
            carried = target.unsent  # send may add to it meanwhile: only these are said to be counted
        message = {**event, "dropped": carried} if carried else event
        for attempt in range(1, self.tries + 1):
            try:
                target.deliver(message)
            except _Failure as f:
                if self._abandon.is_set():  # close cut this request short, and its line names the target
                    return
                if not f.retry:
                    self._say(f"notify: {target.label} refused the event ({f.why})")
                elif attempt < self.tries:
                    if not self._abandon.wait(min(self.backoff * 2 ** (attempt - 1), self.max_backoff)):
                        continue
                    self._say(f"notify: {target.label} given up at close after {attempt} tries ({f.why})")
                else:
                    self._say(f"notify: {target.label} failed after {attempt} tries ({f.why})")
                with self._cond:
                    target.unsent += 1
                return
            # A bug in a library must not end this target's thread, with its queue still filling.
            except Exception as e:  # noqa: BLE001 -- the thread outlives anything a target does
                self._say(f"notify: {target.label} failed ({type(e).__name__})")
                with self._cond:
                    target.unsent += 1
                return
            with self._cond:
                target.unsent -= carried
            target.limited = False
            return

    def _say(self, line: str) -> None:
        try:
            self._log(line)
        except Exception:  # noqa: BLE001 -- a broken log must not stop deliveries, nor raise into send
            pass

    # ---------------------------------------------------------------- the targets
    def _http(self, label: str, url: str, make: Callable) -> _Target:
        """A target that posts to `url`: `make(post)` is its deliver, `post(data, headers)` the request."""
        watched = _Watched()
        opener = _opener(watched)

        def post(data: bytes, headers: dict[str, str]) -> None:
            self._post(opener, watched, url, data, headers)
        return _Target(label, make(post), cut=watched.cut)

    @staticmethod
    def _webhook(post: Callable[[bytes, dict[str, str]], None]) -> Callable[[dict[str, Any]], None]:
        def deliver(event: dict[str, Any]) -> None:
            post(json.dumps(event).encode(), {"Content-Type": "application/json"})
        return deliver

    @staticmethod
    def _ntfy(post: Callable[[bytes, dict[str, str]], None]) -> Callable[[dict[str, Any]], None]:
        def deliver(event: dict[str, Any]) -> None:
            title, body = describe(event)
            kind = event.get("event")
            headers = {"Title": _header(title), "Content-Type": "text/plain; charset=utf-8"}
            if kind in TAGS:
                headers["Tags"] = TAGS[kind]
            if kind in URGENT:
                headers["Priority"] = "high"
            post(body.encode(), headers)
        return deliver

    def _apprise(self, apprise: Any, key: str, url: str, name: str) -> _Target:
        scheme = url.split("://", 1)[0] if "://" in url else ""
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
            raise ConfigError(f"{key}: the value must be an Apprise URL (SCHEME://...)")
        client = apprise.Apprise()
        if not client.add(url):  # the URL itself is not said: it may hold a token
            raise ConfigError(f"{key}: Apprise does not take this {scheme}:// URL (an unknown service, or a part "
                              "it needs is missing): see https://github.com/caronc/apprise/wiki")
        kinds = {"failed": apprise.NotifyType.FAILURE, "finished": apprise.NotifyType.SUCCESS,
                 "target": apprise.NotifyType.SUCCESS}

        def deliver(event: dict[str, Any]) -> None:
            title, body = describe(event)
            if not client.notify(body=body, title=title,
                                 notify_type=kinds.get(event.get("event"), apprise.NotifyType.WARNING)):
                raise _Failure("Apprise could not deliver", retry=True)
        return _Target(f"{name} {scheme}://", deliver)

    def _post(self, opener: urllib.request.OpenerDirector, watched: _Watched, url: str, data: bytes,
              headers: dict[str, str]) -> None:
        parts = urlsplit(url)
        if parts.username is not None:  # urllib sends no credentials from the URL on its own
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            headers = {**headers, "Authorization": "Basic " + base64.b64encode(pair).decode()}
            netloc = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
            url = urlunsplit(parts._replace(netloc=netloc + (f":{parts.port}" if parts.port else "")))
        request = urllib.request.Request(url, data=data, method="POST",
                                         headers={"User-Agent": "lmcockpit", **headers})
        watched.current = under_way = _Request()
        deadline = threading.Timer(self.timeout, under_way.cut)
        deadline.daemon = True
        deadline.start()
        try:
            with opener.open(request, timeout=self.timeout) as response:
                if under_way.expired:  # a head cut short reads as a whole one: the end of its headers is EOF
                    raise _Failure("timed out", retry=True)
                try:
                    response.read(READ_BYTES)
                except (OSError, http.client.HTTPException):  # the status said delivered: the rest is courtesy
                    pass
        except urllib.error.HTTPError as e:
            e.close()
            if e.code in REDIRECTS:
                raise _Failure(f"HTTP {e.code}: a redirect{_where(url, e.headers.get('Location'))}, not followed",
                               retry=False) from None
            raise _Failure(f"HTTP {e.code}", retry=e.code >= 500 or e.code in (408, 429)) from None
        except (OSError, http.client.HTTPException) as e:
            raise _Failure("timed out" if under_way.expired else _scrub(_reason(e), url), retry=True) from None
        except ValueError as e:  # a URL urllib cannot send to: trying again will not change it
            raise _Failure(_scrub(_reason(e), url), retry=False) from None
        finally:
            deadline.cancel()
            under_way.done()
            watched.current = None


# -------------------------------------------------------------------- helpers
def _resolve(key: str, value: str, environ: Mapping[str, str]) -> str:
    found = ENV_NAME.fullmatch(value)
    if not found:
        return value
    name = found.group(1)
    if not environ.get(name, "").strip():
        raise ConfigError(f"{key} = {value!r}: the environment variable {name} is "
                          f"{'empty' if name in environ else 'not set'}")
    return environ[name].strip()


def _http_url(key: str, url: str) -> str:
    """`url` if it is one urllib can post to; the message names the key, never the value (which may
    have come from the environment, token and all)."""
    try:
        parts = urlsplit(url)
        parts.port  # a port beyond 65535, or not a number, raises here rather than at send time
    except ValueError:
        parts = None
    if (parts is None or parts.scheme not in ("http", "https") or not parts.hostname
            or any(c.isspace() or not c.isprintable() for c in url)):
        raise ConfigError(f"{key}: must be an http(s) URL with a host")
    return url


def _where(url: str, location: str | None) -> str:
    """" to SCHEME://HOST[:PORT]" of a redirect's Location (relative to `url`), its path, query and
    user part left out as a URL's are in any log line; "" when there is none to read."""
    try:
        parts = urlsplit(urljoin(url, location or ""))
        host, port = parts.hostname, parts.port
    except ValueError:
        return ""
    if not location or not host or parts.scheme not in ("http", "https"):
        return ""
    host = _clean(host)[:100]
    return f" to {parts.scheme}://{f'[{host}]' if ':' in host else host}{f':{port}' if port else ''}"


def _header(text: str) -> str:
    """A header value: HTTP's are Latin-1, so any other text goes as RFC 2047's encoded word, which
    ntfy decodes in its Title."""
    text = _clean(text)
    if text.isascii():
        return text
    return "=?UTF-8?B?" + base64.b64encode(text.encode()).decode() + "?="


def _reason(e: BaseException) -> str:
    """Why a request failed, in a few words: "connection refused", "timed out"."""
    if isinstance(e, urllib.error.URLError) and isinstance(e.reason, BaseException):
        e = e.reason
    if isinstance(e, TimeoutError):
        return "timed out"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror[0].lower() + e.strerror[1:]
    if isinstance(e, urllib.error.URLError):
        return str(e.reason)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _scrub(text: str, url: str) -> str:
    """`text` without any part of `url` that may hold a secret: its path, query and user part."""
    parts = urlsplit(url)
    secrets = [url, parts.path, parts.query, parts.fragment, parts.username, parts.password,
               *parts.path.split("/"), *re.split(r"[&=]", parts.query)]
    for secret in sorted((s for s in secrets if s and len(s) > 2), key=len, reverse=True):
        text = text.replace(secret, "…")
    return text


def _plain(value: Any, depth: int = 0) -> Any:
    """`value` as plain JSON, copied (the caller may change its own afterwards): what JSON cannot hold
    becomes text, NaN and the infinities included (a strict JSON reader refuses them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if depth < 8 and isinstance(value, Mapping):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if depth < 8 and isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    return str(value)


REACH_TIMEOUT = 5.0  # seconds a target's host has to accept a connection before a run is refused


def check(cfg, timeout: float = REACH_TIMEOUT) -> None:
    """The [notify] targets of `cfg` built as the run's owner will build them (env:NAME read, Apprise
    imported), so a mistake is refused before any run folder is made; nothing is sent.

    The webhook and ntfy URLs must also be reachable: a TCP connection to their host and port (or to
    the proxy that would carry their posts) opened within `timeout` seconds, then closed unused. One
    that nothing answers is refused, not warned of: word of a run goes unheard for its whole length
    otherwise (its "finished" or "failed" lost days later), and the user who is told at the start,
    there to read it, fixes the URL or drops the key in one flag. Apprise URLs name a hundred services
    in their own ways: only Apprise knows where each goes, so they are not checked."""
    Notifier(cfg.notify, "check").close(timeout=0)
    for key, value in (("notify.webhook", cfg.notify.webhook), ("notify.ntfy", cfg.notify.ntfy)):
        if not value:
            continue
        url = _http_url(key, _resolve(key, value, os.environ))
        host, port, via = _first_hop(url)
        if (why := _unreachable(host, port, timeout)) is not None:
            named = f" ({value})" if ENV_NAME.fullmatch(value) else ""
            raise ConfigError(f"{key}{named}: {_shown(url)} cannot be reached{via} ({why}); word of the run would "
                              f"go nowhere: fix it, or train without it (--set {key}='\"\"')")


def _shown(url: str) -> str:
    """SCHEME://HOST[:PORT]/ of `url`, and "…" for the rest: its path, query and user part may hold
    its token."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port is not None else "")
    rest = "…" if parts.path.strip("/") or parts.query or parts.fragment else ""
    return f"{parts.scheme}://{netloc}/{rest}"


def _first_hop(url: str) -> tuple[str, int, str]:
    """(host, port, how it is said) of what a post to `url` connects to first: the URL's own host, or
    the proxy urllib's opener takes from the environment for its scheme (no_proxy honoured)."""
    parts = urlsplit(url)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(parts.hostname):
        try:
            hop = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
            port = hop.port or (443 if hop.scheme == "https" else 80)
            if hop.hostname:
                return hop.hostname, port, f" through the proxy {hop.hostname}:{port} ({parts.scheme}_proxy)"
        except ValueError:
            pass  # a proxy urllib cannot read either: its post fails at the host's own address
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), ""


def _unreachable(host: str, port: int, timeout: float) -> str | None:
    """None once a TCP connection to host:port is open (closed at once, nothing sent); else why not,
    in a few words. The name's lookup counts against `timeout` too: it runs in a thread of its own,
    which a resolver that never answers leaves behind, never the caller."""
    why: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            why.append(None)
        except OSError as e:
            why.append(_reason(e))

    attempt = threading.Thread(target=connect, name="lmcockpit-notify check", daemon=True)
    attempt.start()
    attempt.join(timeout)
    return why[0] if why else f"no answer within {timeout:g} s"


class Announcer:
    """Which of the engine's events are word worth sending, as notification events: what the
    process that owns the engine feeds every event it reads, each stall it notices, and the end.
    Where the run stands (its step and loss) is read from `run` (a RunState, core/run/state.py),
    which that process keeps."""

    def __init__(self, notifier: Notifier, run: RunState):
        self.notifier, self.run = notifier, run

    def heard(self, event: object) -> None:
        from .. import protocol as P

        if isinstance(event, P.SpikeSeen):
            self.notifier.send({"event": "spike", "step": event.step, "loss": event.loss, "action": event.action})
        elif isinstance(event, P.RolledBack):
            self.notifier.send({"event": "rollback", "step": event.step, "to_step": event.to_step})
        elif isinstance(event, P.TargetReached):
            self.notifier.send({"event": "target", "step": event.step, "what": event.what, "value": event.value,
                                "target": event.target,
                                **({"after": run_time(event.seconds)} if event.seconds is not None else {})})
        elif isinstance(event, P.NonFinite):
            self.notifier.send({"event": "nan", "step": event.step, "action": event.action})

    def stalled(self, detail: str) -> None:
        self.notifier.send({"event": "stalled", "step": self.run.step, "detail": detail})

    def ended(self, state: str, failure, timeout: float = 5.0) -> None:
        """The run's last word, flushed within `timeout` seconds before the owner exits."""
        from .. import protocol as P

        if failure is not None:
            message = (failure.message.strip().splitlines() or [""])[0]
            self.notifier.send({"event": "failed", "step": self.run.step, "message": message})
        elif state == P.FINISHED:
            self.notifier.send({"event": "finished", "step": self.run.step, "loss": self.run.loss})
        self.notifier.close(timeout)

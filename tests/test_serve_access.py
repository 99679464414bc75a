"""`lmcockpit serve` against a second account on the same machine (other_account.py: a forked child
as `nobody`): by no path does that account get the cockpit, while its owner does. The server is the
real command (test_serve.py's `serve`), each request a plain HTTP one, as that account's curl would
send it; a request that gets as far as the cockpit would start one, so none may be running after."""

from __future__ import annotations

# The forked other account may not read this interpreter's files (they may live under /root), and
# a connection to "127.0.0.1" imports this codec on first use: imported here, before any fork.
import encodings.idna  # noqa: F401 - loaded before any fork, as said above
import http.cookies
import os
import stat

import pytest

from .other_account import OtherRaised, run_as_other
from .helpers import WEBSOCKET, free_port, http_get, token_cookie

pytestmark = pytest.mark.slow

NO_TOKEN = "refused: no token; open the address `lmcockpit serve` printed, with its ?token="
OUTSIDE = "no such page: open the address `lmcockpit serve` printed, all of it"
DENIED = r"PermissionError: \[Errno 13\] Permission denied"


# ----------------------------------------------------------------------------- the Unix socket
def test_the_default_socket_lets_its_owner_in_and_no_other_account(serve, runtime):
    served = serve(env={"XDG_RUNTIME_DIR": str(runtime)})
    path = str(runtime / "lmcockpit" / "serve.sock")
    served.expect(f"the cockpit on {path} ")
    status, _, page = http_get(path)
    assert status == 200 and 'data-session-websocket-url="ws://localhost:8000/ws"' in page
    with pytest.raises(OtherRaised, match=DENIED):  # runtime/ lets it by; lmcockpit/ (0700) does not
        run_as_other(http_get, path)
    assert not served.cockpits()


def test_a_socket_in_a_folder_others_may_enter_is_still_the_owners_alone(serve, runtime):
    path = str(runtime / "serve.sock")  # runtime/ is 0755: only the socket file's own mode stands in the way
    served = serve("--socket", path)
    # 0600 whatever the umask: connecting takes write permission, which a umask of 002 gives a group
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    assert http_get(path)[0] == 200
    with pytest.raises(OtherRaised, match=DENIED):
        run_as_other(http_get, path, "/ws", WEBSOCKET)
    assert not served.cockpits()


# ------------------------------------------------------------------------------------- on TCP
def test_over_tcp_another_account_without_the_path_and_token_gets_nothing_on_every_path(serve):
    port = free_port()
    served = serve("--port", str(port))
    own_page = {"Origin": f"http://127.0.0.1:{port}"}  # as the server's own page would send it
    owners = {"Cookie": token_cookie(port, served)}
    wrong_base = "/" + "0" * (len(served.base) - 2) + "/"
    for path, headers in [("", {}), ("ws", {**WEBSOCKET, **own_page}), ("static/js/textual.js", {}),
                          ("download/any", {})]:
        for outside in ("/", wrong_base):  # nothing there, not even for the token
            assert run_as_other(http_get, port, outside + path, headers)[:3:2] == [404, OUTSIDE], outside + path
            assert http_get(port, outside + path, {**headers, **owners})[:3:2] == [404, OUTSIDE], outside + path
        # Were the path to leak, the token still stands in the way.
        status, _, body = run_as_other(http_get, port, served.base + path, headers)
        assert (status, body) == (403, NO_TOKEN), path
    assert http_get(port, served.base, owners)[0] == 200  # its owner
    assert not served.cockpits()


def test_a_websocket_upgrade_with_no_origin_and_no_token_is_refused(serve):
    port = free_port()
    served = serve("--port", str(port))
    # No Origin: what curl or a script sends, not a browser; the Origin check alone lets it by.
    ws = f"{served.base}ws"
    assert run_as_other(http_get, port, ws, WEBSOCKET)[:3:2] == [403, NO_TOKEN]
    assert http_get(port, ws, WEBSOCKET)[:3:2] == [403, NO_TOKEN]
    assert not served.cockpits()
    # With the token the owner's WebSocket opens (and its cockpit starts: the server's cleanup ends it).
    assert http_get(port, ws, {**WEBSOCKET, "Cookie": token_cookie(port, served)})[0] == 101


def test_a_wrong_token_is_refused_and_the_right_one_becomes_an_httponly_strict_cookie(serve):
    port = free_port()
    served = serve("--port", str(port))
    base, wrong = served.base, "0" * len(served.token)
    assert http_get(port, f"{base}?token={wrong}")[:3:2] == [403, "refused: a wrong token"]

    status, headers, _ = http_get(port, f"{base}?fontsize=12&token={served.token}")
    assert (status, headers["Location"]) == (303, f"{base}?fontsize=12")  # the token out of the address bar
    [(name, morsel)] = http.cookies.SimpleCookie(headers["Set-Cookie"]).items()
    assert morsel.value == served.token and str(port) in name
    # Sent to no path but the cockpit's: a browser gives a host's cookies to every port of it.
    assert morsel["httponly"] is True and morsel["samesite"] == "Strict" and morsel["path"] == base
    assert http_get(port, base, {"Cookie": f"{name}={served.token}"})[0] == 200
    assert http_get(port, base, {"Cookie": f"{name}={wrong}"})[:3:2] == [403, "refused: a wrong token"]
    not_utf8 = "\xed\xa0\x80"  # sent as those three bytes: read as lone surrogates
    assert http_get(port, base, {"Cookie": f"{name}={not_utf8}"})[:3:2] == [403, "refused: a wrong token"]
    assert not served.cockpits()

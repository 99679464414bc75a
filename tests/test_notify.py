"""The notification sender (core/process/notify.py) against real HTTP servers on 127.0.0.1, and the
[notify] section's checks: what each target receives, retries, a target that hangs, refuses,
redirects, trickles or answers without end, the rate limit, secrets kept out of the log, and a bad
URL refused before a run starts."""

from __future__ import annotations

import os
import pty
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from email.header import decode_header

import pytest

from lmcockpit.core.config import ConfigError, NotifyConfig, load_config
from lmcockpit.core.process.notify import NEEDS_APPRISE, Notifier, in_tmux, terminal_escape

from .helpers import Server, cli


@pytest.fixture
def serve():
    servers = []

    def start(answers=(), hold=None, answer=None) -> Server:
        servers.append(Server(answers, hold, answer))
        return servers[-1]
    yield start
    for server in servers:
        server.stop()


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    # A proxy in the environment would take 127.0.0.1's requests elsewhere (urllib and requests both read it).
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.setenv(name, "*")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def notifier(log: list[str] | None = None, **kwargs) -> Notifier:
    """Retries in hundredths of a second: the back-off's shape, not its length, is what a test checks."""
    options = {k: kwargs.pop(k) for k in ("tries", "backoff", "per_minute", "queue_size", "timeout", "environ")
               if k in kwargs}
    return Notifier(NotifyConfig(**kwargs), "run-a", log=(log.append if log is not None else lambda line: None),
                    **{"backoff": 0.01, **options})


# ------------------------------------------------------------------ what each target receives
def test_the_webhook_gets_the_event_as_a_json_post(serve):
    server = serve()
    n = notifier(webhook=server.url + "/hook")
    n.send({"event": "finished", "step": 400, "loss": 2.5})
    n.close()
    (got,) = server.wait_for(1)
    assert got.path == "/hook" and got.headers["Content-Type"] == "application/json"
    assert got.json() == {"event": "finished", "run": "run-a", "step": 400, "loss": 2.5}


def test_a_nan_loss_is_sent_as_text_that_strict_json_reads(serve):
    server = serve()
    n = notifier(webhook=server.url)
    n.send({"event": "nan", "step": 3, "loss": float("nan"), "grad_norm": float("inf")})
    n.close()
    assert server.wait_for(1)[0].json() == {"event": "nan", "run": "run-a", "step": 3, "loss": "nan", "grad_norm": "inf"}


def test_ntfy_gets_a_line_of_text_with_a_title_tags_and_priority(serve):
    server = serve()
    n = notifier(ntfy=server.url + "/lmc-topic")
    n.send({"event": "finished", "step": 400, "loss": 2.5})
    n.send({"event": "failed", "step": 12, "error": "CUDA out of memory\n(traceback in train.log)"})
    n.close()
    done, failed = server.wait_for(2)
    assert done.path == "/lmc-topic" and done.body.decode() == "finished at step 400, loss 2.5"
    assert done.headers["Title"] == "run-a: finished" and done.headers["Tags"] == "white_check_mark"
    assert done.headers["Priority"] is None
    assert failed.body.decode() == "failed at step 12, error CUDA out of memory (traceback in train.log)"
    assert (failed.headers["Title"], failed.headers["Tags"], failed.headers["Priority"]) == ("run-a: failed", "x", "high")


def test_a_title_beyond_latin_1_goes_as_an_encoded_word(serve):
    server = serve()
    n = Notifier(NotifyConfig(ntfy=server.url + "/t"), "λ-run", backoff=0.01)
    n.send({"event": "target", "step": 9})
    n.close()
    ((raw, charset),) = decode_header(server.wait_for(1)[0].headers["Title"])
    assert raw.decode(charset) == "λ-run: target"


def test_user_and_password_in_the_url_go_as_basic_auth(serve):
    server = serve()
    n = notifier(webhook=f"http://alice:s%40cret@127.0.0.1:{server.port}/hook")
    n.send({"event": "finished", "step": 1})
    n.close()
    (got,) = server.wait_for(1)
    assert got.path == "/hook" and got.headers["Authorization"] == "Basic YWxpY2U6c0BjcmV0"  # alice:s@cret


def test_apprise_delivers_through_a_real_apprise_url(serve):
    """json:// is Apprise's own plugin that posts its JSON to a server: the whole Apprise path, no network."""
    server = serve(answers=[500])  # Apprise says only that it failed: tried again all the same
    n = notifier(apprise=[f"json://127.0.0.1:{server.port}/apprise/in"])
    assert n.targets == ["apprise json://"]
    n.send({"event": "finished", "step": 400, "loss": 2.5})
    n.close()
    first, second = server.wait_for(2)
    assert first.body == second.body and second.path == "/apprise/in"
    got = second.json()
    assert (got["title"], got["message"], got["type"]) == ("run-a: finished", "finished at step 400, loss 2.5", "success")


def test_without_apprise_installed_an_apprise_url_is_refused_at_construction(monkeypatch):
    monkeypatch.setitem(sys.modules, "apprise", None)  # Python's own way to make a package unimportable
    with pytest.raises(ConfigError) as e:
        notifier(apprise=["json://127.0.0.1:1/x"])
    assert str(e.value) == NEEDS_APPRISE == "notify.apprise: needs the apprise package: pip install 'lmcockpit[notify]'"
    notifier(webhook="http://127.0.0.1:1/x").close()  # the other targets never import it


def test_an_apprise_url_apprise_does_not_take_is_refused_without_its_token():
    with pytest.raises(ConfigError, match=r"notify.apprise\[1\]: Apprise does not take this nosuch:// URL") as e:
        notifier(apprise=["json://127.0.0.1:1/x", "nosuch://SECRET-TOKEN/x"])
    assert "SECRET" not in str(e.value)


# ------------------------------------------------------------------ retries and failures
def test_a_503_is_tried_again_with_a_doubling_back_off(serve):
    server = serve(answers=[503, 503])
    lines = []
    n = notifier(lines, webhook=server.url, backoff=0.05)
    n.send({"event": "finished", "step": 7})
    n.close()
    tries = server.wait_for(3)
    assert len(tries) == 3 and tries[0].body == tries[1].body == tries[2].body
    assert tries[1].at - tries[0].at >= 0.05 and tries[2].at - tries[1].at >= 0.1
    assert lines == []


def test_a_target_that_fails_every_try_is_logged_and_its_next_message_counts_the_loss(serve):
    server = serve(answers=[503, 503, 503])
    lines = []
    n = notifier(lines, webhook=server.url + "/hook", tries=3)
    n.send({"event": "spike", "step": 1})
    n.send({"event": "spike", "step": 2})
    n.close()
    tries = server.wait_for(4)
    assert [r.json()["step"] for r in tries] == [1, 1, 1, 2] and tries[3].json()["dropped"] == 1
    assert lines == ["notify: webhook 127.0.0.1 failed after 3 tries (HTTP 503)"]


def test_a_4xx_is_not_tried_again(serve):
    server = serve(answers=[404])
    lines = []
    n = notifier(lines, webhook=server.url)
    n.send({"event": "finished", "step": 7})
    n.close()
    assert len(server.wait_for(1)) == 1
    assert lines == ["notify: webhook 127.0.0.1 refused the event (HTTP 404)"]


def test_a_refusing_port_is_logged_by_kind_and_host_never_by_url():
    port = closed_port()
    lines = []
    n = notifier(lines, tries=2,
                 webhook=f"http://alice:hunter2@127.0.0.1:{port}/hooks/SECRET-TOKEN-1?key=SECRET-KEY-2",
                 ntfy=f"http://127.0.0.1:{port}/SECRET-TOPIC-3")
    assert n.targets == ["webhook 127.0.0.1", "ntfy 127.0.0.1"]
    n.send({"event": "failed", "step": 3})
    n.close(timeout=10)
    assert sorted(lines) == ["notify: ntfy 127.0.0.1 failed after 2 tries (connection refused)",  # each its own thread
                             "notify: webhook 127.0.0.1 failed after 2 tries (connection refused)"]
    assert not [line for line in lines if "SECRET" in line or "hunter2" in line or "alice" in line]


def test_a_hanging_webhook_never_slows_send_and_close_keeps_its_bound(serve):
    release = threading.Event()
    server = serve(hold=release)
    lines = []
    n = notifier(lines, webhook=server.url, timeout=60)
    sent, took = threading.Event(), []

    def flood():  # in a thread of its own, so that a send that blocks fails the test rather than hangs it
        start = time.perf_counter()
        for step in range(50):
            n.send({"event": "spike", "step": step})
        took.append(time.perf_counter() - start)
        sent.set()
    threading.Thread(target=flood, daemon=True).start()
    assert sent.wait(5), "send blocked on a webhook that hangs"
    assert took[0] < 0.25  # microseconds each: only a wait on the server would show
    server.wait_for(1)  # the thread is inside the request that hangs
    start = time.perf_counter()
    n.close(timeout=1)
    assert 1 <= time.perf_counter() - start < 1.5
    assert len(lines) == 1 and lines[0].startswith("notify: closed after 1 s with a target still being tried")
    release.set()


def trickle(handler, stopped: threading.Event) -> None:
    """An answer that never ends: a status line, then a header a byte every 0.1 s, each byte long
    before any timeout of a single read."""
    try:
        handler.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        while not stopped.wait(0.1):  # the trickle's pace, not a wait for anything
            handler.wfile.write(b"a")
    except OSError:  # the client gave up on it
        pass


def test_a_target_that_trickles_keeps_no_event_from_another(serve):
    """A webhook that answers a byte at a time: ntfy gets every event, `finished` included, while the
    webhook is still in its first answer; close keeps its bound and names the target it gave up on."""
    slow, ntfy = serve(answer=trickle), serve()
    lines = []
    n = notifier(lines, webhook=slow.url + "/hook", ntfy=ntfy.url + "/topic", per_minute=100, timeout=60)
    for step in range(1, 13):
        n.send({"event": "spike", "step": step})
    n.send({"event": "finished", "step": 13, "loss": 2.5})
    got = ntfy.wait_for(13, timeout=5)
    assert [r.body.decode() for r in got] == [f"loss spike at step {s}" for s in range(1, 13)] + [
        "finished at step 13, loss 2.5"]
    assert len(slow.received) == 1  # still being answered
    start = time.perf_counter()
    n.close(timeout=1)
    assert 1 <= time.perf_counter() - start < 1.5
    assert lines == ["notify: closed after 1 s with a target still being tried (webhook 127.0.0.1) and 12 more "
                     "event(s) queued: not delivered"]


def test_a_trickling_answer_is_cut_at_the_request_s_deadline(serve):
    """`timeout` bounds the whole request, not each read: an answer that never ends is one timeout."""
    slow = serve(answer=trickle)
    lines = []
    n = notifier(lines, webhook=slow.url, tries=2, timeout=0.5)
    start = time.perf_counter()
    n.send({"event": "finished", "step": 1})
    n.close(timeout=10)
    took = time.perf_counter() - start
    assert lines == ["notify: webhook 127.0.0.1 failed after 2 tries (timed out)"]
    assert len(slow.received) == 2 and 1.0 <= took < 3  # two tries of 0.5 s, 0.01 s apart


STREAMED = 64 * 2**20  # more than loopback's socket buffers hold: the server blocks long before the end


def test_an_answer_without_end_is_read_no_further_than_a_few_kb(serve):
    """A 200 whose body never ends (no length; the server never closes): the event is delivered at
    once, and the server's writes fail long before it has sent what a reader of it all would take."""
    sent, broke = [0], threading.Event()

    def endless(handler, stopped):
        handler.send_response(200)
        handler.send_header("Content-Type", "application/octet-stream")
        handler.end_headers()
        try:
            while sent[0] < STREAMED:
                handler.wfile.write(b"x" * 65536)
                sent[0] += 65536
            stopped.wait(60)  # and the rest never comes
        except OSError:  # the client closed with the body unread
            broke.set()

    server = serve(answer=endless)
    lines = []
    n = notifier(lines, webhook=server.url)
    start = time.perf_counter()
    n.send({"event": "finished", "step": 1})
    n.close(timeout=5)
    assert time.perf_counter() - start < 2 and lines == []
    assert len(server.wait_for(1)) == 1
    assert broke.wait(10), "the client is still reading the endless body"
    assert sent[0] < STREAMED


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_a_redirect_is_one_logged_refusal_and_credentials_never_go_elsewhere(serve, code):
    elsewhere = serve()
    hook = serve(answers=[(code, {"Location": f"{elsewhere.url}/collect?key=THEIR-KEY"})])
    lines = []
    n = notifier(lines, webhook=f"http://alice:hunter2@127.0.0.1:{hook.port}/hooks/SECRET-TOKEN")
    n.send({"event": "finished", "step": 1})
    n.close()
    # a redirect followed would have reached `elsewhere` before close returned: it is the same request
    assert len(hook.wait_for(1)) == 1 and elsewhere.received == []
    assert lines == [f"notify: webhook 127.0.0.1 refused the event (HTTP {code}: a redirect to "
                     f"http://127.0.0.1:{elsewhere.port}, not followed)"]


def test_a_redirect_on_the_same_host_is_not_followed_either(serve):
    ntfy = serve(answers=[(302, {"Location": "/moved/SECRET-TOPIC"})])
    lines = []
    n = notifier(lines, ntfy=ntfy.url + "/SECRET-TOPIC")
    n.send({"event": "failed", "step": 1})
    n.close()
    assert [r.path for r in ntfy.wait_for(1)] == ["/SECRET-TOPIC"] and len(ntfy.received) == 1
    assert lines == [f"notify: ntfy 127.0.0.1 refused the event (HTTP 302: a redirect to http://127.0.0.1:{ntfy.port}, "
                     "not followed)"]


def test_a_full_queue_drops_its_oldest_and_the_next_message_counts_them(serve):
    release = threading.Event()
    server = serve(hold=release)
    n = notifier(webhook=server.url, queue_size=5, per_minute=100)
    n.send({"event": "spike", "step": 0})
    server.wait_for(1)  # the thread is held in step 0's request: the next 20 wait in the queue
    for step in range(1, 21):
        n.send({"event": "spike", "step": step})
    assert n.dropped == 15
    release.set()
    n.close(timeout=10)
    got = [r.json() for r in server.wait_for(6)]
    assert [g["step"] for g in got] == [0, 16, 17, 18, 19, 20]
    assert got[1]["dropped"] == 15 and "dropped" not in got[2]


def test_the_rate_limit_drops_repeated_events_but_never_the_last_word(serve):
    server = serve()
    lines = []
    n = notifier(lines, webhook=server.url, per_minute=2)
    for step in range(1, 6):
        n.send({"event": "spike", "step": step})
    n.send({"event": "failed", "step": 6})
    n.close()
    got = [r.json() for r in server.wait_for(3)]
    assert [(g["event"], g["step"]) for g in got] == [("spike", 1), ("spike", 2), ("failed", 6)]
    assert got[2]["dropped"] == 3 and len(server.received) == 3
    assert lines == ["notify: webhook 127.0.0.1: more than 2 events a minute; dropping them, the next message "
                     "says how many"]


def test_send_never_raises_and_close_is_idempotent(serve):
    server = serve()
    lines = []
    n = notifier(lines, webhook=server.url)
    n.send(None)  # type: ignore[arg-type]
    n.send({"event": "spike", "step": 1, "at": object, 2: (1, 2)})
    n.close()
    n.close()
    n.send({"event": "finished", "step": 2})  # after close: counted, not sent
    (got,) = server.wait_for(1)
    # the unreadable event is one the target never had: the next message counts it
    assert got.json() == {"event": "spike", "run": "run-a", "step": 1, "at": "<class 'object'>", "2": [1, 2],
                          "dropped": 1}
    assert n.dropped == 2 and lines == ["notify: an event could not be read and was dropped (TypeError)"]


def test_with_nothing_to_send_to_there_is_no_thread():
    before = set(threading.enumerate())
    n = notifier()
    assert n.targets == []
    assert not [t for t in threading.enumerate() if t not in before and t.name.startswith("lmcockpit-notify")]
    n.send({"event": "finished", "step": 1})
    n.close()


# ------------------------------------------------------------------ secrets from the environment
def test_env_name_is_read_from_the_environment(serve, monkeypatch):
    server = serve()
    monkeypatch.setenv("LMC_TEST_HOOK", server.url + "/from-env")
    n = notifier(webhook="env:LMC_TEST_HOOK")
    n.send({"event": "finished", "step": 1})
    n.close()
    assert server.wait_for(1)[0].path == "/from-env"


def test_env_name_missing_or_not_a_url_is_a_config_error(monkeypatch):
    monkeypatch.delenv("LMC_TEST_MISSING", raising=False)
    with pytest.raises(ConfigError, match=r"^notify.webhook = 'env:LMC_TEST_MISSING': the environment variable "
                                          r"LMC_TEST_MISSING is not set$"):
        notifier(webhook="env:LMC_TEST_MISSING")
    monkeypatch.setenv("LMC_TEST_EMPTY", "")
    with pytest.raises(ConfigError, match=r"^notify.apprise\[0\] = 'env:LMC_TEST_EMPTY': .* LMC_TEST_EMPTY is empty$"):
        notifier(apprise=["env:LMC_TEST_EMPTY"])
    monkeypatch.setenv("LMC_TEST_NTFY", "ftp://host/SECRET-TOPIC")
    with pytest.raises(ConfigError, match=r"^notify.ntfy: must be an http\(s\) URL with a host$"):
        notifier(ntfy="env:LMC_TEST_NTFY")


# ------------------------------------------------------------------ the terminal
def test_terminal_escape_strips_what_could_end_or_start_a_sequence():
    assert terminal_escape("run;1\x1b]0;pwn\x07", "loss spike;\tstep 5\x9c") == (
        "\x1b]777;notify;run1]0pwn;loss spikestep 5\x07" "\x1b]9;run1]0pwn: loss spikestep 5\x07" "\x07")
    assert Notifier.terminal_escape("a", "b") == "\x1b]777;notify;a;b\x07\x1b]9;a: b\x07\x07"


TMUX_MISSING = "no `tmux` on PATH: the passthrough test drives a real one (apt-get install tmux; .ci/run installs it)"
# What the pane writes, as the dashboard's announce does: from inside tmux, wrapped if in_tmux() says so.
PANE = ("import sys; from lmcockpit.core.process.notify import in_tmux, terminal_escape; input(); "
        "wrap = sys.argv[1] == 'wrap' and in_tmux(); "
        "sys.stdout.write(terminal_escape('lmcockpit: finished', 'run finished at step 8', tmux=wrap) + 'DONE'); "
        "sys.stdout.flush(); input()")
OSC_777 = b"\x1b]777;notify;lmcockpit: finished;run finished at step 8\x07"
OSC_9 = b"\x1b]9;lmcockpit: finished: run finished at step 8\x07"


def through_tmux(tmp_path, wrap: bool, passthrough: bool) -> bytes:
    """What a terminal receives from a real tmux client while a pane writes the notification: the
    client runs on a pty of the test's, the outer terminal."""
    assert shutil.which("tmux"), TMUX_MISSING
    sock = str(tmp_path / f"tmux-{wrap}-{passthrough}")
    env = {**os.environ, "TERM": "xterm-256color"}
    env.pop("TMUX", None)
    tmux = ["tmux", "-S", sock, "-f", "/dev/null"]
    subprocess.run([*tmux, "new-session", "-d", "-s", "t", "-x", "80", "-y", "24",
                    sys.executable, "-c", PANE, "wrap" if wrap else "raw"], check=True, env=env)
    try:
        subprocess.run([*tmux, "set", "-g", "allow-passthrough", "on" if passthrough else "off"], check=True)
        pid, fd = pty.fork()
        if pid == 0:  # the client, in the outer terminal
            os.execvpe("tmux", [*tmux, "attach", "-t", "t"], env)
        out, triggered, deadline = b"", False, time.monotonic() + 20
        while time.monotonic() < deadline and b"DONE" not in out:
            if not triggered and subprocess.run([*tmux, "list-clients"], capture_output=True).stdout.strip():
                subprocess.run([*tmux, "send-keys", "-t", "t", "Enter"], check=True)
                triggered = True
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    out += os.read(fd, 65536)
                except OSError:
                    break
        assert b"DONE" in out, f"the pane's output never reached the client: {out[-300:]!r}"
        return out
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
        os.waitpid(pid, 0)


@pytest.mark.slow
def test_terminal_notification_gets_through_tmux_with_passthrough(tmp_path):
    """Inside tmux the dashboard's OSC 777 and 9 reach the outer terminal as written, and the bell
    with them; written bare, tmux swallows them (why they are wrapped); without the user's
    allow-passthrough, only the bell gets through."""
    got = through_tmux(tmp_path, wrap=True, passthrough=True)
    assert OSC_777 in got and OSC_9 in got
    assert b"\x07" in got.replace(OSC_777, b"").replace(OSC_9, b""), "the bell did not get through"
    bare = through_tmux(tmp_path, wrap=False, passthrough=True)
    assert OSC_777 not in bare and OSC_9 not in bare
    refused = through_tmux(tmp_path, wrap=True, passthrough=False)
    assert OSC_777 not in refused and OSC_9 not in refused and b"\x07" in refused


def test_in_tmux_reads_the_panes_environment(monkeypatch):
    monkeypatch.setenv("TMUX", "/tmp/tmux-0/default,123,0")
    assert in_tmux()
    monkeypatch.delenv("TMUX")
    assert not in_tmux()
    assert terminal_escape("a", "b", tmux=True) == (
        "\x1bPtmux;\x1b\x1b]777;notify;a;b\x07\x1b\\" "\x1bPtmux;\x1b\x1b]9;a: b\x07\x1b\\" "\x07")


# ------------------------------------------------------------------ [notify] in the config
@pytest.mark.parametrize("item, message", [
    ('notify.webhook="ftp://x"', "--set: notify.webhook = 'ftp://x' must be an http(s) URL or env:NAME"),
    ('notify.webhook="https://"', "--set: notify.webhook = 'https://' must be an http(s) URL or env:NAME"),
    ('notify.webhook="http://h:99999/x"', "--set: notify.webhook = 'http://h:99999/x' must be an http(s) URL or env:NAME"),
    ('notify.ntfy="ntfy.sh/topic"', "--set: notify.ntfy = 'ntfy.sh/topic' must be an http(s) URL or env:NAME"),
    ('notify.ntfy="https://ntfy.sh/a topic"',
     "--set: notify.ntfy = 'https://ntfy.sh/a topic' must be an http(s) URL or env:NAME"),
    ('notify.ntfy="env:1TOKEN"', "--set: notify.ntfy = 'env:1TOKEN' must be an http(s) URL or env:NAME"),
    ('notify.apprise=["json://x/y", ""]',
     "--set: notify.apprise[1] = '' must be an Apprise URL (SCHEME://...) or env:NAME"),
    ('notify.apprise=["slack"]', "--set: notify.apprise[0] = 'slack' must be an Apprise URL (SCHEME://...) or env:NAME"),
])
def test_a_bad_notify_url_is_one_config_error(item, message):
    with pytest.raises(ConfigError) as e:
        load_config("debug", [item])
    assert str(e.value) == message


def test_good_notify_urls_load():
    cfg, _ = load_config("debug", ['notify.webhook="env:LMC_HOOK"', 'notify.ntfy="https://ntfy.sh/lmc-x?auth=abc"',
                                   'notify.apprise=["discord://id/token", "env:SLACK_URL"]'])
    assert (cfg.notify.webhook, cfg.notify.ntfy) == ("env:LMC_HOOK", "https://ntfy.sh/lmc-x?auth=abc")
    assert cfg.notify.apprise == ["discord://id/token", "env:SLACK_URL"]


@pytest.mark.slow
def test_the_cli_refuses_a_bad_webhook_before_a_run_starts(tmp_path):
    proc = cli("--run", "debug", "--set", 'notify.webhook="ftp://x"', "--out", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == ["error: --set: notify.webhook = 'ftp://x' must be an http(s) URL or env:NAME"]
    assert not (tmp_path / "run").exists()

"""A notification target that nothing answers is refused before the run starts (issue #51, 6):
one `error:` line naming the key and the URL's scheme, host and port, exit 2, no run folder.
The closed port is a real one on 127.0.0.1 (bound, never listening: the kernel refuses every
connection to it); the open ones are real local HTTP servers."""

from __future__ import annotations

import contextlib
import json
import socket

import pytest

from lmcockpit.core.config import ConfigError
from lmcockpit.core.process import notify
from tests.helpers import NO_PROXY, Server, cli, tiny_config


@contextlib.contextmanager
def closed_port():
    """A port of 127.0.0.1 held by this test and listened on by nothing."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


@pytest.mark.slow
def test_a_webhook_nothing_answers_is_refused_before_the_run_folder(tmp_path):
    with closed_port() as port:
        hook = f"http://127.0.0.1:{port}/SECRET-HOOK?token=SECRET-TOKEN"
        r = cli("--run", "debug", "--set", f"notify.webhook={json.dumps(hook)}", "--out", str(tmp_path / "run"),
                env=NO_PROXY)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.splitlines() == [
        f"error: notify.webhook: http://127.0.0.1:{port}/… cannot be reached (connection refused); word of the run "
        "would go nowhere: fix it, or train without it (--set notify.webhook='\"\"')"]
    assert "SECRET" not in r.stdout + r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_an_ntfy_topic_named_by_a_variable_and_nothing_answers_is_refused_by_detach_too(tmp_path):
    with closed_port() as port:
        r = cli("debug", "--detach", "--set", 'notify.ntfy="env:LMCOCKPIT_TEST_TOPIC"', "--out", str(tmp_path / "run"),
                env={**NO_PROXY, "LMCOCKPIT_TEST_TOPIC": f"http://alice:SECRET@127.0.0.1:{port}/SECRET-TOPIC"})
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.splitlines() == [
        f"error: notify.ntfy (env:LMCOCKPIT_TEST_TOPIC): http://127.0.0.1:{port}/… cannot be reached (connection "
        "refused); word of the run would go nowhere: fix it, or train without it (--set notify.ntfy='\"\"')"]
    assert "SECRET" not in r.stdout + r.stderr and "alice" not in r.stderr
    assert not (tmp_path / "run").exists()


def test_a_target_that_answers_passes_and_is_sent_nothing(monkeypatch):
    for name, value in NO_PROXY.items():
        monkeypatch.setenv(name, value)
    server = Server()
    try:
        notify.check(tiny_config(f"notify.webhook={json.dumps(server.url + '/hook')}",
                                 f"notify.ntfy={json.dumps(server.url + '/topic')}"))
        assert server.received == []  # a connection opened and closed: no request
    finally:
        server.stop()


def test_behind_a_proxy_the_proxy_is_what_must_answer(monkeypatch):
    """Posts go through the proxy the environment names (urllib's opener takes it): the target's
    own host need not be reachable from here, the proxy must; no_proxy sends a host past it."""
    proxy = Server()
    try:
        with closed_port() as port:
            cfg = tiny_config(f"notify.webhook=\"http://127.0.0.1:{port}/hook\"")
            for name in ("no_proxy", "NO_PROXY", "HTTP_PROXY"):
                monkeypatch.delenv(name, raising=False)
            monkeypatch.setenv("http_proxy", proxy.url)
            notify.check(cfg)  # the proxy answers
            monkeypatch.setenv("no_proxy", "127.0.0.1")
            with pytest.raises(ConfigError, match=rf"http://127.0.0.1:{port}/… cannot be reached \(connection refused\)"):
                notify.check(cfg)
            monkeypatch.delenv("no_proxy")
        with closed_port() as dead_proxy:
            monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{dead_proxy}")
            with pytest.raises(ConfigError, match=rf"cannot be reached through the proxy 127.0.0.1:{dead_proxy} "
                                                  r"\(http_proxy\) \(connection refused\)"):
                notify.check(cfg)
        assert proxy.received == []
    finally:
        proxy.stop()

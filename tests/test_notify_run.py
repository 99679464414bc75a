"""Word of a real run's events at a local HTTP server of the test's own: finished and failed from
`--run`'s front-end, stalled from a detached run's host; a webhook that hangs changes nothing in
the run (the same losses) and costs its end at most the notifier's bounded flush."""

from __future__ import annotations

import json
import os
import signal
import stat
import threading
import time

import psutil

import pytest

from lmcockpit.core.process import live
from lmcockpit.core.run.folder import read_metrics
from tests.helpers import NO_PROXY, TINY, Server, as_flags, cli, detached, last_step, stop, wait_until

def events(server: Server) -> list[dict]:
    return [json.loads(r.body) for r in server.received]


def losses(run) -> list[float]:
    return [row["loss"] for row in read_metrics(run, "step")]


@pytest.mark.slow
def test_a_finished_run_and_a_failed_one_send_their_word(tmp_path):
    server = Server()
    try:
        hook = f"notify.webhook={json.dumps(server.url + '/hook')}"
        r = cli("--run", "debug", *as_flags([*TINY, hook]), "--out", str(tmp_path / "done"), env=NO_PROXY)
        assert r.returncode == 0, r.stderr
        [finished] = server.wait_for(1)
        assert finished.path == "/hook" and finished.headers["Content-Type"] == "application/json"
        assert json.loads(finished.body) == {"event": "finished", "run": "done", "step": 12,
                                             "loss": losses(tmp_path / "done")[-1]}
        # the URL is kept in the config files, which other accounts may then not read
        kept = [tmp_path / "done" / "config.toml", *(tmp_path / "done" / "checkpoints").glob("step_*/config.toml")]
        assert len(kept) >= 2 and all(server.url in f.read_text() for f in kept)
        assert {stat.S_IMODE(f.stat().st_mode) for f in kept} == {0o600}

        r = cli("--run", "debug", *as_flags([*TINY, hook, "optimizer.lr=1e30", "optimizer.muon_lr=1e30",
                                             "training.grad_clip=0"]), "--out", str(tmp_path / "blown"), env=NO_PROXY)
        assert r.returncode == 1
        server.wait_for(3)
        nan, failed = events(server)[1:]
        assert nan == {"event": "nan", "run": "blown", "step": nan["step"], "action": "stop"}
        assert failed["event"] == "failed" and failed["message"].startswith(f"non-finite values at step {nan['step']}")
    finally:
        server.stop()


@pytest.mark.slow
def test_a_hanging_webhook_changes_nothing_in_training(tmp_path):
    """Nor in what the other targets get: ntfy has the finished event while the webhook still hangs."""
    plain = cli("--run", "debug", *as_flags(TINY), "--out", str(tmp_path / "plain"))
    assert plain.returncode == 0, plain.stderr
    server = Server(hold=threading.Event())  # answers nothing until the test ends
    ntfy = Server()
    try:
        t0 = time.monotonic()
        r = cli("--run", "debug", *as_flags([*TINY, f"notify.webhook={json.dumps(server.url + '/hook-secret')}",
                                             f"notify.ntfy={json.dumps(ntfy.url + '/topic')}"]),
                "--out", str(tmp_path / "hooked"), env=NO_PROXY)
        took = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        assert losses(tmp_path / "hooked") == losses(tmp_path / "plain")
        assert len(server.received) == 1  # the finished event, posted and never answered
        assert [got.body.decode() for got in ntfy.received] == [
            f"finished at step 12, loss {losses(tmp_path / 'hooked')[-1]:.4g}"]
        assert took < 60  # the flush gives up after 5 s; it never waits out the hook's minute
        said = r.stdout + r.stderr
        assert ("notify: closed after 5 s with a target still being tried (webhook 127.0.0.1) and 0 more event(s) "
                "queued: not delivered") in said and "hook-secret" not in said
    finally:
        server.stop()
        ntfy.stop()


@pytest.mark.slow
def test_a_stalled_run_s_host_sends_word(tmp_path, monkeypatch):
    for name, value in NO_PROXY.items():
        monkeypatch.setenv(name, value)  # the host inherits this process's environment
    server = Server()
    run = detached(tmp_path, "run", "notify.stall_after=2", f"notify.webhook={json.dumps(server.url)}")
    engine = []
    try:
        wait_until(lambda: last_step(run) >= 3, what="training to start")
        engine = psutil.Process(live.LiveRecord.read(run).pid).children(recursive=True)
        for process in engine:
            process.send_signal(signal.SIGSTOP)
        # A loaded machine may take longer than stall_after over the first step: that word (step 0)
        # is true, and not the one this test waits for.
        got: list = []
        while not any(w["event"] == "stalled" and w["step"] >= 3 for w in got):
            got = [json.loads(r.body) for r in server.wait_for(len(got) + 1, timeout=60)]
        word = next(w for w in got if w["event"] == "stalled" and w["step"] >= 3)
        assert word["run"] == "run"
        assert word["detail"].startswith("no word for ")
    finally:
        for process in engine:
            process.send_signal(signal.SIGCONT)
        stop(run)
        server.stop()
    assert os.path.exists(run / "train.log")


@pytest.mark.slow
def test_a_webhook_named_by_a_missing_variable_is_refused_before_the_run_folder(tmp_path):
    r = cli("--run", "debug", "--set", 'notify.webhook="env:LMCOCKPIT_TEST_NO_SUCH_HOOK"', "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == ("error: notify.webhook = 'env:LMCOCKPIT_TEST_NO_SUCH_HOOK': "
                                "the environment variable LMCOCKPIT_TEST_NO_SUCH_HOOK is not set")
    assert not (tmp_path / "run").exists()


def test_each_engine_event_worth_word_becomes_its_notification(monkeypatch):
    """What the owner of an engine sends for each event it reads (notify.Announcer), to a real
    server: spike, rollback, target and nan as they come, finished with the last step's loss."""
    from lmcockpit.core import protocol as P
    from lmcockpit.core.config import NotifyConfig
    from lmcockpit.core.process.notify import Announcer, Notifier
    from lmcockpit.core.run.state import RunState

    for name, value in NO_PROXY.items():
        monkeypatch.setenv(name, value)
    server = Server()
    try:
        run = RunState()  # what the owner of the engine keeps: where the run stands
        word = Announcer(Notifier(NotifyConfig(webhook=server.url), "run-a"), run)
        for event in (P.StepMetrics(41, 3.5, 1e-3, 1.0, 1e3, None, 0.1, 0, {}), P.SpikeSeen(42, 141.0, "rollback", 3.5, 120.0, 1.0, None),
                      P.RolledBack(42, 40, 2, 1, 0.5, 100), P.LogLine("not news"), P.TargetReached(60, "val_loss", 3.1, 3.2, 3725.0),
                      P.NonFinite(61, "skip"), P.StepMetrics(80, 3.0, 1e-3, 1.0, 1e3, None, 0.1, 0, {})):
            run.apply(event)
            word.heard(event)
        word.stalled("no word for 11 min")
        word.ended(P.FINISHED, None)
        assert events(server) == [
            {"event": "spike", "run": "run-a", "step": 42, "loss": 141.0, "action": "rollback"},
            {"event": "rollback", "run": "run-a", "step": 42, "to_step": 40},
            {"event": "target", "run": "run-a", "step": 60, "what": "val_loss", "value": 3.1, "target": 3.2,
             "after": "1:02:05"},  # the run's training time then (#51, 11)
            {"event": "nan", "run": "run-a", "step": 61, "action": "skip"},
            {"event": "stalled", "run": "run-a", "step": 80, "detail": "no word for 11 min"},
            {"event": "finished", "run": "run-a", "step": 80, "loss": 3.0}]
    finally:
        server.stop()


def test_a_config_keeps_its_file_private_only_where_notify_holds_a_url(tmp_path):
    from lmcockpit.core.run.folder import write_config
    from tests.helpers import tiny_config

    for setting, mode in [("notify.webhook=\"env:HOOK\"", 0o644), ("notify.ntfy=\"https://ntfy.sh/SECRET\"", 0o600),
                          ("notify.apprise=[\"discord://1/SECRET\"]", 0o600), ("notify.terminal=true", 0o644)]:
        path = tmp_path / "config.toml"
        write_config(tiny_config(setting), path)
        assert stat.S_IMODE(path.stat().st_mode) == mode & ~0o022, setting

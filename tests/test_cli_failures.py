"""What goes wrong around a run, as a user meets it through the real command: hang-ups under
nohup, runs that fail at their start (in the foreground or detached), closed pipes, damaged
files, Ctrl-C and hosts that never answer. Real processes, real files; waits poll the state they
wait for, with deadlines."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.process import host, live, viewer
from lmcockpit.core.process.viewer import RunViewer
from lmcockpit.core.run.folder import create_run_dir
from lmcockpit.tui.app import CockpitApp

from . import helpers
from .helpers import (
    NO_GPU, TINY, as_flags, cli, dashboard, engines_of, last_step, request, run_server, stop, tiny_config, wait_for, wait_until,
)


def cli_popen(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lmcockpit.tui.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def read_until(proc: subprocess.Popen, prefix: str) -> bool:
    """Read the command's stdout up to a line starting with `prefix`; False if it ended first."""
    for line in proc.stdout:
        if line.startswith(prefix):
            return True
    return False


# ----------------------------------------------------------------------------------- nohup
@pytest.mark.slow
def test_a_run_started_with_hang_ups_ignored_trains_on_through_one(tmp_path):
    """`nohup lmcockpit --run ... &` and the SSH session drops: the hang-up reaches the whole job,
    front-end and engine, and both leave it ignored, as nohup asked."""
    out = tmp_path / "run"
    proc = cli_popen("--run", "debug", *as_flags([*TINY, "training.max_steps=100000", "eval.every=0"]),
                     "--out", str(out), start_new_session=True,
                     preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        assert read_until(proc, "step 4/"), proc.stderr.read()
        os.killpg(proc.pid, signal.SIGHUP)
        assert read_until(proc, "step 16/"), "the run stopped after the hang-up"
        proc.send_signal(signal.SIGTERM)  # still running: stopped here, in order
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "SIGHUP" not in rest + err + (out / "train.log").read_text()
    assert "SIGTERM: finishing this step" in rest


# ------------------------------------------------------------- runs refused at their start
def damage_weights(ckpt: Path) -> None:
    (ckpt / "train_state" / "__0_0.distcp").write_bytes(b"\x00" * 64)


@pytest.mark.slow
@pytest.mark.parametrize("damage, flags, message", [
    (None, ["--gpu", "0"], "no usable CUDA GPU"),  # refused before the data is prepared
    (damage_weights, [], "does not fit this model or is damaged"),  # after: the tokenizer was copied
])
def test_a_checkpoint_continued_into_a_new_folder_and_refused_leaves_no_folder(trained_run, tmp_path, damage,
                                                                              flags, message):
    """The folder --out made for the continuation is removed, so the corrected command can have it."""
    run, _ = trained_run
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run / "checkpoints" / "step_000006", ckpt)
    if damage:
        damage(ckpt)
    out = tmp_path / "rb"
    proc = cli("--run", "--resume", str(ckpt), "--out", str(out), *flags, env=NO_GPU)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stdout + proc.stderr
    assert not out.exists(), sorted(p.name for p in out.iterdir())


@pytest.mark.slow
def test_a_run_resumed_in_place_and_refused_is_left_as_it_was(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run[0], run)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    proc = cli("--run", "--resume", str(run), "--set", "training.max_steps=14", "--gpu", "0", env=NO_GPU)
    assert proc.returncode == 2 and "no usable CUDA GPU" in proc.stderr, proc.stderr
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


# ------------------------------------------------------------------------- detached runs
@pytest.mark.slow
def test_a_detached_run_that_fails_at_its_start_says_why_and_leaves_nothing(tmp_path):
    """A mistyped data source: the engine's own message and exit 2, as in the foreground, not
    'training in the background' for a run that is gone; the same --out is free again."""
    out = tmp_path / "run"
    proc = cli("debug", "--detach", *as_flags([*TINY, 'data.source="./typo.txt"']), "--out", str(out), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "error: data.source = './typo.txt': no such file or folder" in proc.stderr
    assert "training in the background" not in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
    assert not out.exists(), sorted(p.name for p in out.iterdir())


@pytest.mark.slow
def test_a_host_whose_starter_is_gone_before_it_serves_runs_on_and_can_be_attached(tmp_path):
    """Ctrl-C while --detach starts the host: nobody reads the host's report any more. The run
    goes on, listed live and attachable, rather than a host dead of a broken pipe whose run `ps`
    lists as dead."""
    run = create_run_dir(tiny_config("training.max_steps=100000", "eval.every=0"), "debug", str(tmp_path / "run"))
    r, w = os.pipe()
    os.close(r)  # as the front-end's Ctrl-C left it
    proc = host.spawn(run, None, None, "debug", w)
    os.close(w)
    try:
        wait_until(lambda: last_step(run) >= 2 or proc.poll() is not None, what="steps, or the host's end")
        assert proc.poll() is None, (run / host.HOST_LOG).read_text()
        assert live.is_live(live.LiveRecord.read(run))
        viewer = RunViewer(run)
        viewer.close()
    finally:
        stop(run)
        proc.wait(timeout=60)


def test_attaching_again_right_after_detaching_finds_the_handshake_whole(tmp_path):
    """`lmcockpit attach` checks the run with one connection, closes it and opens the cockpit's:
    the first one's receiving thread, still reading the catch-up's history, must not take the
    second one's handshake."""
    (tmp_path / "train.log").write_text("a log line of a long run\n" * 20000)  # a catch-up that takes a while
    server = run_server(tmp_path)
    try:
        for _ in range(30):
            RunViewer(tmp_path).close()
    finally:
        server.close(grace=1)


# ------------------------------------------------------------------------------------ chat
def session_processes(sid: int) -> list[psutil.Process]:
    """The processes still in session `sid`: what a command started in a session of its own left."""
    left = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
    return left


@pytest.mark.slow
def test_chat_whose_reader_is_gone_stops_quietly_and_leaves_no_engine(trained_run):
    """`lmcockpit chat RUN --prompt X | head -c 20`: the reader is gone (here, before the first
    word): no traceback, the interrupted exit, and the chat engine ends with the command."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "lmcockpit.tui.cli", "chat", str(trained_run[0]), "--prompt",
                                 "def f(", "--max-new-tokens", "400"], stdout=write, stderr=subprocess.PIPE,
                                text=True, start_new_session=True, env={**os.environ, **NO_GPU})
    finally:
        os.close(write)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    deadline = time.monotonic() + 30
    while left := session_processes(proc.pid):
        assert time.monotonic() < deadline, f"left running: {[p.cmdline() for p in left]}"
        time.sleep(0.05)  # polling the processes waited for, not standing in for it


# --------------------------------------------------------------------------- damaged files
@pytest.mark.slow
@pytest.mark.parametrize("command", [
    lambda ckpt, t: ["chat", str(ckpt), "--prompt", "x"],
    lambda ckpt, t: ["export", str(ckpt), str(t / "hf")],
    lambda ckpt, t: ["--run", "--resume", str(ckpt), "--out", str(t / "r")],
], ids=["chat", "export", "resume"])
def test_a_checkpoint_whose_state_is_not_text_is_named_damaged(trained_run, tmp_path, command):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained_run[0] / "checkpoints" / "step_000006", ckpt)
    (ckpt / "state.json").write_bytes(b"\xff\xfe\x00garbage")
    proc = cli(*command(ckpt, tmp_path), env=NO_GPU)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "state.json is unreadable" in proc.stderr and "the checkpoint is damaged" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_attach_with_a_key_that_is_not_text_is_refused_with_a_message(tmp_path):
    server = run_server(tmp_path)
    try:
        (tmp_path / live.KEY).write_bytes(b"\xff\xfe\x00garbage")
        proc = cli("attach", str(tmp_path), timeout=60)
    finally:
        server.close(grace=1)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "the run's host refused this key" in proc.stderr and "Traceback" not in proc.stderr


def silent_host(run: Path) -> socket.socket:
    """What a frozen host looks like from outside: live.json and live.key say where, the socket
    accepts, and no word ever comes."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(run / live.SOCKET))
    listener.listen()
    (run / live.KEY).write_text("0" * 64 + "\n")
    live.LiveRecord(str(run.resolve()), os.getpid(), socket.gethostname(), str(run / live.SOCKET)).write()
    return listener


def test_attaching_to_a_host_that_never_answers_gives_up_with_a_message(tmp_path, monkeypatch):
    monkeypatch.setattr(viewer, "HANDSHAKE_TIMEOUT", 0.5)
    listener = silent_host(tmp_path)
    raised: list[BaseException] = []

    def attach() -> None:
        try:
            RunViewer(tmp_path)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            raised.append(e)

    attempt = threading.Thread(target=attach, daemon=True)
    try:
        attempt.start()
        attempt.join(30)
        assert not attempt.is_alive(), "still waiting for the handshake after 30 s"
    finally:
        listener.close()
    assert len(raised) == 1 and isinstance(raised[0], viewer.NotLive), raised
    assert "did not answer within" in str(raised[0])


@pytest.mark.slow
def test_ctrl_c_while_attach_waits_for_the_host_exits_130_without_a_traceback(tmp_path):
    listener = silent_host(tmp_path)
    listener.settimeout(60)
    proc = helpers.cli_popen("attach", str(tmp_path))
    try:
        conn, _ = listener.accept()  # connected: the command now waits for the host's first word
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        conn.close()
    finally:
        listener.close()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err


@pytest.mark.slow
def test_ctrl_c_while_doctor_checks_exits_130_without_a_traceback():
    proc = cli_popen("doctor", start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not any("lmcockpit.core.hardware.doctor" in " ".join(c.cmdline())
                      for c in psutil.Process(proc.pid).children()):
            assert proc.poll() is None and time.monotonic() < deadline, "the torch check never started"
            time.sleep(0.02)  # polling the state waited for, not standing in for it
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the terminal's whole process group
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130 and "Traceback" not in err, err


# ------------------------------------------------------------------ the cockpit's exit code
@pytest.mark.slow
async def test_quitting_the_cockpit_after_its_run_failed_exits_1(tmp_path):
    app = CockpitApp(request(tmp_path, "optimizer.lr=1e30", "optimizer.muon_lr=1e30", "training.grad_clip=0"),
                     telemetry=False)
    async with app.run_test(size=(120, 40)) as pilot:
        dash = dashboard(app)
        await wait_for(pilot, lambda: dash.view.state == P.FAILED, what="the run to fail")
        await pilot.press("q")  # nothing running: q quits at once
    assert app.exit_code == 1


def test_a_sessions_exit_code_is_its_worst_outcome():
    from lmcockpit.tui.app import exit_code_of
    from lmcockpit.core.run.state import RunState

    def ended(state: str, failure: P.Failure | None = None) -> RunState:
        view = RunState()
        if failure:
            view.apply(failure)
        view.apply(P.StateChanged(state))
        return view

    finished, aborted, training = ended(P.FINISHED), ended(P.ABORTED), RunState()
    interrupted, failed = ended(P.INTERRUPTED), ended(P.FAILED, P.Failure("non-finite loss"))
    refused = ended(P.FAILED, P.Failure("data.source: no such file", user_error=True))
    assert exit_code_of([]) == exit_code_of([finished, aborted, training]) == 0
    assert exit_code_of([finished, interrupted]) == 130
    assert exit_code_of([interrupted, refused]) == 2
    assert exit_code_of([refused, failed, finished]) == 1


# --------------------------------------------------------------- a host ending as a resume starts
@contextlib.contextmanager
def served_apart(run: Path):
    """A second run host's server on `run`, in a process of its own as a resumed run's host is (a
    viewer attaches only to the process live.json names): yields (its pid, socket path, key)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: serve until killed
        try:
            os.close(r)
            server = host.RunServer(run, on_command=lambda c: None, log=lambda text: None)
            os.write(w, json.dumps([str(server.path), server.key.decode()]).encode())
            os.close(w)
            while True:
                signal.pause()
        finally:
            os._exit(1)
    os.close(w)
    try:
        with os.fdopen(r) as said:  # until the child has written and closed its end (or died)
            path, key = json.loads(said.read())
        yield pid, path, key.encode()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


@pytest.mark.slow
def test_a_host_ending_leaves_the_files_of_a_run_resumed_meanwhile(tmp_path):
    """The old host removes its socket, live.json, live.key and registry pointer as its engine
    ends; a resume started then has written its own at the same places, and must stay listed and
    attachable."""
    old = run_server(tmp_path)
    live.register(tmp_path)
    with served_apart(tmp_path) as (pid, path, key):  # a new key, a new socket at the same path
        resumed = live.LiveRecord(str(tmp_path.resolve()), pid, socket.gethostname(), path)
        resumed.write()
        live.register(tmp_path)
        try:
            host.stop_serving(tmp_path, old)
            assert live.LiveRecord.read(tmp_path) == resumed
            assert live.read_key(tmp_path) == key
            RunViewer(tmp_path).close()  # the resumed run's host answers, at the same path
            assert [r.live for r in live.live_runs() if r.run_dir == tmp_path.resolve()] == [True]
        finally:
            live.forget(tmp_path)


def test_a_host_ending_alone_removes_all_it_wrote(tmp_path):
    server = run_server(tmp_path)
    live.register(tmp_path)
    host.stop_serving(tmp_path, server)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("live.")]
    assert all(r.run_dir != tmp_path.resolve() for r in live.live_runs())
    assert not list(live.state_home().glob(f"{live.run_key(tmp_path)}.json"))


# ------------------------------------------------------------------ Ctrl-C before the first step
@pytest.mark.slow
def test_ctrl_c_while_the_run_prepares_says_when_it_will_stop(tmp_path):
    """The engine hears commands between steps only: a Ctrl-C while it prepares is answered once
    the preparation is done, before any step, and the user is told so rather than promised a
    checkpoint."""
    def engine_started() -> bool:
        """The engine exists and the front-end takes SIGINT again: it ignores it while it starts
        the engine (runner._sigint_ignored), and a Ctrl-C then is lost to both."""
        status = Path(f"/proc/{proc.pid}/status").read_text()
        ignored = int(re.search(r"^SigIgn:\s*([0-9a-f]+)", status, re.M).group(1), 16)
        return (not ignored & 1 << (signal.SIGINT - 1)
                and engines_of(proc.pid))

    out = tmp_path / "run"
    proc = cli_popen("--run", "debug", *as_flags(TINY), "--out", str(out))
    try:
        deadline = time.monotonic() + 60
        while not engine_started():  # and only just: it prepares for seconds (torch's import alone)
            assert proc.poll() is None and time.monotonic() < deadline, "the engine never started"
            time.sleep(0.02)  # polling the state waited for, not standing in for it
        proc.send_signal(signal.SIGINT)
        out_text, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "SIGINT: stopping before the first step; the data prepared so far is kept" in out_text
    assert "step 1/" not in out_text and "interrupted at step 0" in out_text


@pytest.mark.slow
def test_a_stop_while_the_data_is_tokenised_ends_the_run_there_and_the_next_resumes_it(tmp_path):
    """Preparing a real corpus takes minutes to hours: an Abort (Ctrl-C, SIGTERM, the cockpit's
    stop) is heard at the build's next progress tick, not after it. The real Trainer, its real
    build, told to stop by the same callable the engine's command queue is, once tokenising began."""
    import json as _json

    import torch

    from lmcockpit.core.data.prepare import prepare
    from lmcockpit.core.train.trainer import Trainer

    rng = random.Random(0)
    words = [f"w{i}" for i in range(2000)]
    # Long enough to tokenise past the trainer's 0.2 s between polls for commands after the first
    # tick: 2 MB took less than that on a fast machine, and the stop was heard only at the end.
    with open(tmp_path / "corpus.jsonl", "w") as fh:
        for _ in range(15000):
            fh.write(_json.dumps({"text": " ".join(rng.choices(words, k=120))}) + "\n")
    cfg = tiny_config(f'data.source="{tmp_path / "corpus.jsonl"}"', "data.workers=1", "data.shard_bytes=100_000",
                      "data.max_bytes=0", "tokenizer.train_bytes=200_000")
    events, lines, told = [], [], []

    def next_command(block: bool):  # a queue's: the Abort is taken once
        # Past a few pieces (100 kB each): a stop heard within the first piece leaves none to resume
        # from, which a loaded machine's slower first piece made the case now and then.
        tokenising = [e for e in events if isinstance(e, P.Progress) and e.phase == "tokenizing" and e.done > 300_000]
        if tokenising and not told:
            told.append(True)
            return P.Abort(save=True, interrupted=True)
        return None

    trainer = Trainer(cfg, create_run_dir(cfg, "test", str(tmp_path / "run")), events.append, lines.append,
                      next_command)
    try:
        assert trainer.run() == P.INTERRUPTED
    finally:
        trainer.close()
        torch.use_deterministic_algorithms(False)  # the trainer set it for this whole process
    done = [e for e in events if isinstance(e, P.Progress) and e.phase == "tokenizing"]
    assert done[-1].done < done[-1].total, "stopped only once the data was prepared"
    assert not hasattr(trainer, "model") and not any(isinstance(e, P.RunStarted) for e in events)
    assert "stopped while setting up, before the first step: nothing to save" in lines

    again = []
    prepare(cfg, again.append, lambda *a: None)
    resumed = [line for line in again if "resuming an interrupted preparation" in line]
    assert resumed and not resumed[0].startswith("data: resuming an interrupted preparation: 0 of"), again


def test_a_long_failure_reaches_detach_as_one_whole_line():
    """The host's last word is one write into a non-blocking pipe: past PIPE_BUF it could be cut
    midway, and --detach would read half a JSON object. A long message is shortened to fit."""
    from lmcockpit.core.process.report import StartReport

    r, w = os.pipe()
    message = "data.source = '" + "ü" * 3000 + "': no such file or folder"  # JSON: 6 bytes per ü
    StartReport(w).ended(P.FAILED, P.Failure(message, user_error=True))
    with os.fdopen(r, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    said = json.loads(lines[-1])
    assert said["ended"] == P.FAILED and said["user_error"] is True
    assert message.startswith(said["message"]) and len(said["message"]) > 400
    assert len(lines[-1]) + 1 <= select.PIPE_BUF

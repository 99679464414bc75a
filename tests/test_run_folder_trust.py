"""A run folder another account can write to (#39): what lmcockpit reads there, writes there and
connects to from there. Real files, real sockets, a real second account (tests/other_account.py:
CI runs as root, and `nobody` plays the other user).

* attach trusts `live.json` and `live.key` only as the user's own, unlinked, unshared files, and
  the socket only when the kernel says its holder is the user's run host: a planted pair once ran
  code as the attaching user (a pickle sent through the socket);
* the host hangs up on a process of another uid before the handshake;
* each file written whole goes through a fresh name, each log or lock is opened without following
  a link: a link planted at a guessable name once had another file of the user's overwritten;
* the socket's fallback folder in /tmp is never one someone else made first;
* a damaged or planted `live.json` or `metrics.jsonl` is listed as unreadable, never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import stat
import tempfile
from multiprocessing import connection
from pathlib import Path

import pytest
from textual.widgets import DataTable

from lmcockpit.core import protocol as P
from lmcockpit.core.config import ConfigError
from lmcockpit.core.hardware import cpu_precision
from lmcockpit.core.process import host, live
from lmcockpit.core.process.runner import EngineProcess
from lmcockpit.core.process.viewer import NotLive, RunViewer
from lmcockpit.core.process.host import run_so_far
from lmcockpit.core.run.folder import (LOCK, METRICS, TRAIN_LOG, UNREADABLE, MetricsLog, create_run_dir, hold_run_dir,
                                      read_metrics, run_summary, write_config)
from lmcockpit.core.run.resume import truncate_metrics
from lmcockpit.core.run.safe_files import NotOwnFile, current_umask, write_whole
from lmcockpit.tui.app import CockpitApp
from lmcockpit.tui.formatting import DASH
from lmcockpit.tui.screens.launch import LaunchScreen

from .helpers import PINNED_FP32, cli, tiny_config
from .other_account import held_by_other, other_account, run_as_other

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

VICTIM = "a file of the user's that a planted link points to\n"


@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text(VICTIM)
    return path


@pytest.fixture
def reachable() -> Path:
    """A folder in /tmp that another account can enter (pytest's tmp_path is under a 0700 folder)."""
    path = Path(tempfile.mkdtemp(prefix="lmcockpit-trust-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def serve(run: Path, pid: int | None = None) -> host.RunServer:
    """A run host's server on `run`, and the live.json that points viewers to it (naming `pid`,
    this process's by default): the host's socket and handshake for real, without an engine."""
    (run / TRAIN_LOG).touch()
    server = host.RunServer(run, on_command=lambda c: None, log=lambda text: None, run=host.run_so_far(run))
    live.LiveRecord(str(run.resolve()), pid or os.getpid(), socket.gethostname(), str(server.path)).write()
    return server


def one_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


# --------------------------------------------------------------------- live.json and live.key
def plant(path: Path, how: str) -> None:
    """`path` (the user's own file) made what another account could leave there."""
    if how == "another account's":
        pw = other_account()
        os.chown(path, pw.pw_uid, pw.pw_gid)
    elif how == "writable by others":
        path.chmod(0o666)
    else:  # a link to a file of the same content elsewhere
        elsewhere = path.parent / "elsewhere"
        elsewhere.mkdir(exist_ok=True)
        path.rename(elsewhere / path.name)
        path.symlink_to(elsewhere / path.name)


HOW = ["another account's", "writable by others", "a link"]
REASON = {"another account's": "owned by uid", "writable by others": "writable by other accounts",
          "a link": "symbolic link"}


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("name", [live.RECORD, live.KEY])
def test_attach_refuses_a_live_file_that_is_not_the_user_s_own(tmp_path, name, how):
    """The host behind it is real and would answer: the refusal is the file's, before connecting."""
    server = serve(tmp_path)
    try:
        plant(tmp_path / name, how)
        with pytest.raises(NotLive, match=f"cannot attach: .*{name}: .*{REASON[how]}"):
            RunViewer(tmp_path).close()
        assert server.count == 0
    finally:
        server.close(grace=1)


@pytest.mark.slow
@pytest.mark.parametrize("how", HOW)
def test_lmcockpit_attach_refuses_a_planted_live_json_in_one_line(tmp_path, how):
    live.LiveRecord(str(tmp_path.resolve()), os.getpid(), socket.gethostname(), str(tmp_path / live.SOCKET)).write()
    (tmp_path / live.KEY).write_text("0" * 64 + "\n")
    plant(tmp_path / live.RECORD, how)
    line = one_error_line(cli("attach", str(tmp_path), timeout=60))
    assert f"{live.RECORD}: " in line and REASON[how] in line and "refused" in line


class Planted:
    """What a hostile host sends: unpickled, it makes a folder, as whoever unpickles it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def hostile_host(path: str, key: bytes, ready: int, marker: str) -> None:
    """Run as another account: a socket at the path a planted live.json names, which passes the
    handshake with the planted key and sends a pickle that runs code where it is unpickled."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()  # the kernel records the listener's credentials here: nobody's
    os.write(ready, b"listening")
    while True:
        sock, _ = listener.accept()
        conn = connection.Connection(sock.detach())
        with contextlib.suppress(Exception):
            connection.deliver_challenge(conn, key)
            connection.answer_challenge(conn, key)
            conn.send(Planted(marker))
        conn.close()


@contextlib.contextmanager
def held_by_another_account(run: Path, reachable: Path):
    """A live.json and live.key of the user's own in `run`, naming a socket another account holds."""
    pw = other_account()
    theirs = reachable / "theirs"
    theirs.mkdir()
    os.chown(theirs, pw.pw_uid, pw.pw_gid)
    path, marker = str(theirs / "host.sock"), run / "unpickled"
    key = live.new_key(run)
    r, w = os.pipe()
    with held_by_other(hostile_host, path, key, w, str(marker)) as pid:
        os.close(w)
        ready, _, _ = select.select([r], [], [], 30)
        assert ready and os.read(r, 16) == b"listening", "the other account's socket did not listen"
        os.close(r)
        live.LiveRecord(str(run.resolve()), pid, socket.gethostname(), path).write()
        yield marker


@pytest.mark.slow
def test_attach_refuses_a_socket_another_account_holds_and_unpickles_nothing(tmp_path, reachable):
    with held_by_another_account(tmp_path, reachable) as marker:
        with pytest.raises(NotLive, match=f"held by a process of uid {other_account().pw_uid} .*attach refused"):
            RunViewer(tmp_path).close()
        one_error_line(cli("attach", str(tmp_path), timeout=60))
    assert not marker.exists(), "what the other account's socket sent was unpickled"


def test_attach_refuses_a_socket_held_by_another_process_than_live_json_names(tmp_path):
    """The user's own process, but not the host live.json names (stale, or a reused path)."""
    server = serve(tmp_path, pid=os.getppid())
    try:
        with pytest.raises(NotLive, match=f"held by pid {os.getpid()}, not the run host live.json names"):
            RunViewer(tmp_path).close()
        assert server.count == 0
    finally:
        server.close(grace=1)


def knock(path: str) -> str:
    """Run as another account: connect to the host's socket and read what it says first."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(path)
        return sock.recv(4096).decode("latin-1")


def test_the_host_hangs_up_on_another_account_before_the_handshake(reachable):
    """The socket is opened to all for the test (its folder and file modes keep others out)."""
    run = reachable / "run"
    run.mkdir()
    logged: list[str] = []
    server = host.RunServer(run, on_command=lambda c: None, log=logged.append)
    try:
        server.path.chmod(0o666)
        run.chmod(0o755)
        said = run_as_other(knock, str(server.path))
        assert said == "", "the host said something to another account's process"
        refusal = f"refused a connection from a process of uid {other_account().pw_uid} "
        assert any(line.startswith(refusal) for line in logged), logged
        assert server.count == 0
        # the user's own viewers still get in
        live.LiveRecord(str(run.resolve()), os.getpid(), socket.gethostname(), str(server.path)).write()
        RunViewer(run).close()
    finally:
        server.close(grace=1)


@pytest.mark.parametrize("field, value", [
    ("pid", "4242"), ("pid", 0), ("pid", -1), ("pid", True), ("pid", 2 ** 40), ("step", 1.5), ("loss", "low"),
    ("eta_s", float("inf")), ("socket", "a\0b"), ("extra", 1),
])
def test_a_live_json_with_a_field_of_the_wrong_type_is_unreadable(tmp_path, field, value):
    record = live.LiveRecord(str(tmp_path), os.getpid(), socket.gethostname(), str(tmp_path / live.SOCKET))
    write_whole(tmp_path / live.RECORD, json.dumps({**record.__dict__, field: value}), mode=0o600)
    with pytest.raises(live.BadRecord):
        live.LiveRecord.load(tmp_path)
    assert live.LiveRecord.read(tmp_path) is None
    with pytest.raises(NotLive, match=f"cannot attach: .*{live.RECORD}: "):
        RunViewer(tmp_path)


@pytest.mark.slow
def test_ps_lists_a_live_json_whose_pid_is_text_as_unreadable_and_the_rest_as_ever(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # a registry of the test's own
    good, bad = (tmp_path / "good").resolve(), (tmp_path / "bad").resolve()
    for run in (good, bad):
        run.mkdir()
        live.LiveRecord(str(run.resolve()), os.getpid(), socket.gethostname(), str(run / live.SOCKET),
                        preset="debug").write()
        live.register(run)
    record = json.loads((bad / live.RECORD).read_text())
    write_whole(bad / live.RECORD, json.dumps({**record, "pid": str(record["pid"])}), mode=0o600)
    proc = cli("ps", timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split("\t")[:2] for line in lines if line.startswith(str(good))] == [[str(good), "debug"]]
    (listed,) = [line for line in lines if line.startswith(str(bad))]
    assert f"unreadable: {bad / live.RECORD}: pid of the wrong type" in listed


# ------------------------------------------------------------ files written whole, logs, the lock
def test_a_file_written_whole_takes_its_mode_less_the_umask_read_without_changing_it(tmp_path):
    """write_whole's mode is the caller's less the process's umask, which it reads from /proc
    rather than by setting it (for that moment another thread's new file would be unmasked)."""
    saved = os.umask(0o027)
    try:
        assert current_umask() == 0o027
        write_whole(tmp_path / "shared", "x")
        write_whole(tmp_path / "secret", "x", mode=0o600)
        assert os.umask(0o027) == 0o027  # left as it was
    finally:
        os.umask(saved)
    assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "secret").stat().st_mode) == 0o600


def test_live_key_goes_through_a_fresh_name_and_replaces_a_planted_link(tmp_path, victim):
    (tmp_path / f".{live.KEY}.tmp-{os.getpid()}").symlink_to(victim)  # the name it was once written under
    (tmp_path / live.KEY).symlink_to(victim)
    key = live.new_key(tmp_path)
    assert victim.read_text() == VICTIM
    st = os.lstat(tmp_path / live.KEY)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert live.read_key(tmp_path) == key


def test_config_toml_goes_through_a_fresh_name_and_replaces_a_planted_link(tmp_path, victim):
    (tmp_path / f".config.toml.tmp-{os.getpid()}").symlink_to(victim)
    (tmp_path / "config.toml").symlink_to(victim)
    write_config(tiny_config(), tmp_path / "config.toml")
    assert victim.read_text() == VICTIM
    assert stat.S_ISREG(os.lstat(tmp_path / "config.toml").st_mode)


def test_a_resume_s_truncated_metrics_go_through_a_fresh_name(tmp_path, victim):
    rows = [{"kind": "step", "step": s, "loss": 1.0} for s in (1, 2, 3)]
    (tmp_path / METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / f"{METRICS}.tmp").symlink_to(victim)  # the name it was once written under
    truncate_metrics(tmp_path / METRICS, 2)
    assert victim.read_text() == VICTIM
    assert [json.loads(line)["step"] for line in (tmp_path / METRICS).read_text().splitlines()] == [1, 2]


def test_the_cpu_precision_cache_goes_through_a_fresh_name(victim):
    path = cpu_precision.cache_path()
    planted = path.with_name(f".{path.name}.{os.getpid()}")  # the name it was once written under
    planted.symlink_to(victim)
    try:
        cpu_precision.store(PINNED_FP32)
        assert victim.read_text() == VICTIM
        assert cpu_precision.cached() == PINNED_FP32
    finally:
        planted.unlink()


def planted_link(run: Path, name: str, victim: Path) -> None:
    (run / name).symlink_to(victim)


@pytest.mark.parametrize("name", [LOCK, TRAIN_LOG, METRICS])
def test_a_link_at_the_lock_or_a_log_stops_a_training_with_a_message(tmp_path, victim, name):
    planted_link(tmp_path, name, victim)
    with pytest.raises(ConfigError, match=f"{name}: a symbolic link .*refused"):
        hold_run_dir(tmp_path)
    assert victim.read_text() == VICTIM


def test_a_lock_of_another_account_s_stops_a_training_with_a_message(tmp_path):
    pw = other_account()
    (tmp_path / LOCK).write_text("4242\n")
    os.chown(tmp_path / LOCK, pw.pw_uid, pw.pw_gid)
    with pytest.raises(ConfigError, match=f"{LOCK}: not a regular file of this user's"):
        hold_run_dir(tmp_path)
    assert (tmp_path / LOCK).read_text() == "4242\n"


@pytest.mark.slow
def test_the_metrics_log_and_a_dead_engine_s_record_never_write_through_a_link(tmp_path, victim):
    planted_link(tmp_path, METRICS, victim)
    with pytest.raises(NotOwnFile, match="symbolic link"):
        MetricsLog(tmp_path / METRICS)
    planted_link(tmp_path, TRAIN_LOG, victim)
    engine = EngineProcess(tiny_config(), tmp_path)
    engine.record_death("the engine process was killed by SIGKILL")  # what the front-end writes for it
    assert victim.read_text() == VICTIM


@pytest.mark.slow
def test_an_engine_refuses_a_link_at_train_log_and_says_so(tmp_path, victim):
    """The real engine process: a link planted after the folder was made, before the run starts."""
    run = create_run_dir(tiny_config(), "debug", str(tmp_path / "run"))
    planted_link(run, TRAIN_LOG, victim)
    engine = EngineProcess(tiny_config(), run)
    engine.start()
    events = []
    try:
        while not engine.done:
            if (event := engine.poll(timeout=1)) is not None:
                events.append(event)
    finally:
        engine.join(timeout=60)
        engine.kill()
    assert engine.final_state == P.FAILED and engine.failure is not None and engine.failure.user_error
    assert f"{TRAIN_LOG}: a symbolic link" in engine.failure.message
    assert victim.read_text() == VICTIM


def test_a_link_at_host_log_stops_the_host_with_a_message(tmp_path, victim):
    run = create_run_dir(tiny_config(), "debug", str(tmp_path / "run"))
    planted_link(run, host.HOST_LOG, victim)
    with pytest.raises(host.HostError, match=f"did not start: .*{host.HOST_LOG}: a symbolic link"):
        host.start_with_reports(run, timeout=30)
    assert victim.read_text() == VICTIM
    assert not (run / live.RECORD).exists()


# ----------------------------------------------------------------------- the socket's folder
@pytest.mark.parametrize("planted", ["another account's folder", "a link"])
def test_a_fallback_socket_folder_taken_first_neither_stops_a_run_nor_holds_its_socket(tmp_path, monkeypatch,
                                                                                       reachable, planted):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    tmp = reachable  # the test's own /tmp, short enough for a socket's path (tmp_path is not)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setenv("TMPDIR", str(tmp))
    taken = tmp / f"lmcockpit-{os.geteuid()}"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    if planted == "a link":
        taken.symlink_to(theirs)
    else:
        pw = other_account()
        taken.mkdir()
        os.chown(taken, pw.pw_uid, pw.pw_gid)
    run = tmp_path / ("a-run-folder-whose-path-is-too-long-for-a-unix-socket-" * 2)
    run.mkdir()
    server = serve(run)
    try:
        folder = server.path.parent
        assert folder.parent == tmp and folder.name.startswith(f"lmcockpit-{os.geteuid()}-"), server.path
        st = os.lstat(folder)
        assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700 and stat.S_ISDIR(st.st_mode)
        assert not list(theirs.iterdir()) and (planted == "a link" or not list(taken.iterdir()))
        RunViewer(run).close()  # it serves
    finally:
        server.close(grace=1)
    assert not folder.exists(), "the fresh folder made for this socket alone was left behind"


# ------------------------------------------------------------------ a metrics.jsonl not ours
def past_run(path: Path, *rows: dict) -> Path:
    path.mkdir(parents=True)
    (path / "config.toml").write_text("[training]\nmax_steps = 10\n")
    (path / METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


STEP = {"kind": "step", "time": 1.0, "step": 5, "loss": 4.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0,
        "mfu": None, "dt": 0.1, "mem": None}


async def test_the_cockpit_starts_with_a_run_whose_metrics_hold_a_bare_step_row(tmp_path):
    runs = tmp_path / "runs"
    good = past_run(runs / "good", STEP)
    bad = past_run(runs / "bad", {"kind": "step"})
    app = CockpitApp(runs_root=runs, telemetry=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        launch = app.screen
        assert isinstance(launch, LaunchScreen)
        table = launch.query_one("#runs", DataTable)
        shown = {key.value: [str(cell) for cell in table.get_row(key)] for key in table.rows}
        assert shown == {str(good): ["good", "5/10", "4.000", "stopped"],  # run, step, loss, status
                         str(bad): ["bad", DASH, DASH, "unreadable metrics.jsonl"]}


def test_an_attach_s_history_passes_over_rows_that_are_not_lmcockpit_s(tmp_path):
    past_run(tmp_path / "run", STEP, {"kind": "step"}, {**STEP, "step": "6"}, {**STEP, "step": 7, "mem": [1]}, {**STEP, "step": 8, "mem": {"peak": "1 GiB"}},
             {"kind": "eval", "step": 7}, {"kind": "checkpoint", "step": 8, "path": None}, {"kind": ["step"]},
             {**STEP, "step": 9})
    (read,) = [e.history for e in run_so_far(tmp_path / "run").catchup("attached") if isinstance(e, P.HistoryRead)]
    assert [r.step for r in read.recent()] == [5, 9] and read.checkpoints == [] and read.evals == []


# An evaluation of the validation loss, of the tasks (their own cadence: eval.tasks_every), of both.
VAL = {"kind": "eval", "time": 1.0, "step": 5, "val_loss": 3.41, "val_bpb": 1.2}
SCORES = {"python-functions": {"accuracy": 0.43, "centered": 0.24, "items": 111}}
TASKS = {"kind": "eval", "time": 1.0, "step": 6, "tasks": SCORES}
BOTH = {**VAL, "step": 8, "tasks": SCORES, "core": 0.12}


@pytest.mark.parametrize("row", [
    {**TASKS, "tasks": [SCORES]},
    {**TASKS, "tasks": {"python-functions": 0.43}},
    {**TASKS, "tasks": {"python-functions": {"accuracy": 0.43, "items": 111}}},
    {**TASKS, "tasks": {"python-functions": {**SCORES["python-functions"], "accuracy": "43%"}}},
    {**TASKS, "tasks": {"python-functions": {**SCORES["python-functions"], "items": 111.0}}},
    {**TASKS, "tasks": {"python-functions": {**SCORES["python-functions"], "items": True}}},
    {**BOTH, "core": "0.12"},
    {**VAL, "val_loss": "3.41"},
    {"kind": "eval", "time": 1.0, "step": 7},  # neither a validation loss nor scores: says nothing
    {**VAL, "val_loss": None, "val_bpb": None},
], ids=["tasks-a-list", "scores-a-number", "no-centered", "accuracy-text", "items-a-float", "items-a-bool",
        "core-text", "val-loss-text", "nothing-scored", "val-loss-null"])
def test_eval_rows_hold_a_validation_loss_task_scores_or_both_and_nothing_else_reads(tmp_path, row):
    """An evaluation row may lack the validation loss (a task-only row) or the tasks (a
    validation-only or older row): each reads. One whose scores are not numbers, or not the
    ones a task has, is not lmcockpit's: passed over, and the run listed as unreadable."""
    run = past_run(tmp_path / "run", STEP, VAL, TASKS, BOTH, {**STEP, "step": 9})
    assert [r["step"] for r in read_metrics(run, "eval")] == [5, 6, 8]
    assert run_summary(run)["status"] == "stopped"
    (run / METRICS).write_text("".join(json.dumps(r) + "\n" for r in (STEP, VAL, TASKS, row, {**STEP, "step": 9})))
    assert [r["step"] for r in read_metrics(run, "eval")] == [5, 6]
    assert run_summary(run)["status"] == UNREADABLE


def test_a_step_row_still_needs_its_own_fields_and_may_still_lack_mfu_and_mem(tmp_path):
    """What an eval row may lack, a step row may not, and the other way round."""
    bare = {k: v for k, v in STEP.items() if k not in ("mfu", "mem")}
    run = past_run(tmp_path / "run", bare, {k: v for k, v in {**STEP, "step": 7}.items() if k != "loss"},
                   {**VAL, "step": 8, "mfu": "x"})
    assert [(r["kind"], r["step"]) for r in read_metrics(run)] == [("step", 5), ("eval", 8)]


def test_an_attach_s_history_carries_task_scores_and_evaluations_without_a_validation_loss(tmp_path):
    run = past_run(tmp_path / "run", STEP, VAL, TASKS, BOTH, {**TASKS, "step": 9, "tasks": [SCORES]})
    (read,) = [e.history for e in run_so_far(run).catchup("attached") if isinstance(e, P.HistoryRead)]
    assert read.evals == [(5, 3.41, 1.2), (8, 3.41, 1.2)]
    assert read.tasks == {"python-functions": [(6, 0.43), (8, 0.43)]} and read.core == [(8, 0.12)]
    assert read.last_task_scores == SCORES

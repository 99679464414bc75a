"""A run host over a day of viewers coming and going (issue #43): its open files and threads come
back to what they were however the viewers leave, and what it keeps of the run does not grow
with it.

The churn is real: a run host (core/process/host.py) in a session of its own, its engine (paused,
so that two cores go to the viewers), the Unix socket. What the host holds is read where the
kernel keeps it, /proc/PID/fd and /proc/PID/task. The waits poll the state they wait for, with
deadlines."""

from __future__ import annotations

import os
import random
import resource
import socket
import time
from multiprocessing import AuthenticationError, connection

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.process import host, live
from lmcockpit.core.process.viewer import RunViewer
from lmcockpit.core.run.state import RunState
from lmcockpit.core.run.target import EVALS_KEPT, SPREAD, Evaluations, forecast_aim, spread

from .helpers import detached, stop, tiny_config, wait_until

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ATTACHES = 150  # viewers that attach and detach in order, a few at a time
ABRUPT = 12  # rounds of the ways a viewer leaves without detaching


def held(pid: int) -> tuple[int, int]:
    """(open descriptors, threads) of process `pid`, as the kernel counts them."""
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def connections(pid: int) -> int:
    """The sockets `pid` holds open, its listening one included (multiprocessing's queues to the
    engine are pipes, not sockets)."""
    fds = f"/proc/{pid}/fd"
    count = 0
    for fd in os.listdir(fds):
        try:
            count += os.readlink(f"{fds}/{fd}").startswith("socket:")
        except FileNotFoundError:
            pass  # closed while listed
    return count


def at_rest(run) -> tuple[int, int]:
    """What the run's host holds once no viewer is attached: live.json counts none, and no
    connection is open but the one it listens on."""
    pid = live.LiveRecord.read(run).pid
    wait_until(lambda: live.LiveRecord.read(run).viewers == 0, timeout=30, what="live.json to count no viewer")
    wait_until(lambda: connections(pid) == 1, timeout=30, what="the host to hold no connection but its listener")
    return held(pid)


def attached_lines(run) -> int:
    return (run / "train.log").read_text().count("host: a viewer attached (")


@pytest.fixture(scope="module")
def paused(tmp_path_factory):
    """A run in the background, paused: its engine idles, its host serves."""
    run = detached(tmp_path_factory.mktemp("churn"), "run")
    first = RunViewer(run)
    try:
        first.send(P.Pause())  # taken before its first step or between two: either way it idles
        wait_until(lambda: live.LiveRecord.read(run).state == P.PAUSED, what="the run to pause")
    finally:
        first.close()
    yield run
    stop(run)


@pytest.mark.slow
def test_viewers_coming_and_going_leave_the_hosts_descriptors_and_threads_as_they_were(paused):
    run = paused
    record = live.LiveRecord.read(run)
    before = at_rest(run)
    lines = attached_lines(run)

    attached = 0
    while attached < ATTACHES:  # 1, 2, 3, 4, 5 at once, over and over: cheap, as every detach is
        group = [RunViewer(run) for _ in range(attached % 5 + 1)]
        attached += len(group)
        for viewer in group:
            viewer.close()

    key = live.read_key(run)
    for _ in range(ABRUPT):
        # Connected, then gone before a word: a viewer killed as it started.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(record.socket)
        # Gone in the middle of the handshake, the host's challenge unanswered.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(record.socket)
            assert sock.recv(1)
        # The wrong key: refused.
        with pytest.raises(AuthenticationError):
            connection.Client(record.socket, family="AF_UNIX", authkey=b"not the key")
        # Attached, then gone without a detach and without reading what it was sent: killed.
        client = connection.Client(record.socket, family="AF_UNIX", authkey=key)
        attached += 1
        client.close()

    # Every viewer reached the host (it says so in train.log), so the churn above was real.
    wait_until(lambda: attached_lines(run) - lines == attached, timeout=30, what="every attach in train.log")
    pid = record.pid
    wait_until(lambda: live.LiveRecord.read(run).viewers == 0, timeout=30, what="live.json to count no viewer")
    # At most as many as before: a thread counted then may have been on its way out.
    try:
        wait_until(lambda: all(now <= then for now, then in zip(held(pid), before)), timeout=15,
                   what="the host's descriptors and threads to come back")
    except AssertionError:
        raise AssertionError(f"(descriptors, threads) of the host: {before} before {attached} viewers came "
                             f"and went, {held(pid)} after") from None
    assert live.is_live(live.LiveRecord.read(run))  # and it serves on


@pytest.mark.slow
def test_a_host_out_of_descriptors_says_so_serves_on_and_accepts_again_once_they_are_freed(paused):
    """`ulimit -n` reached (viewers by the hundred, a limit set low): attaching waits, and the host
    neither stops accepting for the rest of the run nor dies rewriting live.json meanwhile."""
    run = paused
    pid = live.LiveRecord.read(run).pid
    before = at_rest(run)
    watching = RunViewer(run)  # attached before: it hears of the shortage, which train.log cannot
    waiting: list[socket.socket] = []
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    try:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (3, hard))  # no descriptor more for it to open
        for _ in range(2):  # the accept under way may hold a number already: the second has none
            waiting.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            waiting[-1].connect(str(live.LiveRecord.read(run).socket))

        def told() -> bool:
            while (event := watching.poll(timeout=0.05)) is not None:
                if isinstance(event, P.LogLine) and "out of descriptors" in event.text:
                    return True
            return False

        wait_until(told, timeout=30, what="the viewer to hear that the host is out of descriptors")
        # The shortage lasts past a rewrite of live.json, which fails: the host must go on.
        time.sleep(1.5 * host.RECORD_EVERY)
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    try:
        late = RunViewer(run)  # accepted once there are descriptors again
        # And it went on: live.json, rewritten since, counts both. (A host whose loop had ended
        # would still accept, from its accept thread, while it waited for its engine at exit.)
        wait_until(lambda: live.LiveRecord.read(run).viewers == 2, timeout=30, what="live.json to count both viewers")
        late.close()
        wait_until(lambda: "host: accepting viewers again after" in (run / "train.log").read_text(), timeout=30,
                   what="the host to say it accepts again")
    finally:
        watching.close()
        for sock in waiting:
            sock.close()
    assert all(now <= then for now, then in zip(at_rest(run), before))


# ---------------------------------------------------------------------- in the host's process
def test_a_connection_that_never_proves_the_key_is_let_go(tmp_path, monkeypatch):
    """A process that connects and says nothing (frozen, or not a viewer at all) holds a thread
    and a descriptor of the host while it waits: for HANDSHAKE_LIMIT, not for the run's life."""
    monkeypatch.setattr(host, "HANDSHAKE_LIMIT", 0.5)
    (tmp_path / "train.log").touch()
    server = host.RunServer(tmp_path, on_command=lambda c: None, log=lambda text: None)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
            silent.settimeout(20)  # a failure, not a hang
            silent.connect(str(server.path))
            heard = b""
            while chunk := silent.recv(4096):  # the host's challenge, then its end closed: EOF
                heard += chunk
            assert b"#CHALLENGE#" in heard  # what the host asked, before it gave up waiting
        client = connection.Client(str(server.path), family="AF_UNIX", authkey=server.key)
        assert isinstance(client.recv(), P.Catchup)  # a viewer that answers is served as ever
        wait_until(lambda: server.count == 1, timeout=10, what="the viewer to join")
        server.broadcast(P.LogLine("later"))  # and, proven, has no time limit on what comes after
        assert client.poll(10) and client.recv() == P.LogLine("later")
        client.close()
    finally:
        server.close(grace=1)


def test_a_closed_server_leaves_no_thread_behind(tmp_path):
    (tmp_path / "train.log").touch()
    server = host.RunServer(tmp_path, on_command=lambda c: None, log=lambda text: None)
    client = connection.Client(str(server.path), family="AF_UNIX", authkey=server.key)
    wait_until(lambda: server.count == 1, timeout=10, what="the viewer to join")
    [viewer] = server.viewers
    server.close(grace=1)
    for thread in (server.acceptor, viewer.sender):
        thread.join(timeout=10)
        assert not thread.is_alive(), f"{thread.name} still runs after the server closed"
    client.close()


# -------------------------------------------------------------------- what it keeps of the run
def curve(step: int, rng: random.Random) -> float:
    """A validation loss as a run's falls: a power law in tokens to a floor, with noise."""
    return 2.0 + 40 * (step * 100) ** -0.25 * (1 + 0.003 * rng.gauss(0, 1))


def as_before(evals: list[tuple[int, float]], step: int, value: float) -> list[tuple[int, float]]:
    """What the host's Summary kept before Evaluations: every evaluation, a rolled-back run's cut."""
    return [(s, v) for s, v in evals if s < step] + [(step, value)]


def test_the_forecasts_evaluations_stay_bounded_over_a_hundred_thousand():
    rng = random.Random(7)
    kept, every, most = Evaluations(), [], 0
    for n in range(1, 100_001):
        step = n * 10
        value = curve(step, rng)
        kept.add(step, value)
        every.append((step, value))
        most = max(most, len(kept))
    assert SPREAD <= len(kept) and most == EVALS_KEPT
    picked, from_all = spread(kept.values()), spread(every)
    assert len(picked) == len(from_all) == SPREAD
    assert picked[0] == every[0] and picked[-1] == every[-1]  # the first and the latest, as ever
    # The rest evenly spread over the run still: each near the one a fit on all of them would take.
    assert max(abs(a[0] - b[0]) for a, b in zip(picked, from_all)) <= 1.5 * kept.stride * 10
    # And the forecast is the same but for the noise of which points: the one from all of them
    # inside this one's range, its step a few percent apart.
    for target in (2.3, 2.2):
        ours = forecast_aim(target, "", 0.0, kept.values(), 100, 10**9, 0.1)
        theirs = forecast_aim(target, "", 0.0, every, 100, 10**9, 0.1)
        assert ours.status == theirs.status == "expected"
        assert ours.step_low <= theirs.step <= ours.step_high
        assert abs(ours.step / theirs.step - 1) < 0.1, (ours.short(), theirs.short())
    # Rolled back past half the run, it keeps what it had before that step, and the new one.
    was = kept.values()
    kept.add(500_000, 2.5)
    assert kept.values() == [point for point in was if point[0] < 500_000] + [(500_000, 2.5)]


def test_up_to_its_bound_the_forecast_is_fitted_on_every_evaluation_as_before(tmp_path):
    """Rolled back twice (an evaluation at a step already evaluated cuts those after it): the very
    list the host kept before, so the very forecast, up to EVALS_KEPT evaluations."""
    rng = random.Random(3)
    kept, before = Evaluations(), []
    steps = [*range(10, 5010, 10), *range(1000, 6010, 10), *range(5000, 8010, 10)]  # two rollbacks
    for step in steps:
        value = curve(step, rng)
        kept.add(step, value)
        before = as_before(before, step, value)
        assert kept.values() == before
    assert len(before) < EVALS_KEPT < len(steps)

    # Summary, as the host runs it: live.json's forecast is the one from every evaluation.
    cfg = tiny_config("training.target_val_loss=2.3", "training.max_steps=1000000000")
    run = RunState()  # the host's fold, which its live.json summary reads
    run.apply(P.RunStarted(str(tmp_path), cfg.to_dict(), 1000, "cpu", "fp32", 0, cfg.training.max_steps,
                           cfg.tokens_per_step))
    run.pace.step_time = 0.1
    summary = host.Summary(live.LiveRecord(str(tmp_path), os.getpid(), "here", "sock"), run)
    some = before[::70]
    for event in [*(P.EvalMetrics(step, value, None) for step, value in some),
                  P.EvalMetrics(*some[-3], None)]:  # rolled back once more
        run.apply(event)
        summary.apply(event)
    again = some[:-2]
    ahead = forecast_aim(2.3, "", 0.0, again, cfg.tokens_per_step, cfg.training.max_steps, 0.1)
    assert run.aim.values() == again and ahead.status == "expected"
    assert summary.record.target == ahead.short(cfg.hardware.cost_per_hour)

"""Several processes on CPU (gloo), through the real launcher: torchrun's elastic agent started by
the engine process, DDP and FSDP2 ranks, DCP checkpoints. Every run here is the debug model for 10
steps; the runs are built once per module and the tests read what they left."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from pathlib import Path

import psutil
import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.process.launcher import first_failure, write_record
from lmcockpit.core.run.folder import METRICS, TRAIN_LOG
from tests.helpers import TINY, as_flags, cli, cli_popen, drive_engine, engine_of, losses, tiny_config

# Three eval batches over two ranks: under FSDP rank 1 must run a forward pass it does not count.
STEPS = ["training.max_steps=10", "eval.every=5", "eval.batches=3", "checkpoint.every=5", "training.log_every=1",
         "eval.tasks=[\"python-functions\"]", "eval.max_per_task=21",  # 21: the ranks' shares differ by one
         "logging.layer_stats_every=5"]
REL = 1e-5  # the bound; on this CPU the runs agree exactly


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= REL * abs(y) for x, y in zip(a, b))


def step_losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / METRICS).read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "step"}


def steer(engine, ev) -> None:
    """Pause before the first step, sample and checkpoint while paused, resume: every command goes
    through the ranks' agreement, and none of them may change what is trained. (The pause is
    sent while the engine prepares, long before it first reads commands, so it lands at step 0.)"""
    if isinstance(ev, P.StateChanged) and ev.state == P.PREPARING and not getattr(engine, "steered", False):
        engine.steered = True
        engine.send(P.Pause())
    elif isinstance(ev, P.StateChanged) and ev.state == P.PAUSED:
        engine.send(P.Sample("live", "def ", 8, 1.0, 0, seed=1))
    elif isinstance(ev, P.SampleText) and ev.request_id == "live" and ev.done:
        engine.send(P.CheckpointNow())  # still paused at step 0: nothing to save yet, and it must say nothing
        engine.send(P.Resume())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process × accumulation 4 (the reference), and 2 processes × accumulation 2 with DDP (on
    a token cache of its own, so it builds one) and with FSDP, each with a live sample at step 3.
    Accumulating on both sides: DDP skips its all-reduce on the first micro-batch of each step,
    FSDP reduce-scatters every one."""
    root = tmp_path_factory.mktemp("dist")
    out = {}
    out["one"] = drive_engine(tiny_config(*STEPS, "training.grad_accum_steps=4"), root / "one")
    two = (*STEPS, "distributed.nproc=2", "training.grad_accum_steps=2")
    out["ddp"] = drive_engine(tiny_config(*two, f"data.cache_dir=\"{root / 'cache'}\""), root / "ddp", on_event=steer)
    out["fsdp"] = drive_engine(tiny_config(*two, "distributed.strategy=\"fsdp\""), root / "fsdp", on_event=steer)
    return {name: (root / name, engine, events) for name, (engine, events) in out.items()}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_accumulating_two_give_the_losses_of_one_accumulating_four(runs, strategy):
    _, one, one_events = runs["one"]
    _, engine, events = runs[strategy]
    assert one.final_state == engine.final_state == P.FINISHED, engine.failure
    assert len(losses(events)) == 10 and close(losses(events), losses(one_events))
    val = [e.val_loss for e in events if isinstance(e, P.EvalMetrics)]
    assert close(val, [e.val_loss for e in one_events if isinstance(e, P.EvalMetrics)])
    started = next(e for e in events if isinstance(e, P.RunStarted))
    assert started.world == 2 and started.devices == ("cpu", "cpu")
    assert started.tokens_per_step == next(e for e in one_events if isinstance(e, P.RunStarted)).tokens_per_step


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_each_block_s_gradient_norm_and_update_ratio_are_those_of_one_process(runs, strategy):
    """DDP's gradients are all-reduced already; FSDP's blocks are sharded, their squares summed across ranks."""
    def records(events):
        return [(e.step, [*e.grad_norm, e.embed_grad_norm], [*e.update_ratio, e.embed_update_ratio])
                for e in events if isinstance(e, P.LayerStats)]

    one, two = records(runs["one"][2]), records(runs[strategy][2])
    assert [r[0] for r in two] == [r[0] for r in one] == [5, 10]
    assert all(close(a[1], b[1]) and close(a[2], b[2]) for a, b in zip(two, one)), (two, one)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_task_items_are_shared_across_ranks_and_the_choices_summed(runs, strategy):
    """Each rank scores every other item (11 and 10 of 21), under FSDP with as many forward
    passes as the other; the summed choices give the one-process run's scores exactly, as its
    weights are (this CPU's runs agree exactly: REL)."""
    def scores(run: Path) -> list[dict]:
        rows = [json.loads(line) for line in (run / METRICS).read_text().splitlines()]
        return [(r["step"], r["tasks"]["python-functions"]) for r in rows if r["kind"] == "eval"]

    one, two = scores(runs["one"][0]), scores(runs[strategy][0])
    assert [step for step, _ in two] == [5, 10] and all(s["items"] == 21 for _, s in two)
    assert two == one


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_commands_reach_every_rank(runs, strategy):
    run, _, events = runs[strategy]
    paused = next(i for i, e in enumerate(events) if isinstance(e, P.StateChanged) and e.state == P.PAUSED)
    assert paused < next(i for i, e in enumerate(events) if isinstance(e, P.StepMetrics))
    live = [e for e in events if isinstance(e, P.SampleText) and e.request_id == "live"]
    assert live and live[-1].done and all(e.step == 0 for e in live) and "".join(e.text for e in live)
    assert [e.step for e in events if isinstance(e, P.CheckpointWritten)] == [5, 10]
    assert [r for r in (run / METRICS).read_text().splitlines() if '"sample"' in r], "rank 0 records the sample"


@pytest.mark.slow
def test_the_token_cache_is_built_once_and_every_rank_maps_it(runs):
    run, _, _ = runs["ddp"]
    log = (run / TRAIN_LOG).read_text()
    assert len(re.findall(r"^rank0: data: token cache written to ", log, re.M)) == 1
    assert len(re.findall(r"^rank1: data: reusing token cache ", log, re.M)) == 1
    assert "token cache written" not in log.replace("rank0: data: token cache written", "")
    caches = [p for p in (run.parent / "cache").iterdir() if not p.name.startswith(".")]
    assert len(caches) == 1


@pytest.mark.slow
def test_every_rank_logs_with_its_rank_and_only_rank_0_writes_metrics(runs):
    run, _, events = runs["fsdp"]
    log = (run / TRAIN_LOG).read_text()
    for rank in (0, 1):
        assert re.search(rf"^rank{rank}: model: .* 2 processes \(fsdp\)", log, re.M)
        assert any(isinstance(e, P.LogLine) and e.text.startswith(f"rank{rank}: ") for e in events)
    steps = [json.loads(r) for r in (run / METRICS).read_text().splitlines() if '"kind": "step"' in r]
    assert [r["step"] for r in steps] == list(range(1, 11))  # once each: not once per rank


@pytest.mark.slow
def test_a_run_saved_by_two_processes_resumes_on_one(runs, tmp_path):
    run, _, _ = runs["ddp"]
    proc = cli("--run", "--resume", str(run / "checkpoints" / "step_000005"), "--set", "distributed.nproc=1",
               "--out", str(tmp_path / "one"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "saved by 2 process(es), continuing on 1 with 4 accumulation step(s)" in proc.stdout
    resumed, original = step_losses(tmp_path / "one"), step_losses(run)
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    assert close([resumed[s] for s in resumed], [original[s] for s in resumed])


@pytest.mark.slow
def test_a_run_saved_by_one_process_resumes_on_two_sharded(runs, tmp_path):
    run, _, _ = runs["one"]
    proc = cli("--run", "--resume", str(run / "checkpoints" / "step_000005"), "--nproc", "2",
               "--set", "distributed.strategy=\"fsdp\"", "--out", str(tmp_path / "two"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank1: resumed from" in proc.stdout and "continuing on 2 with 2 accumulation step(s)" in proc.stdout
    resumed, original = step_losses(tmp_path / "two"), step_losses(run)
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    assert close([resumed[s] for s in resumed], [original[s] for s in resumed])


@pytest.mark.slow
def test_a_process_count_that_cannot_share_the_step_is_refused(runs, tmp_path):
    run, _, _ = runs["ddp"]  # 2 processes × 2: four micro-batches a step, which 3 cannot share
    proc = cli("--run", "--resume", str(run / "checkpoints" / "step_000005"), "--nproc", "3",
               "--out", str(tmp_path / "three"))
    assert proc.returncode == 2 and "3 process(es) cannot share them evenly" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--nproc", "0"], "--nproc 0: expected 1 or more"),
    (["--nnodes", "2"], "the machines need a meeting point; give --rdzv-endpoint"),
    (["--nnodes", "2", "--rdzv-endpoint", "node0:29500", "--node-rank", "2"], "--node-rank 2: expected 0 to 1"),
    (["--nproc", "2", "--gpu", "1"], "names one GPU, but distributed.nproc = 2"),
    (["--nproc", "2", "--rdzv-backend", "zk"], "--rdzv-backend zk: expected one of c10d, static"),
    (["--nnodes", "2", "--rdzv-endpoint", "node0", "--node-rank", "1"], "--rdzv-endpoint node0: expected HOST:PORT"),
])
def test_bad_launch_flags_exit_2(tmp_path, args, message):
    proc = cli("--run", "debug", *args, "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------ teardown
@pytest.mark.slow
def test_a_killed_rank_ends_the_whole_run_naming_it(tmp_path):
    """SIGKILL rank 1 mid-run: the run ends by itself (exit 1) with every process of it gone, and
    the message names rank 1 first (not rank 0, which only lost its peer). The deadline is a
    ceiling for a hang, far above the few seconds this takes on an idle machine."""
    proc = cli_popen("--run", "debug", "--nproc", "2",
                     *as_flags([*TINY, "training.max_steps=100000", "eval.every=0", "training.log_every=1"]),
                     "--out", str(tmp_path / "run"))
    pids = {}
    for line in proc.stdout:
        if m := re.match(r"(rank\d: )?lmcockpit .* \| pid (\d+)$", line.strip()):
            pids[(m.group(1) or "engine").strip(": ")] = int(m.group(2))
        if line.startswith("step 3/"):
            break
    assert set(pids) == {"engine", "rank0", "rank1"}, pids
    os.kill(pids["rank1"], signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=180)
    finally:  # a run that hangs must not outlive the test
        for pid in [proc.pid, *pids.values()] if proc.poll() is None else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 1, err
    assert "run failed: rank 1 failed first: the process" in err and "SIGKILL" in err, err
    for name, pid in pids.items():
        assert not _running(pid), f"{name} (pid {pid}) is still running"
    assert "rank 1 failed first" in (tmp_path / "run" / METRICS).read_text()


def _blocked(pid: int) -> int:
    """The process's mask of blocked signals."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^SigBlk:\s*([0-9a-f]+)", status, re.M).group(1), 16)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_failure_names_the_rank_that_failed_first(tmp_path):
    """A rank that lost its peer fails too, sometimes earlier by the clock: it is named after."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    write_record(tmp_path, 0, "RuntimeError: [gloo] Read error: Connection reset by peer", secondary=False)
    killed = ProcessFailure(local_rank=1, pid=4242, exitcode=-9, error_file="<N/A>")
    failure = first_failure({1: killed}, tmp_path)
    assert failure.message.startswith("rank 1 failed first: the process (pid 4242) was killed by SIGKILL")
    assert "then rank 0: RuntimeError: [gloo]" in failure.message and not failure.user_error


def test_a_real_error_beats_a_stop_and_user_errors_stay_user_errors(tmp_path):
    write_record(tmp_path, 1, "did not stop within 20 s of SIGTERM", secondary=True)
    write_record(tmp_path, 0, "ValueError: bad things", "Traceback ...")
    failure = first_failure({}, tmp_path)
    assert failure.message.startswith("rank 0 failed first: ValueError: bad things")
    assert failure.traceback == "Traceback ..."
    for f in tmp_path.iterdir():
        f.unlink()
    for rank in (0, 1):
        write_record(tmp_path, rank, "--resume x: the checkpoint is damaged", user_error=True)
    failure = first_failure({}, tmp_path)
    assert failure.user_error and failure.message == "--resume x: the checkpoint is damaged"


@pytest.mark.slow
def test_two_machines_meet_through_the_rendezvous_and_share_one_run_folder(tmp_path):
    """Two "machines" on localhost, one process each: torchrun's c10d rendezvous joins them into
    one run of two ranks, both write the one run folder, and its checkpoint resumes on one."""
    port = free_port()
    out = tmp_path / "shared"
    args = ["--run", "debug", *as_flags([*TINY, *STEPS]), "--nproc", "1", "--nnodes", "2",
            "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "shared-run", "--out", str(out)]
    nodes = [cli_popen(*args, "--node-rank", str(k)) for k in (0, 1)]
    results = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], results
    stdout = "".join(o for o, _ in results)
    assert "finished 10 steps" in stdout and "rank 0's machine reports the run" in stdout
    ckpt = out / "checkpoints" / "step_000010"
    assert sorted(p.name for p in (ckpt / "train_state").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    log = (out / TRAIN_LOG).read_text()
    assert "rank0: model:" in log and "rank1: model:" in log and "2 processes (ddp)" in log
    proc = cli("--run", "--resume", str(out / "checkpoints" / "step_000005"), "--set", "distributed.nnodes=1",
               "--out", str(tmp_path / "alone"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed, original = step_losses(tmp_path / "alone"), step_losses(out)
    assert close([resumed[s] for s in sorted(resumed)], [original[s] for s in sorted(resumed)])


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_rendezvous_flags_reach_torchrun(tmp_path):
    """--rdzv-backend static with its endpoint and an id of its own: torchrun meets there, and
    the run trains through it."""
    port = free_port()
    proc = cli("--run", "debug", *as_flags([*TINY, "training.max_steps=2", "eval.every=0"]), "--nproc", "1",
               "--rdzv-backend", "static", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "mine",
               "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (f"launcher: torchrun with 1 process(es) on this machine, 1 machine(s), DDP; rendezvous static at "
            f"localhost:{port}") in proc.stdout
    assert "rank0: model: " in proc.stdout and "finished 2 steps" in proc.stdout


@pytest.mark.slow
def test_several_machines_need_a_named_shared_run_folder(tmp_path):
    proc = cli("--run", "debug", "--nnodes", "2", "--rdzv-endpoint", "node0:29500")
    assert proc.returncode == 2 and "name the run folder with --out" in proc.stderr
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text("[training]\nmax_steps = 3\n")
    proc = cli("--run", "debug", "--nnodes", "2", "--rdzv-endpoint", "node0:29500", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2 and "holds another run's config.toml" in proc.stderr


@pytest.mark.slow
def test_a_killed_front_end_makes_every_rank_checkpoint_and_stop(tmp_path):
    """SSH drops under a multi-process run: the launcher sees its parent go and tells rank 0; the
    ranks agree, write one checkpoint together and all end."""
    from lmcockpit.core.run.folder import latest_checkpoint
    from tests.helpers import start_cli_run

    out = tmp_path / "run"
    proc = start_cli_run(out, "distributed.nproc=2", until="step 4/")
    engine = engine_of(out)
    everyone = [engine, *engine.children(recursive=True)]
    # The ranks are forks of one forkserver the engine started (torch imported once, not per rank),
    # born as spawn made them: no signal blocked (the forkserver's SIGHUP and SIGTERM are).
    (server,) = [c for c in engine.children() if "multiprocessing.forkserver" in " ".join(c.cmdline())]
    ranks = server.children()
    assert len(ranks) == 2 and [_blocked(r.pid) for r in ranks] == [0, 0]
    proc.kill()
    proc.wait()
    psutil.wait_procs(everyone, timeout=120)
    assert not [p for p in everyone if _running(p.pid)]
    log = (out / TRAIN_LOG).read_text()
    assert "launcher: the front-end is gone; the ranks write a checkpoint and stop" in log
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and json.loads((ckpt / "state.json").read_text())["step"] >= 4
    assert sorted(p.name for p in (ckpt / "train_state").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

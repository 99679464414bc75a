"""[logging]: the real engine writes TensorBoard event files and an offline W&B run beside
metrics.jsonl, read back here with their own readers; a resume continues both; a logger that
fails is reported once and switched off while training goes on; a missing package is a usage
error before anything starts."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.run.folder import TRAIN_LOG, read_metrics
from lmcockpit.core.run.resume import plan_resume

from .helpers import as_flags, cli, drive_engine, tiny_config

# Short: 8 steps, an eval and a checkpoint every 4.
SHORT = ["training.max_steps=8", "eval.every=4", "checkpoint.every=4", "training.log_every=4"]


@pytest.fixture(scope="module")
def wandb_env(tmp_path_factory):
    """W&B offline, and every file it writes outside the run folder kept in a folder of the tests'."""
    home = tmp_path_factory.mktemp("wandb-home")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(home / "dir"),
           "WANDB_CACHE_DIR": str(home / "cache"), "WANDB_CONFIG_DIR": str(home / "config"),
           "WANDB_DATA_DIR": str(home / "data")}
    with pytest.MonkeyPatch.context() as mp:  # the engine process inherits them
        for key, value in env.items():
            mp.setenv(key, value)
        yield home


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory, wandb_env):
    """One run with both loggers, stopped past its step-4 checkpoint without saving, then resumed
    in place to its end: steps 5 on are done twice, once in each W&B run and event file. Returns
    the run folder and the offline W&B folders the first part left."""
    run = tmp_path_factory.mktemp("logged") / "run"
    cfg = tiny_config(*SHORT, "logging.tensorboard=true", "logging.wandb=\"lmcockpit-tests\"")

    def stop_after_6(engine, ev):
        if isinstance(ev, P.StepMetrics) and ev.step == 6:
            engine.send(P.Abort(save=False))

    engine, _ = drive_engine(cfg, run, stop_after_6)
    assert engine.final_state == P.ABORTED
    first = sorted((run / "wandb").glob("offline-run-*"))
    stopped_at = max(r["step"] for r in read_metrics(run, "step"))
    engine, _ = drive_engine(None, None, resume=plan_resume(str(run), [], None))
    assert engine.final_state == P.FINISHED
    return SimpleNamespace(dir=run, first_wandb=first, stopped_at=stopped_at)


def scalars_of(run: Path, kind: str, field: str) -> dict[int, float]:
    rows = read_metrics(run, kind)
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"a {kind} step appears twice in metrics.jsonl"
    return {r["step"]: r[field] for r in rows}


@pytest.mark.slow
def test_tensorboard_holds_the_metrics_jsonl_values_once_per_step(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logged_run.dir / "tensorboard")).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "val/loss", "val/bpb"} <= tags
    assert "perf/mfu" not in tags  # a CPU has no known peak: no MFU, rather than a made-up one
    assert logged_run.stopped_at > 4  # steps past the checkpoint were written, then redone
    for tag, kind, field in [("train/loss", "step", "loss"), ("train/lr", "step", "lr"),
                             ("val/loss", "eval", "val_loss"), ("val/bpb", "eval", "val_bpb")]:
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        want = scalars_of(logged_run.dir, kind, field)
        # the first attempt's steps past the checkpoint are purged: each step once, in order
        assert [s for s, _ in got] == sorted(want), tag
        assert [v for _, v in got] == pytest.approx([want[s] for s in sorted(want)], rel=1e-6), tag
    assert sorted(scalars_of(logged_run.dir, "step", "loss")) == list(range(1, 9))
    assert sorted(scalars_of(logged_run.dir, "eval", "val_loss")) == [4, 8]


def wandb_records(path: Path):
    """The records of a .wandb file: the LevelDB log format (32 KiB blocks of chunks: crc32,
    length, type) after W&B's 7-byte header, each record one of wandb's own protobuf messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, block, record = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        record += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            message = pb.Record()
            message.ParseFromString(record)
            yield message
            record = b""
        elif kind == 0:  # preallocated zeros: the end of what was written
            break


def wandb_history(run_folder: Path) -> list[dict[str, float]]:
    (log,) = run_folder.glob("run-*.wandb")
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in wandb_records(log) if r.WhichOneof("record_type") == "history"]


@pytest.mark.slow
def test_wandb_logs_offline_into_the_run_folder_and_a_resume_continues_the_same_run(logged_run, wandb_env):
    run = logged_run.dir
    saved_id = (run / "wandb_id").read_text().strip()
    (first,) = logged_run.first_wandb
    both = sorted((run / "wandb").glob("offline-run-*"))
    assert len(both) == 2 and first in both, "the resume started a W&B run folder of its own"
    assert {p.name.rsplit("-", 1)[1] for p in both} == {saved_id}, "the resume logged to another W&B run"

    rows = [row for folder in both for row in wandb_history(folder)]
    train = {}  # the last value of each step: the redone steps replace the first attempt's
    for row in rows:
        if "train/loss" in row:
            train[row["step"]] = row["train/loss"]
    losses = scalars_of(run, "step", "loss")
    assert train == pytest.approx(losses, rel=1e-6)
    for tag, field in [("val/loss", "val_loss"), ("val/bpb", "val_bpb")]:
        logged = {row["step"]: row[tag] for row in rows if tag in row}
        assert logged == pytest.approx(scalars_of(run, "eval", field), rel=1e-6), tag
    # the resumed run starts again after its checkpoint, below steps W&B has seen: logged all the same
    resumed = [row["step"] for row in wandb_history(both[-1]) if "train/loss" in row]
    assert resumed == list(range(5, 9))
    assert not list(wandb_env.glob("dir/**/*.wandb")), "W&B wrote a run outside the run folder"
    assert "warning" not in (run / TRAIN_LOG).read_text()


@pytest.mark.slow
def test_a_logger_that_cannot_start_is_reported_once_and_training_goes_on(tmp_path):
    from lmcockpit.core.run.folder import create_run_dir

    cfg = tiny_config(*SHORT, "eval.every=0", "checkpoint.every=0", "logging.tensorboard=true")
    run = create_run_dir(cfg, "test", str(tmp_path / "run"))
    (run / "tensorboard").write_text("a file where the event files' folder goes")
    # drive_engine creates the run folder unless given a plan: this one starts at step 0
    engine, events = drive_engine(None, None, resume=SimpleNamespace(cfg=cfg, run_dir=run, checkpoint=None))
    assert engine.final_state == P.FINISHED
    assert sorted(scalars_of(run, "step", "loss")) == list(range(1, 9))
    assert [r["step"] for r in read_metrics(run, "eval")] == [8]
    reports = [line for line in (run / TRAIN_LOG).read_text().splitlines() if "tensorboard logging" in line]
    assert len(reports) == 1, reports
    assert "could not start" in reports[0] and "not a folder" in reports[0] and "switched off" in reports[0]
    assert any(isinstance(e, P.LogLine) and e.text == reports[0] for e in events), "not in the cockpit's log pane"


def test_a_logger_that_fails_mid_run_is_switched_off_after_one_report(tmp_path):
    from lmcockpit.core.run.folder import MetricsLog
    from lmcockpit.core.train.loggers import Metrics

    class Flaky:
        name = "flaky"

        def __init__(self):
            self.seen = []

        def write(self, step, values):
            self.seen.append(step)
            if step == 2:
                raise OSError("disk full")

        def close(self, failed):
            raise AssertionError("a logger switched off is not closed")

    class Steady(Flaky):
        name = "steady"

        def write(self, step, values):
            self.seen.append(step)

        def close(self, failed):
            self.closed = failed

    lines, flaky, steady = [], Flaky(), Steady()
    metrics = Metrics(MetricsLog(tmp_path / "metrics.jsonl"), lines.append)
    metrics.start([("flaky", lambda: flaky), ("steady", lambda: steady), ("broken", lambda: 1 / 0)])
    for step in range(1, 5):
        metrics.write(P.StepMetrics(step, 1.0 / step, 0.1, 1.0, 10.0, None, 0.1, 10 * step, None))
    metrics.write(P.CheckpointWritten(4, "x"))  # nothing to chart: no logger sees it
    metrics.close(failed=True)
    assert flaky.seen == [1, 2] and steady.seen == [1, 2, 3, 4] and steady.closed is True
    assert lines == ["warning: broken logging could not start (ZeroDivisionError: division by zero); it is "
                     "switched off, training goes on",
                     "warning: flaky logging failed at step 2 (OSError: disk full); it is switched off, training "
                     "goes on"]
    assert [r["step"] for r in read_metrics(tmp_path) if r["kind"] == "step"] == [1, 2, 3, 4]


SCORES = {"python-functions": {"accuracy": 0.3, "centered": 0.1, "items": 111}}
LATER = {"python-functions": {"accuracy": 0.43, "centered": 0.24, "items": 111},
         "arc-easy": {"accuracy": 0.5, "centered": 0.33, "items": 40}}


def write_evaluations(metrics) -> None:
    """A validation, then task scores alone (their own cadence), then both with CORE."""
    metrics.write(P.EvalMetrics(4, 3.41, 1.2))
    metrics.write(P.EvalMetrics(6, None, None, SCORES))
    metrics.write(P.EvalMetrics(8, 3.2, 1.1, LATER, 0.12))
    metrics.close()


def test_task_scores_and_core_are_charted_under_eval_and_a_task_only_row_has_no_val_point(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lmcockpit.core.run.folder import MetricsLog
    from lmcockpit.core.train.loggers import TENSORBOARD, Metrics, TensorBoardLogger

    lines: list[str] = []
    metrics = Metrics(MetricsLog(tmp_path / "metrics.jsonl"), lines.append)
    metrics.start([("tensorboard", lambda: TensorBoardLogger(tmp_path, 0))])
    write_evaluations(metrics)
    assert lines == [] and [r["step"] for r in read_metrics(tmp_path, "eval")] == [4, 6, 8]
    events = EventAccumulator(str(tmp_path / TENSORBOARD)).Reload()

    def charted(tag: str) -> list[tuple[int, float]]:
        return [(e.step, pytest.approx(e.value)) for e in events.Scalars(tag)]

    assert charted("val/loss") == [(4, 3.41), (8, 3.2)] and charted("val/bpb") == [(4, 1.2), (8, 1.1)]
    assert charted("eval/python-functions/accuracy") == [(6, 0.3), (8, 0.43)]
    assert charted("eval/python-functions/centered") == [(6, 0.1), (8, 0.24)]
    assert charted("eval/arc-easy/accuracy") == [(8, 0.5)] and charted("eval/core") == [(8, 0.12)]


def written_history(run_folder: Path) -> list[dict[str, float]]:
    """`wandb_history`, or what of it is whole while W&B still writes the file."""
    from google.protobuf.message import DecodeError

    try:
        return wandb_history(run_folder)
    except (AssertionError, DecodeError):  # its header, or a record, not written yet
        return []


@pytest.mark.slow
def test_wandb_charts_task_scores_against_the_run_s_step(tmp_path, wandb_env):
    """W&B's own step only goes up (WandbLogger): every tag prefix, eval/ too, is charted against ours."""
    from lmcockpit.core.run.folder import MetricsLog
    from lmcockpit.core.train.loggers import Metrics, WandbLogger

    metrics = Metrics(MetricsLog(tmp_path / "metrics.jsonl"), print)
    metrics.start([("wandb", lambda: WandbLogger("lmcockpit-tests", tmp_path, {}))])
    write_evaluations(metrics)
    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    (log,) = folder.glob("run-*.wandb")
    deadline = time.monotonic() + 60
    while len(rows := written_history(folder)) < 3:  # W&B's service process may still be writing it
        assert time.monotonic() < deadline, f"the evaluations never reached {log}: {rows}"
        time.sleep(0.1)
    globs = {r.metric.glob_name: r.metric.step_metric for r in wandb_records(log) if r.WhichOneof("record_type") == "metric"}
    assert globs.get("eval/*") == "step"
    assert [(row["step"], row["eval/python-functions/accuracy"]) for row in rows if "eval/python-functions/accuracy" in row] == [
        (6, pytest.approx(0.3)), (8, pytest.approx(0.43))]
    assert [row["step"] for row in rows if "val/loss" in row] == [4, 8]


@pytest.mark.slow
def test_the_wandb_run_s_config_holds_no_notification_url(tmp_path, wandb_env):
    """[notify] says where word of the run goes, tokens and all: nothing of how it trains, and an
    online W&B run uploads its config. The rest of the config is there."""
    from lmcockpit.core.config import load_config
    from lmcockpit.core.train.loggers import start_loggers

    sets = ['logging.wandb="lmcockpit-tests"',
            'notify.webhook="https://alice:SECRET-PASS@hooks.example.com/SECRET-HOOK"',
            'notify.ntfy="https://ntfy.sh/SECRET-TOPIC"', 'notify.apprise=["discord://1/SECRET-TOKEN"]']
    cfg, _ = load_config("debug", sets)
    [(name, _)] = start_loggers(cfg, tmp_path, 0)
    assert name == "wandb"
    # Started and finished in a process of its own, as the engine does: W&B keeps a service per
    # process, and one an earlier test of the suite left in this process held back the config.
    # (the settings on its standard input: W&B records a program's arguments)
    code = ("import json, sys; from lmcockpit.core.config import load_config; "
            "from lmcockpit.core.train.loggers import start_loggers; "
            "[(_, start)] = start_loggers(load_config('debug', json.load(sys.stdin))[0], "
            "__import__('pathlib').Path(sys.argv[1]), 0); start().close(failed=False)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], input=json.dumps(sets), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    (log,) = folder.glob("run-*.wandb")
    # the config as the run record holds it at the start, and any update W&B sends later
    updates = [r.run.config if r.WhichOneof("record_type") == "run" else r.config for r in wandb_records(log)
               if r.WhichOneof("record_type") in ("run", "config")]
    config = {item.key: json.loads(item.value_json) for update in updates for item in update.update}
    assert config["optimizer"]["lr"] == cfg.optimizer.lr and config["logging"]["wandb"] == "lmcockpit-tests"
    assert "notify" not in config
    leaked = [p for p in folder.rglob("*") if p.is_file() and b"SECRET" in p.read_bytes()]
    assert leaked == [], "a notification URL is in the W&B run's files"


def test_scalars_take_what_a_row_has_under_the_loggers_tags():
    from lmcockpit.core.run.rows import event_of
    from lmcockpit.core.train.loggers import scalars

    def scalars_of(kind, row):
        return scalars(event_of({"kind": kind, **row}))

    row = {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0, "mfu": 0.25, "dt": 0.1,
           "mem": {"allocated": 2**30, "reserved": 2**31, "peak": 3 * 2**29}}
    assert scalars_of("step", row) == {"train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 0.5,
                                    "perf/tokens_per_s": 100.0, "perf/mfu": 0.25, "memory/allocated_gib": 1.0,
                                    "memory/reserved_gib": 2.0, "memory/peak_gib": 1.5}
    assert scalars_of("step", {**row, "mfu": None, "mem": None}).keys() == {
        "train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s"}
    assert scalars_of("eval", {"step": 3, "val_loss": 2.0, "val_bpb": 1.5}) == {"val/loss": 2.0, "val/bpb": 1.5}
    assert scalars_of("eval", {"step": 3, "tasks": SCORES}) == {"eval/python-functions/accuracy": 0.3,
                                                              "eval/python-functions/centered": 0.1}
    assert scalars_of("sample", {"step": 3, "prompt": "a", "text": "b"}) == {}


@pytest.mark.slow
@pytest.mark.parametrize("key, value, package", [("tensorboard", "true", "tensorboard"),
                                                  ("wandb", "\"my-project\"", "wandb")])
def test_a_logger_whose_package_is_missing_is_a_usage_error_before_the_run(tmp_path, key, value, package):
    # Python's own "not installed": a module None in sys.modules is one find_spec cannot find and
    # import refuses; sitecustomize sets it before the command's first line.
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(f"import sys\nsys.modules[{package!r}] = None\n")
    out = tmp_path / "run"
    proc = cli("--run", "debug", *as_flags([f"logging.{key}={value}"]), "--out", str(out),
               env={"PYTHONPATH": os.pathsep.join(filter(None, [str(hide), os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"pip install 'lmcockpit[{package}]'" in proc.stderr and f"logging.{key} = " in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists(), "a run folder was created for a run that cannot start"


@pytest.mark.slow
def test_a_resume_asking_for_a_missing_package_leaves_the_run_folder_as_it_was(logged_run, monkeypatch):
    from lmcockpit.core.config import ConfigError

    before = {p: p.read_bytes() for p in (logged_run.dir / "config.toml", logged_run.dir / "metrics.jsonl")}
    monkeypatch.setitem(sys.modules, "wandb", None)  # how Python says "not installed" to find_spec
    with pytest.raises(ConfigError, match=r"logging.wandb = 'lmcockpit-tests' needs the wandb package.*"
                                          r"pip install 'lmcockpit\[wandb\]'"):
        plan_resume(str(logged_run.dir), ["training.max_steps=10"], None)
    assert {p: p.read_bytes() for p in before} == before


@pytest.mark.parametrize("override, message", [
    ("logging.tensorboard=1", "--set: logging.tensorboard must be true or false, got an integer 1"),
    ("logging.wandb=true", "--set: logging.wandb must be a string, got a boolean True"),
    ("logging.wandb=\"team/project\"", "--set: logging.wandb = 'team/project' must be a W&B project name"),
    ("logging.tensorbord=true", "--set: unknown key logging.tensorbord (did you mean logging.tensorboard?)"),
])
def test_logging_settings_are_checked_like_the_others(override, message):
    from lmcockpit.core.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config("debug", [override])
    assert str(e.value).startswith(message)


@pytest.mark.slow
def test_the_loggers_are_off_unless_asked_for_and_may_change_on_resume(logged_run, tmp_path):
    from lmcockpit.core.config import load_config

    cfg, _ = load_config("debug")
    assert (cfg.logging.tensorboard, cfg.logging.wandb) == (False, "")
    ckpt = logged_run.dir / "checkpoints" / "step_000008"
    plan = plan_resume(str(ckpt), ["training.max_steps=10", "logging.tensorboard=false", "logging.wandb=other"],
                       str(tmp_path / "continued"))
    assert (plan.cfg.logging.tensorboard, plan.cfg.logging.wandb) == (False, "other")

"""Runs that survive: exact resume in both forms, kills (also mid-checkpoint), signals, NaNs."""

import json
import os
import signal
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from lmcockpit.core import protocol as P
from lmcockpit.core.runfolder import latest_checkpoint, read_metrics

from .conftest import cli, drive_engine, start_cli_run, tiny_config

LONG = ["training.max_steps=40", "checkpoint.every=20", "checkpoint.keep=5", "eval.every=0"]


def step_losses(run: Path) -> dict[int, float]:
    rows = read_metrics(run, "step")
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), "a step appears twice in metrics.jsonl"
    return {r["step"]: r["loss"] for r in rows}


def weights(ckpt: Path) -> dict:
    return load_file(str(ckpt / "model.safetensors"))


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted 40-step run with checkpoints at 20 and 40."""
    run = tmp_path_factory.mktemp("ref") / "run"
    engine, _ = drive_engine(tiny_config(*LONG), run)
    assert engine.final_state == P.FINISHED
    return run


def test_resume_from_a_checkpoint_folder_is_bit_exact(reference, tmp_path):
    out = tmp_path / "continued"
    proc = cli("--run", "--resume", str(reference / "checkpoints" / "step_000020"), "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout and "at step 20" in proc.stdout
    ref, got = step_losses(reference), step_losses(out)
    assert sorted(got) == list(range(21, 41))
    assert all(got[s] == ref[s] for s in got), "per-step losses differ after resume"
    assert same_weights(out / "checkpoints" / "step_000040", reference / "checkpoints" / "step_000040")


def test_killed_run_resumes_in_place_exactly(reference, tmp_path):
    run = tmp_path / "run"

    def kill_after_25(engine, ev):
        if isinstance(ev, P.StepMetrics) and ev.step == 25:
            os.kill(engine.pid, signal.SIGKILL)

    engine, _ = drive_engine(tiny_config(*LONG), run, kill_after_25)
    assert engine.final_state == P.FAILED and "SIGKILL" in engine.failure.message
    assert max(step_losses(run)) >= 25  # metrics went past the checkpoint at 20
    assert "killed by SIGKILL" in (run / "train.log").read_text()

    proc = cli("--run", "--resume", str(run))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ref, got = step_losses(reference), step_losses(run)
    assert sorted(got) == list(range(1, 41))  # every step exactly once: lines past 20 were dropped
    assert got == ref
    assert same_weights(run / "checkpoints" / "step_000040", reference / "checkpoints" / "step_000040")


def test_sigkill_while_a_checkpoint_is_written_leaves_the_previous_one(tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("LMCOCKPIT_TEST_HOLD_CHECKPOINT", "10")

    def kill_when_held(engine, ev):
        if isinstance(ev, P.CheckpointWritten) and ev.step == 5:
            # step 10's checkpoint is next; the engine announces it and waits inside the window
            while not (run / "checkpoint-held").exists():
                if not engine.process.is_alive():
                    break
                engine.process.join(timeout=0.05)
            os.kill(engine.pid, signal.SIGKILL)

    cfg = tiny_config("training.max_steps=20", "checkpoint.every=5", "eval.every=0")
    engine, _ = drive_engine(cfg, run, kill_when_held)
    assert engine.final_state == P.FAILED
    held = (run / "checkpoint-held").read_text()
    assert (run / "checkpoints" / held).is_dir()  # the half-written folder is there...
    assert latest_checkpoint(run).name == "step_000005"  # ...and ignored
    monkeypatch.delenv("LMCOCKPIT_TEST_HOLD_CHECKPOINT")

    proc = cli("--run", "--resume", str(run))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "at step 5" in proc.stdout
    assert not list((run / "checkpoints").glob(".tmp-*"))  # cleaned up
    assert sorted(step_losses(run)) == list(range(1, 21))
    assert latest_checkpoint(run).name == "step_000020"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signals_checkpoint_and_exit_130(tmp_path, sig):
    out = tmp_path / "run"
    proc = start_cli_run(out)
    proc.send_signal(sig)
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    ck = read_metrics(out, "checkpoint")
    assert len(ck) == 1 and ck[0]["step"] >= 4
    assert f"lmcockpit --run --resume {out}" in rest
    # and the printed command works
    again = cli("--run", "--resume", str(out), "--set", f"training.max_steps={ck[0]['step'] + 2}")
    assert again.returncode == 0, again.stdout + again.stderr


def test_second_ctrl_c_stops_at_once_and_keeps_the_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = start_cli_run(out, "checkpoint.every=3", until="checkpoint: step 3")
    proc.send_signal(signal.SIGINT)
    for line in proc.stdout:  # the first is acknowledged before the second is sent (no coalescing)
        if line.startswith("SIGINT: finishing this step"):
            break
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "stopped at once" in rest
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and json.loads((ckpt / "state.json").read_text())["step"] >= 3
    assert weights(ckpt)  # loadable


def test_nan_stops_with_a_report_and_keeps_the_last_good_weights(tmp_path):
    run = tmp_path / "run"
    cfg = tiny_config("training.max_steps=30", "eval.every=0", "optimizer.lr=1e30", "optimizer.muon_lr=1e30",
                      "training.grad_clip=0", "optimizer.warmup_steps=0")
    engine, events = drive_engine(cfg, run)
    assert engine.final_state == P.FAILED and engine.process.exitcode == 1
    assert "non-finite" in engine.failure.message and not engine.failure.user_error
    good = [e.step for e in events if isinstance(e, P.StepMetrics)]
    bad_step = (good[-1] if good else 0) + 1
    report = (run / "nan_debug" / f"step_{bad_step:06d}" / "report.txt").read_text()
    assert f"non-finite values at step {bad_step}" in report
    assert "NaN" in report and "offending batch" in report
    details = json.loads((run / "nan_debug" / f"step_{bad_step:06d}" / "report.json").read_text())
    assert details["bad_tensors"] and {"name", "kind", "shape", "nan", "inf"} <= set(details["bad_tensors"][0])
    assert (run / "nan_debug" / f"step_{bad_step:06d}" / "batch.pt").is_file()
    assert any(isinstance(e, P.LogLine) and "hold NaN/Inf" in e.text for e in events)
    if good:  # the weights of the last good step were saved, not the bad update
        assert latest_checkpoint(run).name == f"step_{good[-1]:06d}"


def test_nan_skip_counts_and_then_stops(tmp_path):
    cfg = tiny_config("training.max_steps=30", "eval.every=0", "optimizer.lr=1e30", "optimizer.muon_lr=1e30",
                      "training.grad_clip=0", "training.on_nan=\"skip\"", "training.max_nan_skips=3")
    engine, events = drive_engine(cfg, tmp_path / "run")
    assert engine.final_state == P.FAILED
    skips = [e for e in events if isinstance(e, P.LogLine) and "update skipped" in e.text]
    assert [s.text.split("(")[-1] for s in skips][-1].startswith("3/3")


# ---------------------------------------------------------------------------- bad --resume input
def test_resume_refuses_unsafe_changes_by_name(reference, tmp_path):
    proc = cli("--run", "--resume", str(reference / "checkpoints" / "step_000020"), "--out", str(tmp_path / "x"),
               "--set", "model.d_model=128")
    assert proc.returncode == 2 and "--set model.d_model: cannot change when resuming" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("damage, message", [
    (lambda c: (c / "model.safetensors").unlink(), "missing model.safetensors"),
    (lambda c: (c / "state.json").write_text("{\"step\": 3"), "state.json is unreadable"),
    (lambda c: (c / "state.json").write_text("{\"hello\": \"world\"}"), "not an lmcockpit checkpoint"),
    (lambda c: (c / "train_state" / "__0_0.distcp").write_bytes(b"\x00" * 64), "does not fit this model or is damaged"),
    (lambda c: (c / "train_state" / ".metadata").unlink(), "missing train_state/.metadata"),
])
def test_damaged_or_foreign_checkpoints_exit_2(reference, tmp_path, damage, message):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference / "checkpoints" / "step_000020", ckpt)
    damage(ckpt)
    proc = cli("--run", "--resume", str(ckpt), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stdout + proc.stderr and "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("args, message", [
    (lambda t: ["--resume", str(t)], "neither a run folder"),
    (lambda t: ["--resume", str(t / "nope")], "neither a run folder"),
    (lambda t: ["--out", str(Path(__file__)) + "/sub"], "cannot create the run folder"),
    (lambda t: ["debug", "--resume", str(t)], "drop the preset"),
])
def test_bad_paths_exit_2(tmp_path, args, message):
    a = args(tmp_path)
    proc = cli("--run", *a) if a[0] != "--out" else cli("--run", "debug", *a)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_a_killed_front_end_makes_the_engine_checkpoint_and_stop(tmp_path):
    """SSH drops, terminal closes, OOM killer takes the front-end: the engine must not train on
    unseen, nor die mid-write."""
    import psutil

    out = tmp_path / "run"
    proc = start_cli_run(out)
    engine = next(c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline()))
    proc.kill()
    proc.wait()
    engine.wait(timeout=120)  # it ends by itself
    assert "the front-end is gone; writing a checkpoint and stopping" in (out / "train.log").read_text()
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and json.loads((ckpt / "state.json").read_text())["step"] >= 4

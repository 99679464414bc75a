"""Runs that survive: exact resume in both forms, kills (also mid-checkpoint), signals, NaNs."""

import contextlib
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from lmcockpit.core import protocol as P
from lmcockpit.core.config import ConfigError
from lmcockpit.core.run.folder import latest_checkpoint, read_metrics

from .helpers import as_flags, cli, drive_engine, engine_of, start_cli_run, tiny_config

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


@pytest.mark.slow
def test_resume_from_a_checkpoint_folder_is_bit_exact(reference, tmp_path):
    out = tmp_path / "continued"
    proc = cli("--run", "--resume", str(reference / "checkpoints" / "step_000020"), "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout and "at step 20" in proc.stdout
    ref, got = step_losses(reference), step_losses(out)
    assert sorted(got) == list(range(21, 41))
    assert all(got[s] == ref[s] for s in got), "per-step losses differ after resume"
    assert same_weights(out / "checkpoints" / "step_000040", reference / "checkpoints" / "step_000040")


@pytest.mark.slow
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
    assert "schedule:" not in proc.stdout  # the same budget: the same learning rates
    ref, got = step_losses(reference), step_losses(run)
    assert sorted(got) == list(range(1, 41))  # every step exactly once: lines past 20 were dropped
    assert got == ref
    assert same_weights(run / "checkpoints" / "step_000040", reference / "checkpoints" / "step_000040")


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signals_checkpoint_and_exit_130(tmp_path, sig):
    """`kill PID` (SIGTERM) reaches the front-end alone; Ctrl-C and a terminal's hang-up reach its
    whole process group: the engine, and the forkserver it was forked from, which must live on to
    tell the front-end how its engine ended (core/process/warm_start.py)."""
    out = tmp_path / "run"
    proc = start_cli_run(out, session=True)
    if sig == signal.SIGTERM:
        proc.send_signal(sig)
    else:
        os.killpg(proc.pid, sig)
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in rest + err and "resource_tracker" not in rest + err, rest + err
    ck = read_metrics(out, "checkpoint")
    assert len(ck) == 1 and ck[0]["step"] >= 4
    assert f"lmcockpit --run --resume {out}" in rest
    if sig == signal.SIGTERM:  # and the printed command works (once: the checkpoints are alike)
        again = cli("--run", "--resume", str(out), "--set", f"training.max_steps={ck[0]['step'] + 2}")
        assert again.returncode == 0, again.stdout + again.stderr


@pytest.mark.slow
def test_a_closed_output_pipe_stops_the_run_like_a_hang_up(tmp_path):
    """`lmcockpit --run cpu | head`: the reader is gone; the run stops in order, with a checkpoint."""
    import psutil

    out = tmp_path / "run"
    proc = start_cli_run(out)
    engine = [engine_of(out)]
    proc.stdout.close()
    try:
        assert proc.wait(timeout=120) == 130, proc.stderr.read()
    finally:  # a front-end that hangs must not leave a training running past the test
        for p in [psutil.Process(proc.pid), *engine] if proc.poll() is None else []:
            p.kill()
    assert "Traceback" not in proc.stderr.read()
    assert json.loads((latest_checkpoint(out) / "state.json").read_text())["step"] >= 4


@pytest.mark.slow
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


@pytest.mark.slow
def test_nan_stops_with_a_report_and_keeps_the_last_good_weights(tmp_path):
    run = tmp_path / "run"
    cfg = tiny_config("training.max_steps=30", "eval.every=0", "optimizer.lr=1e30", "optimizer.muon_lr=1e30",
                      "training.grad_clip=0", "optimizer.warmup_steps=0")
    engine, events = drive_engine(cfg, run)
    assert engine.final_state == P.FAILED and engine.process.exitcode == 1
    assert "non-finite" in engine.failure.message and not engine.failure.user_error
    assert engine.failure.traceback == ""  # the message is whole: what happened, where, what to do
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


@pytest.mark.slow
def test_nan_skip_counts_and_then_stops(tmp_path):
    cfg = tiny_config("training.max_steps=30", "eval.every=0", "optimizer.lr=1e30", "optimizer.muon_lr=1e30",
                      "training.grad_clip=0", "training.on_nan=\"skip\"", "training.max_nan_skips=3")
    engine, events = drive_engine(cfg, tmp_path / "run")
    assert engine.final_state == P.FAILED
    skips = [e for e in events if isinstance(e, P.LogLine) and "update skipped" in e.text]
    assert [s.text.split("(")[-1] for s in skips] == ["1/3)", "2/3)", "3/3)"]
    assert "non-finite" in engine.failure.message
    # the weights it keeps are the last good step's, untouched by the skipped updates
    kept = weights(latest_checkpoint(tmp_path / "run"))
    assert all(np.isfinite(w).all() for w in kept.values())


@pytest.mark.slow
def test_a_skipped_bad_step_keeps_the_weights_and_the_run_goes_on_healthy(tmp_path):
    """One bad batch, at step 3: its loss and so its gradients are NaN (a real bad batch cannot be
    made on demand on a CPU, so the trainer's own loop runs here with that one loss poisoned).
    "skip" must drop that update: step 4 starts from the weights of step 2, and the run trains on,
    finite, to its end."""
    import math

    import torch

    from lmcockpit.core.run.folder import create_run_dir
    from lmcockpit.core.train.trainer import Trainer

    bad, seen, logs = 3, {}, []
    weights_now = lambda trainer: {k: v.clone() for k, v in trainer.model.state_dict().items()}  # noqa: E731 - a one-line function, defined where it is used

    class OneBadBatch(Trainer):
        def compiled_model(self):
            model = super().compiled_model()

            def step(x, y):
                if self.step + 1 == bad + 1 and "before step 4" not in seen:
                    seen["before step 4"] = weights_now(self)
                loss = model(x, y)
                return loss * float("nan") if self.step + 1 == bad else loss
            return step

    def emit(ev):
        if isinstance(ev, P.StepMetrics):
            seen.setdefault("steps", []).append((ev.step, ev.loss))
            if ev.step == bad - 1:
                seen["after step 2"] = weights_now(trainer)

    cfg = tiny_config("eval.every=0", "training.on_nan=\"skip\"", "training.max_nan_skips=3")
    trainer = OneBadBatch(cfg, create_run_dir(cfg, "test", str(tmp_path / "run")), emit, logs.append,
                          lambda block: None)
    try:
        assert trainer.run() == P.FINISHED
    finally:
        trainer.close()
        torch.use_deterministic_algorithms(False)  # the trainer set it for this whole process
    steps = dict(seen["steps"])
    assert sorted(steps) == [s for s in range(1, 13) if s != bad]  # step 3 was taken, not reported
    assert all(math.isfinite(loss) for loss in steps.values())
    assert steps[12] < steps[1]  # still learning after the bad batch
    before, after = seen["after step 2"], seen["before step 4"]
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert [line for line in logs if "update skipped" in line][0].endswith("update skipped (1/3)")
    assert (tmp_path / "run" / "nan_debug" / f"step_{bad:06d}" / "report.txt").is_file()
    final = weights(latest_checkpoint(tmp_path / "run"))
    assert all(np.isfinite(w).all() for w in final.values())


@pytest.mark.slow
def test_a_non_finite_loss_under_the_loss_scaler_is_skipped_counted_and_stops(tmp_path):
    """fp16 trains with a loss scaler (precision "auto" on V100, T4, RTX 20xx), which skips a step
    whose gradients overflowed and lowers its scale. A NaN loss is no overflow: it goes through
    on_nan as without the scaler (it once trained on, NaN, to max_steps). torch's CPU scaler does
    what the CUDA one does; steps 3 and 5 have a poisoned loss, one skip is allowed."""
    import torch

    from lmcockpit.core.run.folder import create_run_dir
    from lmcockpit.core.train.trainer import NonFiniteLoss, Trainer

    class Scaled(Trainer):
        def setup(self):
            super().setup()
            self.scaler = torch.amp.GradScaler("cpu")

        def compiled_model(self):
            model = super().compiled_model()
            return lambda x, y: model(x, y) * (float("nan") if self.step + 1 in (3, 5) else 1.0)

    logs, steps = [], []
    cfg = tiny_config("eval.every=0", "training.on_nan=\"skip\"", "training.max_nan_skips=1")
    emit = lambda ev: steps.append(ev.step) if isinstance(ev, P.StepMetrics) else None  # noqa: E731 - a one-line function, defined where it is used
    trainer = Scaled(cfg, create_run_dir(cfg, "test", str(tmp_path / "run")), emit, logs.append, lambda block: None)
    try:
        with pytest.raises(NonFiniteLoss, match="non-finite values at step 5"):
            trainer.run()
    finally:
        trainer.close()
        torch.use_deterministic_algorithms(False)  # the trainer set it for this whole process
    assert steps == [1, 2, 4]  # step 4 trained after the skip: the scaler took its next step
    assert [line for line in logs if "update skipped" in line][0].endswith("update skipped (1/1)")
    for bad in (3, 5):
        assert (tmp_path / "run" / "nan_debug" / f"step_{bad:06d}" / "report.txt").is_file()
    assert latest_checkpoint(tmp_path / "run").name == "step_000004"  # the last good weights


def copy_checkpoint(src: Path, dst: Path, step: int) -> Path:
    import shutil

    shutil.copytree(src, dst)
    state = json.loads((dst / "state.json").read_text())
    (dst / "state.json").write_text(json.dumps({**state, "step": step}))
    return dst


@pytest.mark.slow
def test_checkpoints_are_ordered_by_step_number_not_by_name(reference, tmp_path):
    import shutil

    from lmcockpit.core.run.resume import plan_resume
    from lmcockpit.core.train.checkpoint_io import _prune

    run, ref = tmp_path / "run", reference / "checkpoints" / "step_000020"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(reference / "config.toml", run / "config.toml")
    for step in (999_990, 1_000_000):  # "step_1000000" < "step_999990" as text
        copy_checkpoint(ref, run / "checkpoints" / f"step_{step:06d}", step)
    (run / "checkpoints" / "latest").write_text("step_999990\n")  # killed before the pointer moved
    (run / "checkpoints" / "step_1000010").mkdir()  # killed before its state.json: not a checkpoint
    (run / "checkpoints" / ".pruned-step_999980").mkdir()  # killed while it was deleted
    assert latest_checkpoint(run).name == "step_1000000"

    plan = plan_resume(str(run), ["training.max_steps=1000020"], None)
    assert plan.step == 1_000_000
    # the future being redone, deleted out of sight as a prune does, and what a kill left of one
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["step_1000000", "step_999990"]
    assert (run / "checkpoints" / "step_999990").exists()
    _prune(run / "checkpoints", keep=1)
    assert [p.name for p in (run / "checkpoints").glob("step_*")] == ["step_1000000"]


@pytest.mark.slow
def test_a_kill_while_a_checkpoint_is_pruned_leaves_none_half_deleted(reference, tmp_path):
    """Pruning deleted step_N/ in place: a kill part way left a checkpoint listed as complete with
    its shards gone, or with its state.json gone first, unlisted and so never pruned. It is now
    renamed out of sight first; the process is killed just after that rename, the earliest point
    where deleting could begin."""
    import shutil
    import subprocess
    import sys

    from lmcockpit.core.run.folder import list_checkpoints
    from lmcockpit.core.train.checkpoint_io import _prune

    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(reference / "checkpoints", root)
    prune = ("import sys, pathlib; from lmcockpit.core.train.checkpoint_io import _prune; "
             "_prune(pathlib.Path(sys.argv[1]), 1)")
    proc = subprocess.Popen([sys.executable, "-c", prune, str(root)],
                            env={**os.environ, "LMCOCKPIT_TEST_HOLD_PRUNE": "step_000020"})
    held = tmp_path / "run" / "prune-held"
    try:
        while not held.exists() and proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.05)
    finally:
        proc.kill()
        proc.wait()
    assert held.read_text() == "step_000020"
    assert [p.name for p in list_checkpoints(root)] == ["step_000040"]
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [".pruned-step_000020", "step_000040"]

    _prune(root, 1)  # the next prune deletes what the kill left
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step_000040"]


@pytest.mark.slow
def test_a_stop_at_a_saved_step_keeps_that_checkpoint_as_it_is(reference, tmp_path):
    """Saving a step twice once deleted the first copy before renaming the second into place: a
    kill in between left no checkpoint at all. The step on disk is now left alone."""
    import shutil

    from lmcockpit.core.run.resume import plan_resume

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    ckpt = run / "checkpoints" / "step_000040"
    written = (ckpt / "state.json").stat().st_mtime_ns
    plan = plan_resume(str(run), ["training.max_steps=50"], None)
    engine, events = drive_engine(None, run, resume=plan, set_up_then=[P.Abort(save=True)])
    assert engine.final_state == P.ABORTED, engine.failure
    assert [e.step for e in events if isinstance(e, P.CheckpointWritten)] == [40]
    assert (ckpt / "state.json").stat().st_mtime_ns == written
    assert not [r for r in read_metrics(run, "checkpoint") if r["step"] == 40][1:]

    # From another run's checkpoint, the new run has none of its own yet: the stop writes one.
    plan = plan_resume(str(ckpt), ["training.max_steps=50"], str(tmp_path / "new"))
    engine, events = drive_engine(None, None, resume=plan, set_up_then=[P.Abort(save=True)])
    assert engine.final_state == P.ABORTED, engine.failure
    assert latest_checkpoint(tmp_path / "new").name == "step_000040"


@pytest.mark.slow
def test_a_run_being_trained_cannot_be_resumed_meanwhile(tmp_path):
    out = tmp_path / "run"
    proc = start_cli_run(out, "checkpoint.every=2", until="checkpoint: step 2")
    try:
        config, metrics = (out / "config.toml").read_text(), (out / "metrics.jsonl").stat().st_ino
        again = cli("--run", "--resume", str(out), "--set", "training.max_steps=7")
        assert again.returncode == 2 and "a training is running in this run folder" in again.stderr
        assert (out / "config.toml").read_text() == config and (out / "metrics.jsonl").stat().st_ino == metrics
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    assert proc.returncode == 130
    # once it has stopped, the same command goes through
    again = cli("--run", "--resume", str(out), "--set", f"training.max_steps={latest_step(out) + 1}")
    assert again.returncode == 0, again.stdout + again.stderr


def latest_step(run: Path) -> int:
    return json.loads((latest_checkpoint(run) / "state.json").read_text())["step"]


@pytest.mark.slow
def test_a_loss_spike_is_resumed_past_with_other_learning_rates(reference, tmp_path):
    from lmcockpit.core.config import load_config
    from lmcockpit.core.train.optim import lr_multiplier

    # The spike itself, and the command printed to resume past it: test_resume_takes_on_nan_skip_past_a_spike.
    # The rates given on resume are the ones trained with, not those the optimizer state saved.
    proc = cli("--run", "--resume", str(reference / "checkpoints" / "step_000040"), "--out", str(tmp_path / "calm"),
               "--set", "training.max_steps=44", "--set", "optimizer.lr=1e-3", "--set", "optimizer.muon_lr=0.01")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "schedule: the run now ends at step 44, not 40, and the cosine schedule stretches" in proc.stdout
    rows = read_metrics(tmp_path / "calm", "step")
    assert [r["step"] for r in rows] == [41, 42, 43, 44]
    schedule = load_config("debug", ["training.max_steps=44"])[0].optimizer
    assert rows[0]["lr"] == pytest.approx(1e-3 * lr_multiplier(40, 44, schedule))


@pytest.mark.slow
def test_a_run_resumed_after_its_data_changed_keeps_its_tokenizer(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(6):
        (folder / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps. " * 300)
    data = ["--set", f"data.source=\"{folder}\"", "--set", "data.val_fraction=0.3", "--set", "data.max_bytes=0",
            "--set", "tokenizer.vocab_size=300"]
    run = tmp_path / "run"
    proc = cli("--run", "debug", *data, "--set", "training.max_steps=4", "--set", "eval.every=0", "--out", str(run))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (folder / "doc0.txt").write_text("zebra quartz jukebox vexing " * 400)
    proc = cli("--run", "--resume", str(run), "--set", "training.max_steps=6")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"tokenising with the run's own tokenizer ({run / 'tokenizer' / 'tokenizer.json'})" in proc.stdout
    assert sorted(step_losses(run)) == list(range(1, 7))


@pytest.mark.slow
def test_resume_takes_a_new_cadence_for_each_of_eval_checkpoint_log_and_sample(reference, tmp_path):
    """The run was saved with no evaluation or samples, a checkpoint every 20 steps and a log
    line every 4; each cadence given on resume is the one the continued run keeps."""
    from lmcockpit.core.config import load_config

    out = tmp_path / "continued"
    cadence = ["training.max_steps=26", "eval.every=3", "eval.batches=1", "checkpoint.every=4", "checkpoint.keep=10",
               "training.log_every=5", "sample.every=5", "sample.prompts=[\"def \"]", "sample.max_new_tokens=4"]
    proc = cli("--run", "--resume", str(reference / "checkpoints" / "step_000020"), *as_flags(cadence),
               "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r["step"] for r in read_metrics(out, "eval")] == [21, 24, 26]  # and the last step's
    assert [r["step"] for r in read_metrics(out, "checkpoint")] == [24, 26]
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_000024", "step_000026"]
    assert [r["step"] for r in read_metrics(out, "sample")] == [25, 26]
    printed = [int(line.split()[1].split("/")[0]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert printed == [25, 26]  # every 5 (and the last), where the saved config printed 24 and 26
    cfg, _ = load_config(str(out / "config.toml"))
    assert (cfg.eval.every, cfg.checkpoint.every, cfg.training.log_every, cfg.sample.every) == (3, 4, 5, 5)


@pytest.mark.slow
def test_resume_takes_on_nan_skip_past_a_spike(reference, tmp_path):
    """Saved with on_nan = "stop": resumed with "skip" (and rates that blow up), the continued run
    skips its non-finite steps up to max_nan_skips before it stops, as a run started so would."""
    spike = ["training.max_steps=50", "optimizer.lr=1e38", "optimizer.muon_lr=1e38", "training.grad_clip=0.0",
             "training.on_nan=\"skip\"", "training.max_nan_skips=2"]
    proc = cli("--run", "--resume", str(reference / "checkpoints" / "step_000040"), *as_flags(spike),
               "--out", str(tmp_path / "spiked"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    skipped = [line.split("update skipped ")[1] for line in proc.stdout.splitlines() if "update skipped" in line]
    assert skipped == ["(1/2)", "(2/2)"], proc.stdout
    assert "non-finite values" in proc.stderr and "Traceback" not in proc.stdout + proc.stderr  # it says it all
    assert f"lmcockpit --run --resume {tmp_path / 'spiked'} --set optimizer.lr=5e+37" in proc.stderr


@pytest.mark.slow
def test_a_resumed_compiled_run_leaves_compiling_at_its_first_step(reference, tmp_path):
    """A compiled run says COMPILING until its first step has compiled the model; resumed, that
    step is not step 1, and with no evaluation or checkpoint on the way it was never said at all:
    the progress line stayed on 'Compiling the model' for the whole run."""
    import dataclasses

    from lmcockpit.core.run.resume import plan_resume

    plan = plan_resume(str(reference / "checkpoints" / "step_000040"), ["training.max_steps=41"],
                       str(tmp_path / "continued"))
    # The checkpoint was trained eagerly (cheaper) and a resume may not switch the compiler on:
    # this plan does, since what is tested is the engine's states, not plan_resume.
    t = dataclasses.replace(plan.cfg.training, compile=True)
    plan = dataclasses.replace(plan, cfg=dataclasses.replace(plan.cfg, training=t))
    engine, events = drive_engine(None, None, resume=plan)
    assert engine.final_state == P.FINISHED, engine.failure
    seen = [e for e in events if isinstance(e, (P.StateChanged, P.StepMetrics))]
    first = next(i for i, e in enumerate(seen) if isinstance(e, P.StepMetrics))
    assert seen[first].step == 41
    states = [e.state for e in seen[:first] if isinstance(e, P.StateChanged)]
    assert P.COMPILING in states and states[-1] == P.RUNNING, states


@pytest.mark.parametrize("saved, now", [
    ((8, 1, 1), (4, 2, 1)), ((8, 1, 1), (2, 1, 4)), ((4, 2, 1), (8, 1, 1)), ((2, 3, 2), (3, 1, 4)),
    ((2, 3, 2), (6, 2, 1)), ((4, 2, 2), (8, 2, 1)),
])
def test_a_step_split_otherwise_takes_the_same_sequences(saved, now):
    """(micro-batch, accumulation, processes) as saved and as resumed: every micro-batch of every
    rank, in order, is the step's sequences as the saved run drew them."""
    from lmcockpit.core.data.batches import get_batch
    from lmcockpit.core.train.trainer import DataUnit, step_rows

    tokens = np.arange(5000, dtype=np.uint16)
    unit = DataUnit(saved[0], saved[1] * saved[2])
    draw = lambda g: get_batch(tokens, 7, g, unit.rows, 16)  # noqa: E731 - a one-line function, defined where it is used
    for step in (0, 3):
        as_saved = np.concatenate([draw(step * unit.per_step + j)[0] for j in range(unit.per_step)])
        mb, accum, world = now
        got = np.concatenate([step_rows(draw, unit, step, (rank * accum + micro) * mb, mb)[0]
                              for rank in range(world) for micro in range(accum)])
        assert got.shape == (mb * accum * world, 16) and (got == as_saved).all()
        x, y = step_rows(draw, unit, step, mb, mb)
        assert (x[:, 1:] == y[:, :-1]).all()  # targets stay the inputs shifted by one


@pytest.mark.slow
def test_out_of_memory_advice_is_what_a_resume_takes(reference, tmp_path):
    """The out-of-memory message says the checkpoint is kept and what to change: each change it
    names is one --resume accepts, and the continued run takes the same sequences each step."""
    import re

    from lmcockpit.core.config import load_config
    from lmcockpit.core.hardware.memory_estimate import out_of_memory_message
    from lmcockpit.core.run.resume import plan_resume

    ckpt = reference / "checkpoints" / "step_000020"
    cfg, _ = load_config(str(ckpt / "config.toml"))
    message = out_of_memory_message(cfg, 21, "Tried to allocate 2.00 GiB", "GPU", 1 << 30, 1 << 29, 20)
    advice = message.split("Change: ")[1]
    options = [re.findall(r"training\.\w+=\w+", option) for option in advice.split(", or ")]
    assert options == [["training.micro_batch_size=4", "training.grad_accum_steps=2"],
                       ["training.auto_micro_batch=true"], ["training.activation_checkpointing=true"]]
    for i, sets in enumerate(options):
        plan = plan_resume(str(ckpt), [*sets, "training.max_steps=41"], str(tmp_path / f"plan{i}"))
        t = plan.cfg.training
        assert t.micro_batch_size * t.grad_accum_steps == 8

    # Given alone, the micro-batch takes the accumulation that keeps a step's sequences.
    plan = plan_resume(str(ckpt), ["training.micro_batch_size=2", "training.max_steps=41"], str(tmp_path / "p"))
    assert (plan.cfg.training.micro_batch_size, plan.cfg.training.grad_accum_steps) == (2, 4)
    for sets, said in [(["training.micro_batch_size=4", "training.grad_accum_steps=4"],
                        "training.micro_batch_size × training.grad_accum_steps × processes must stay 8 "
                        "(it is 4 × 4 × 1 = 16)"),
                       (["training.micro_batch_size=3"], "1 process(es) take 8 each, which training.micro_batch_size "
                                                         "= 3 does not divide")]:
        with pytest.raises(ConfigError) as e:
            plan_resume(str(ckpt), [*sets, "training.max_steps=41"], str(tmp_path / "refused"))
        assert str(e.value).startswith("--resume: each of the checkpoint's steps takes 8 sequences (micro-batch 8 × "
                                       "1 accumulation steps × 1 process(es)); ") and said in str(e.value)

    # Step 21 trained 4 × 2 is step 21 trained 8 × 1: the same weights on the same sequences, and
    # its evaluation the same windows.
    runs = {}
    for name, sets in [("split", ["training.micro_batch_size=4", "training.grad_accum_steps=2",
                                  "training.activation_checkpointing=true"]), ("whole", [])]:
        plan = plan_resume(str(ckpt), [*sets, "training.max_steps=21"], str(tmp_path / name))
        engine, _ = drive_engine(None, None, resume=plan)
        assert engine.final_state == P.FINISHED, engine.failure
        runs[name] = tmp_path / name
    said = "continuing with 2 accumulation step(s) of 4 sequences (saved: 1 of 8), the same batches"
    assert said in (runs["split"] / "train.log").read_text()
    assert "continuing" not in (runs["whole"] / "train.log").read_text()
    split, whole = step_losses(runs["split"]), step_losses(runs["whole"])
    assert list(split) == [21] and split[21] == pytest.approx(step_losses(reference)[21], rel=1e-6)
    assert whole[21] == step_losses(reference)[21]
    (val,), (whole_val,) = read_metrics(runs["split"], "eval"), read_metrics(runs["whole"], "eval")
    assert val["val_loss"] == pytest.approx(whole_val["val_loss"], rel=1e-5)
    state = json.loads((latest_checkpoint(runs["split"]) / "state.json").read_text())
    assert state["data_unit"] == [8, 1]  # the next resume draws as the first run did


# ---------------------------------------------------------------------------- bad --resume input
@pytest.mark.slow
def test_resume_refuses_unsafe_changes_by_name(reference, tmp_path):
    proc = cli("--run", "--resume", str(reference / "checkpoints" / "step_000020"), "--out", str(tmp_path / "x"),
               "--set", "model.d_model=128")
    assert proc.returncode == 2 and "--set model.d_model: cannot change when resuming" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = cli("--run", "--resume", str(reference), "--set", "training.max_step=50")  # a typo is a typo
    assert proc.returncode == 2 and "--set: unknown key training.max_step" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_resume_may_change_exactly_the_keys_declared_safe(reference, tmp_path):
    """Each key, --set to the value the checkpoint already holds: refused by name where its
    declaration says it is fixed on resume, taken where it says "safe" (config.safe_on_resume:
    resume.py keeps no list of its own)."""
    import dataclasses

    from lmcockpit.core.config import SECTIONS, config_from_dict, read_toml, safe_on_resume, toml_value
    from lmcockpit.core.run.resume import plan_resume

    ckpt = reference / "checkpoints" / "step_000020"
    saved = config_from_dict(read_toml(ckpt / "config.toml"))
    every = [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    refused = set()
    for i, key in enumerate(every):
        section, name = key.split(".")
        item = f"{key}={toml_value(getattr(getattr(saved, section), name))}"
        try:
            plan_resume(str(ckpt), [item], str(tmp_path / str(i)))
        except ConfigError as e:
            assert str(e).startswith(f"--set {key}: cannot change when resuming") and e.keys == (key,), str(e)
            refused.add(key)
    assert refused == set(every) - safe_on_resume()
    # what makes the continued run the same run: its model, its data and tokenizer, its sequences
    fixed = {"model", "tokenizer", "data.source", "data.sources", "training.seq_len", "training.seed",
             "training.precision", "optimizer.kind", "optimizer.schedule"}
    assert not {key for key in safe_on_resume() if key in fixed or key.split(".")[0] in fixed}


@pytest.mark.slow
def test_a_run_stopped_before_its_first_checkpoint_is_named_as_such(reference, tmp_path):
    import shutil

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(reference / "config.toml", run / "config.toml")
    proc = cli("--run", "--resume", str(run))
    assert proc.returncode == 2 and "the run has no complete checkpoint to continue from" in proc.stderr
    proc = cli("chat", str(run), "--prompt", "x")
    assert proc.returncode == 2 and "the run has no complete checkpoint yet" in proc.stderr


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_points_to_the_one_before(reference, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    (run / "checkpoints" / "step_000040" / "train_state" / "__0_0.distcp").write_bytes(b"\x00" * 64)
    proc = cli("--run", "--resume", str(run), "--set", "training.max_steps=42")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "the one before it, step_000020, is whole: move step_000040 out of" in proc.stderr
    shutil.move(run / "checkpoints" / "step_000040", tmp_path / "damaged")
    proc = cli("--run", "--resume", str(run), "--set", "training.max_steps=22")
    assert proc.returncode == 0 and "at step 20" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (lambda t: ["--resume", str(t)], "neither a run folder"),
    (lambda t: ["--resume", str(t / "nope")], "neither a run folder"),
    (lambda t: ["--out", str(Path(__file__)) + "/sub"], "cannot create the run folder"),
    (lambda t: ["--out", str(Path(__file__))], "is a file; give a folder for the run"),
    (lambda t: ["debug", "--resume", str(t)], "drop the preset"),
])
def test_bad_paths_exit_2(tmp_path, args, message):
    a = args(tmp_path)
    proc = cli("--run", *a) if a[0] != "--out" else cli("--run", "debug", *a)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_killed_front_end_makes_the_engine_checkpoint_and_stop(tmp_path):
    """SSH drops, terminal closes, OOM killer takes the front-end: the engine must not train on
    unseen, nor die mid-write."""
    out = tmp_path / "run"
    proc = start_cli_run(out)
    engine = engine_of(out)
    proc.kill()
    proc.wait()
    engine.wait(timeout=120)  # it ends by itself
    assert "the front-end is gone; writing a checkpoint and stopping" in (out / "train.log").read_text()
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and json.loads((ckpt / "state.json").read_text())["step"] >= 4

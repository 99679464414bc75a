"""Loss spikes: the detector on made-up values, then the real engine provoked as the issue says
(a run resumed with a learning-rate surge, `--set optimizer.lr=5.0`): warned about, rolled back
past and recovered from, replayed exactly by a resume after the rollback, stopped, and failed when
rollbacks run out; spike and rollback rows survive a resume."""

from __future__ import annotations

import json
import math
import shlex
import shutil
from pathlib import Path

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.process.host import run_so_far
from lmcockpit.core.run.curves import load_run
from lmcockpit.core.config import load_config
from lmcockpit.core.run.folder import list_checkpoints, read_metrics
from lmcockpit.core.run.resume import truncate_metrics
from lmcockpit.core.train.spikes import SpikeWatch
from lmcockpit.core.train.trainer import SpikeStop
from lmcockpit.core.run.state import RunState
from tests.helpers import SHRINK_CPU, TINY, as_flags, cli

# The shrunk cpu preset, uncompiled, with a window short enough for a 40-step run to fill.
BASE = as_flags([*SHRINK_CPU, *TINY, "training.compile=false", "eval.every=0", "training.spike_window=20"])
SURGE_SET = ["training.max_steps=80", "optimizer.lr=5.0", "optimizer.muon_lr=5.0", "checkpoint.every=20"]
SURGE = as_flags(SURGE_SET)
# What gets past a surge that stays: back to the last checkpoint, then the rate cut back to about
# where it was (5.0 × 0.004 = 0.02) for the rest of the run.
RECOVER = as_flags(['training.on_spike="rollback"', "training.spike_lr_factor=0.004", "training.spike_lr_steps=100"])


def test_a_spike_is_far_above_a_full_window_and_only_above():
    watch = SpikeWatch(window=4, z_loss=6.0, z_grad=0.0)
    for loss in (3.0, 3.1, 2.9, 3.0):
        assert watch.check(loss, 1.0) is None  # the window is still filling: nothing is judged
        watch.add(loss, 1.0)
    assert watch.check(3.2, 1.0) is None  # 2.8 sd: noise
    assert watch.check(0.5, 1.0) is None  # far below: a loss that falls is what training is for
    assert watch.check(3.0, 1e6) is None  # the gradient norm is not watched (z_grad 0)
    spike = watch.check(3.6, 1.0)
    assert spike is not None and spike.z_loss == pytest.approx((3.6 - 3.0) / math.sqrt(0.005))
    assert spike.mean_loss == pytest.approx(3.0)
    grads = SpikeWatch(window=4, z_loss=0.0, z_grad=5.0)
    for norm in (1.0, 1.2, 0.8, 1.0):
        grads.add(3.0, norm)
    assert grads.check(100.0, 1.5) is None and grads.check(100.0, 3.0).z_grad > 5  # the loss not watched
    again = SpikeWatch(window=3, z_loss=6.0, z_grad=0.0)
    again.restore(watch.state())  # a shorter window keeps the last values
    assert list(again.losses) == [3.1, 2.9, 3.0] and again.check(3.6, 1.0) is not None


@pytest.fixture(scope="module")
def before_surge(tmp_path_factory):
    """40 healthy steps, a checkpoint at 20 and 40: what each test resumes with a surge."""
    run = tmp_path_factory.mktemp("spikes") / "base"
    r = cli("--run", "cpu", *BASE, *as_flags(["training.max_steps=40", "checkpoint.every=20"]), "--out", str(run))
    assert r.returncode == 0, r.stderr
    return run


def copy_of(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def steps_and_losses(run) -> dict[int, float]:
    return {r.step: r.loss for r in load_run(run).history.recent()}


@pytest.mark.slow
def test_a_surge_warned_about_trains_on_with_one_warning(before_surge, tmp_path):
    run = copy_of(before_surge, tmp_path)
    r = cli("--run", "--resume", str(run), *SURGE)
    assert r.returncode == 0, r.stderr
    spikes = read_metrics(run, "spike")
    assert spikes and all(s["action"] == "warn" and s["z"] > 6 for s in spikes)
    assert spikes[0]["step"] == 42  # step 41's update at lr 5 shows in step 42's loss
    log = (run / "train.log").read_text()
    assert log.count("warning: loss spike at step") == 1, log  # a stretch of spikes is one warning
    assert "loss spike at step 42" in log and 'training.on_spike = "warn"' in log


@pytest.mark.slow
def test_a_rollback_steps_past_the_spike_and_a_resume_replays_it(before_surge, tmp_path):
    run = copy_of(before_surge, tmp_path)
    r = cli("--run", "--resume", str(run), *SURGE, *RECOVER)
    assert r.returncode == 0, r.stderr
    [spike] = read_metrics(run, "spike")
    [rollback] = read_metrics(run, "rollback")
    assert spike["step"] == 42 and spike["action"] == "rollback" and spike["loss"] > 20
    assert (rollback["step"], rollback["to_step"], rollback["batches_skipped"], rollback["rollbacks"]) == (42, 40, 2, 1)
    losses = steps_and_losses(run)
    assert sorted(losses) == list(range(1, 81))  # the steps rolled back are no longer in the curve
    assert math.isfinite(losses[80]) and losses[80] < losses[40] < spike["loss"]
    log = (run / "train.log").read_text()
    assert "rolled back to step 40, past 2 step(s) of batches, learning rate × 0.004 for 100 steps" in log

    # From the checkpoint written after the rollback: the same batches, rates and losses.
    again = tmp_path / "again"
    r = cli("--run", "--resume", str(run / "checkpoints" / "step_000060"), *SURGE, *RECOVER, "--out", str(again))
    assert r.returncode == 0, r.stderr
    replayed = steps_and_losses(again)
    assert {s: replayed[s] for s in range(61, 81)} == {s: losses[s] for s in range(61, 81)}
    assert not read_metrics(again, "spike")

    # What a cockpit attaching later folds from the folder: the curve the run has now, the mark.
    view = RunState()
    for event in run_so_far(run).catchup("attached"):
        view.apply(event)
    assert [(r.step, r.loss) for r in view.history.recent()] == [(s, losses[s]) for s in range(1, 81)]
    assert view.spikes == [(42, spike["loss"], "rollback")] and view.rollbacks == 1


def checkpoints_of(run: Path) -> tuple[list[str], str]:
    """The complete checkpoints a resume can find, and what `latest` names."""
    root = run / "checkpoints"
    return [p.name for p in list_checkpoints(root)], (root / "latest").read_text().strip()


def printed_command(stderr: str) -> list[str]:
    """The command a run that gave up on a spike says to run next, as arguments."""
    [line] = [line for line in stderr.splitlines() if "lmcockpit --run" in line]
    return shlex.split(line[line.index("lmcockpit --run"):])[1:]


@pytest.mark.slow
def test_rollbacks_used_up_end_the_run_at_the_last_good_checkpoint_with_a_command_that_trains_on(before_surge,
                                                                                                  tmp_path):
    """#51: the weights that spiked were once saved as `latest`, and the command printed repeated
    the rate that spiked: a resume failed at once on the same loss."""
    run = copy_of(before_surge, tmp_path)
    # The surge stays (no rate cut): each rollback meets it again.
    r = cli("--run", "--resume", str(run), *SURGE,
            *as_flags(['training.on_spike="rollback"', "training.max_rollbacks=2", "training.spike_lr_factor=1"]))
    assert r.returncode == 1, r.stderr
    assert [row["to_step"] for row in read_metrics(run, "rollback")] == [40, 40]
    assert [row["action"] for row in read_metrics(run, "spike")] == ["rollback", "rollback", "stop"]
    assert "after 2 rollback(s), training.max_rollbacks = 2" in r.stderr
    assert checkpoints_of(run) == (["step_000020", "step_000040"], "step_000040")
    assert "the latest checkpoint is step_000040" in r.stderr and "not saved" in r.stderr
    # the rates the checkpoint trained at (the base run's), not the surge's 5.0
    base = load_config("cpu", [])[0].optimizer
    args = printed_command(r.stderr)
    assert args[:3] == ["--run", "--resume", str(run)]
    sets = dict(item.split("=", 1) for item in args[4::2])
    assert sets["optimizer.lr"] == f"{base.lr:g}" and sets["optimizer.muon_lr"] == f"{base.muon_lr:g}"
    assert sets["training.max_steps"] == "80"  # what the resume set, which the checkpoint's config lacks
    again = cli(*args)
    assert again.returncode == 0, again.stderr
    assert max(steps_and_losses(run)) == 80 and not [row for row in read_metrics(run, "spike") if row["step"] > 42]


@pytest.mark.slow
def test_stop_ends_the_run_at_the_spike_keeping_the_checkpoint_before_it(before_surge, tmp_path):
    run = copy_of(before_surge, tmp_path)
    r = cli("--run", "--resume", str(run), *SURGE, *as_flags(['training.on_spike="stop"', "checkpoint.every=1"]))
    assert r.returncode == 1
    assert 'loss spike at step 42' in r.stderr and 'training.on_spike = "stop"' in r.stderr
    # step 41's weights gave step 42's loss: written as a checkpoint of its own, then set aside
    # (it had pruned step 20: checkpoint.keep = 2)
    assert checkpoints_of(run) == (["step_000040"], "step_000040")
    assert (run / "checkpoints" / "spiked-step_000041" / "state.json").is_file()
    assert "step_000041 holds the weights that spiked" in (run / "train.log").read_text()
    assert [row["action"] for row in read_metrics(run, "spike")] == ["stop"]


@pytest.mark.slow
def test_a_rollback_back_at_an_evaluated_step_does_not_evaluate_it_again(before_surge, tmp_path):
    """#51: each rollback to step 300 once scored step 300 again (20-54 s of tasks each time)."""
    run = copy_of(before_surge, tmp_path)
    r = cli("--run", "--resume", str(run), *SURGE, *RECOVER, *as_flags(["eval.every=20", "training.max_steps=60"]))
    assert r.returncode == 0, r.stderr
    assert [row["to_step"] for row in read_metrics(run, "rollback")] == [40]
    # the base run's last evaluation (step 40), then the resumed run's (60): none after the rollback
    assert [row["step"] for row in read_metrics(run, "eval")] == [40, 60]
    assert r.stdout.count("eval step") == 1


@pytest.mark.slow
def test_a_spike_in_a_window_still_filling_is_caught(before_surge, tmp_path):
    """#51: a run resumed early (its window not yet full) went 4.15 → 61.0 → 140.7 unseen: the
    detector judged only a full window. The base run saved a 20-step window; judged over 100 steps,
    it is still filling when the surge comes."""
    run = copy_of(before_surge, tmp_path)
    r = cli("--run", "--resume", str(run), *SURGE, *as_flags(["training.spike_window=100", "training.max_steps=45"]))
    assert r.returncode == 0, r.stderr
    spikes = read_metrics(run, "spike")
    assert spikes and spikes[0]["step"] == 42 and spikes[0]["z"] > 6
    assert "sd above the last 21 steps' median" in (run / "train.log").read_text()  # 20 saved, then step 41


def test_the_detector_judges_from_ten_steps_against_the_median_until_its_window_fills():
    watch = SpikeWatch(window=100, z_loss=6.0, z_grad=0.0)
    for loss in (3.0, 3.1, 2.9, 3.0, 3.05, 2.95, 3.0, 3.1, 2.9):
        assert watch.check(50.0, 1.0) is None  # fewer than ten steps: nothing judged
        watch.add(loss, 1.0)
    watch.add(3.0, 1.0)
    assert watch.check(3.2, 1.0) is None  # noise
    spike = watch.check(5.0, 1.0)
    assert spike is not None and spike.center == "median" and spike.mean_loss == pytest.approx(3.0)
    assert spike.z_loss == pytest.approx((5.0 - 3.0) / (1.4826 * 0.05))
    watch.add(60.0, 1.0)  # one wild value moves a median little: the next in line is still judged so
    assert watch.check(3.1, 1.0) is None and watch.check(4.0, 1.0) is not None


@pytest.mark.slow
def test_a_rollback_reloads_the_checkpoint_steps_past_its_batches_and_cuts_the_rate_again_each_time(
        before_surge, tmp_path):
    """What a rollback does to the run, seen from inside the real trainer (#51, 17): the weights
    it trains on are the checkpoint's, the batches those after the ones that spiked, the learning
    rate the schedule's times spike_lr_factor (the default: 0.5), and again at a second rollback."""
    import torch
    from safetensors.torch import load_file

    from lmcockpit.core.run.resume import plan_resume
    from lmcockpit.core.train.optim import lr_multiplier
    from lmcockpit.core.train.trainer import Trainer

    run = copy_of(before_surge, tmp_path)
    plan = plan_resume(str(run), [*SURGE_SET, 'training.on_spike="rollback"', "training.max_rollbacks=2",
                                  "training.max_steps=60"], None)
    assert plan.cfg.training.spike_lr_factor == 0.5 and plan.cfg.training.spike_lr_steps == 100  # the defaults
    steps, rollbacks, drawn = [], [], []
    saved = load_file(run / "checkpoints" / "step_000040" / "model.safetensors")
    trainer = None

    def emit(event):
        if isinstance(event, P.StepMetrics):
            steps.append((event.step, event.lr))
        elif isinstance(event, P.RolledBack):
            weights = trainer.model.state_dict()
            rollbacks.append((event.step, event.to_step, all(torch.equal(weights[k], v) for k, v in saved.items())))

    trainer = Trainer(plan.cfg, plan.run_dir, emit, lambda line: None, lambda block: None,
                      resume_from=plan.checkpoint)
    original = trainer.draw
    trainer.draw = lambda g: (drawn.append((trainer.step, g)), original(g))[1]
    try:
        with pytest.raises(SpikeStop):
            trainer.run()
    finally:
        trainer.close(failed=True)
        torch.use_deterministic_algorithms(False)  # the trainer set it for this whole process
    per_step = trainer.data_unit.per_step
    assert [(s, to, same) for s, to, same in rollbacks] == [(42, 40, True), (42, 40, True)]
    # step 41 first drew batch 40 (as ever), then after each rollback the batches past those spiked
    firsts = list(dict.fromkeys(g // per_step for step, g in drawn if step == 40))
    assert firsts == [40, 42, 44]
    o, peak = plan.cfg.optimizer, plan.cfg.optimizer.lr
    first_41 = [lr for step, lr in steps if step == 41]
    assert first_41 == pytest.approx([peak * lr_multiplier(40, 60, o) * cut for cut in (1, 0.5, 0.25)])


@pytest.mark.slow
def test_skip_drops_each_spiking_update(before_surge, tmp_path):
    run = copy_of(before_surge, tmp_path)
    r = cli("--run", "--resume", str(run), *SURGE, *as_flags(['training.on_spike="skip"', "training.max_steps=50"]))
    assert r.returncode == 0, r.stderr
    skipped = [row["step"] for row in read_metrics(run, "spike")]
    assert skipped and all(row["action"] == "skip" for row in read_metrics(run, "spike"))
    trained = set(steps_and_losses(run))
    assert not trained & set(skipped) and trained | set(skipped) == set(range(1, 51))


def step(n: int, loss: float) -> P.StepMetrics:
    return P.StepMetrics(n, loss, 1e-3, 1.0, 1000.0, None, 0.1, n * 512, {})


def test_a_rollback_cuts_the_cockpit_s_curves_back_to_where_it_went():
    """Shown steps 41-45 then a rollback to 40: the curves, their smoothing and the evaluations
    are those of a run that never took them, and the steps that come again are appended."""
    seen, never = RunState(), RunState()
    for n in range(1, 41):
        seen.apply(step(n, 5 - n / 20))
        never.apply(step(n, 5 - n / 20))
    seen.apply(P.EvalMetrics(20, 4.2, 1.0))
    never.apply(P.EvalMetrics(20, 4.2, 1.0))
    for n in range(41, 46):
        seen.apply(step(n, 30.0 + n))
    seen.apply(P.EvalMetrics(45, 40.0, 9.0, {"t": {"accuracy": 0.1, "centered": 0.0, "items": 4}}))
    seen.apply(P.SpikeSeen(46, 90.0, "rollback", 3.0, 80.0, 1.0, None))
    seen.apply(P.RolledBack(46, 40, 6, 1, 0.5, 100))
    assert (seen.step, seen.loss, seen.val_steps, seen.tasks) == (40, never.loss, [20], {"t": []})
    for n in range(41, 44):
        seen.apply(step(n, 3.0))
        never.apply(step(n, 3.0))
    rows, expected = seen.history.recent(), never.history.recent()
    assert [r[:3] + r[4:] for r in rows] == [r[:3] + r[4:] for r in expected]  # step, time, loss, lr, tokens/s
    assert [r.ema for r in rows] == pytest.approx([r.ema for r in expected], rel=1e-12)
    assert seen.spikes == [(46, 90.0, "rollback")] and seen.rollbacks == 1


def test_a_resume_keeps_the_rows_of_spikes_and_rollbacks(tmp_path):
    rows = [{"kind": "step", "step": 41, "loss": 3.0}, {"kind": "spike", "step": 42, "loss": 99.0},
            {"kind": "rollback", "step": 42, "to_step": 40}, {"kind": "step", "step": 41, "loss": 3.1},
            {"kind": "eval", "step": 45, "val_loss": 3.0}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    truncate_metrics(path, 40)
    assert [json.loads(line)["kind"] for line in path.read_text().splitlines()] == ["spike", "rollback"]


@pytest.mark.slow
def test_an_unknown_spike_policy_is_one_error_line(tmp_path):
    r = cli("--run", "debug", "--set", "training.on_spike=ignore", "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == ("error: --set: training.on_spike = 'ignore' is not one of "
                                "'warn' | 'skip' | 'rollback' | 'stop'")
    assert not (tmp_path / "run").exists()


def test_a_healthy_cpu_preset_run_never_trips_the_default_thresholds():
    """The 360 steps of a real `lmcockpit --run cpu` (tests/data/cpu_preset_curve.json, recorded
    with the machine it ran on; its context doubles at step 181) judged as the trainer judges them, at the preset's own settings:
    no spike, its largest z-score far below the threshold; the same run's losses with one step
    made a spike as the learning-rate surge made one (3.69 to 22.1) is caught."""
    from lmcockpit.core.config import load_config
    from lmcockpit.core.train.spikes import zscore

    curve = json.loads((Path(__file__).parent / "data" / "cpu_preset_curve.json").read_text())
    assert len(curve["loss"]) == 360
    t = load_config("cpu", [])[0].training
    watch, largest = SpikeWatch(t.spike_window, t.spike_zscore, t.spike_grad_zscore), 0.0
    for loss, norm in zip(curve["loss"], curve["grad_norm"]):
        assert watch.check(loss, norm) is None
        if len(watch.losses) == t.spike_window:
            largest = max(largest, zscore(loss, watch.losses))
        watch.add(loss, norm)
    assert largest < t.spike_zscore / 3
    assert watch.check(curve["loss"][-1] * 22.1 / 3.69, curve["grad_norm"][-1]) is not None

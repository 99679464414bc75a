"""The trainer's parts hold their own state: recovery's across a checkpoint, evaluation's cadence
and target, checkpoints' last written. Built on a real Trainer, not set up (no data, no model)."""

from __future__ import annotations

from lmcockpit.core.run.folder import create_run_dir
from lmcockpit.core.train.trainer import Trainer

from .helpers import tiny_config


def trainer(tmp_path, *overrides: str) -> Trainer:
    cfg = tiny_config(*overrides)
    return Trainer(cfg, create_run_dir(cfg, "test", str(tmp_path / "run")), lambda e: None, lambda line: None,
                   lambda block: None)


def test_recovery_s_state_goes_into_a_checkpoint_and_comes_back_whole(tmp_path):
    tr = trainer(tmp_path, "training.spike_lr_factor=0.5", "training.spike_lr_steps=100")
    r = tr.recovery
    for loss in (3.0, 3.1, 2.9, 3.05, 2.95):
        assert not r.judge(loss, 1.0)  # too few steps to judge: taken
    r.rollbacks, r.batch_offset, r.lr_cut_until, r.lr_cut, r.nan_skips = 2, 17, 140, 0.25, 1
    saved = r.state()
    again = trainer(tmp_path / "again").recovery
    again.restore(saved)
    assert again.state() == saved and again.spikes.state() == r.spikes.state()
    assert (again.lr_factor(139), again.lr_factor(140)) == (0.25, 1.0)  # cut until step 140, then the schedule's


def test_a_checkpoint_from_before_the_cut_compounded_resumes_at_spike_lr_factor(tmp_path):
    r = trainer(tmp_path, "training.spike_lr_factor=0.3").recovery
    r.restore({"nan_skips": 0, "spikes": {"window": None, "rollbacks": 1, "batch_offset": 4, "lr_cut_until": 50}})
    assert (r.lr_factor(49), r.lr_factor(50), r.rollbacks, r.batch_offset) == (0.3, 1.0, 1, 4)
    r.restore({})  # a checkpoint from before spikes were kept
    assert (r.lr_factor(0), r.rollbacks, r.batch_offset, r.nan_skips) == (1.0, 0, 0, 0)


def test_evaluation_s_cadences_and_a_target_kept_only_by_a_resume_aiming_at_it(tmp_path):
    tr = trainer(tmp_path, "eval.every=6", "eval.tasks_every=0", "training.target_val_loss=3.2")
    ev = tr.evaluation
    tr.step = 6
    assert ev.due() == (True, False)  # no tasks: no scores due
    ev.tasks = ["a task"]
    assert ev.due() == (True, True)  # tasks_every 0: eval.every's cadence
    tr.step = 7
    assert ev.due() == (False, False)
    ev.target_reached = 6
    saved = ev.state()
    same = trainer(tmp_path / "same", "training.target_val_loss=3.2").evaluation
    same.restore(saved)
    elsewhere = trainer(tmp_path / "elsewhere", "training.target_val_loss=3.0").evaluation
    elsewhere.restore(saved)
    assert (same.target_reached, elsewhere.target_reached) == (6, None)
    assert not same.at_target  # reached, but the run goes on without stop_at_target


def test_checkpoints_say_which_was_written_last(tmp_path):
    tr = trainer(tmp_path)
    assert tr.checkpoints.last_written == "none" and tr.saved_step is None
    tr.checkpoints.saved_step = 40
    assert tr.checkpoints.last_written == "step 40" and tr.saved_step == 40

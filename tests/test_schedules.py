"""The batch-size and sequence-length schedules: each step's batches, length and tokens as a pure
function of the step, checked against sums written out step by step; and a run resumed from before
a change point that trains exactly as the uninterrupted run."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lmcockpit.core.config import ConfigError
from lmcockpit.core.data.batches import DataUnit, get_batch, step_rows
from lmcockpit.core.step_schedules import Schedules, run_tokens
from lmcockpit.core.run.folder import create_run_dir, read_metrics
from lmcockpit.core.train.trainer import run_in_process

from .helpers import tiny_config

BATCH = "training.batch_schedule=[[0.0, 0.25], [0.3, 0.5], [0.6, 1.0]]"
SEQ = "training.seq_len_schedule=[[0.0, 16], [0.5, 64]]"


def schedules(*overrides: str) -> Schedules:
    return Schedules.of(tiny_config("training.max_steps=10", "training.grad_accum_steps=4", *overrides))


def test_each_stage_holds_from_its_fraction_of_the_steps_and_the_full_values_before_the_first():
    s = schedules("training.batch_schedule=[[0.2, 0.5], [0.6, 0.75]]", SEQ)
    assert [s.accum_at(step) for step in range(10)] == [4, 4, 2, 2, 2, 2, 3, 3, 3, 3]
    assert [s.seq_len(step) for step in range(10)] == [16] * 5 + [64] * 5
    assert s.full_seq_len == 64 and s.active


def test_a_step_s_first_batch_and_the_tokens_before_it_are_the_sums_over_every_step_before():
    s = schedules(BATCH, SEQ)
    for step in range(12):  # past max_steps too: a run extended by --resume goes on in the last stage
        assert s.first_batch(step) == sum(s.batches_at(i) for i in range(step))
        assert s.tokens_before(step) == sum(s.step_tokens(i) for i in range(step))
    t = tiny_config("training.max_steps=10", "training.grad_accum_steps=4").training
    full = t.micro_batch_size * 4 * 64
    assert [s.step_tokens(i) for i in (0, 3, 5, 6)] == [full // 16, full // 8, full // 2, full]
    assert run_tokens(tiny_config("training.max_steps=10", "training.grad_accum_steps=4", BATCH, SEQ)) == \
        s.tokens_before(10)


def test_without_schedules_every_step_takes_the_whole_step_as_before():
    s = schedules()
    assert not s.active
    assert [s.first_batch(step) for step in range(5)] == [4 * step for step in range(5)]
    assert s.tokens_before(7) == 7 * tiny_config("training.grad_accum_steps=4").tokens_per_step
    assert s.change(0, resumed_at=0) is None


def test_scheduled_steps_draw_consecutive_batches_none_twice_none_skipped():
    s = schedules(BATCH)
    unit = DataUnit(2, 4)
    tokens = np.arange(4000, dtype=np.uint16)
    seen = []
    for step in range(10):
        accum = s.accum_at(step)
        rows = np.concatenate([step_rows(lambda g: get_batch(tokens, 3, g, 2, 8), unit, step, micro * 2, 2,
                                         s.first_batch(step))[0] for micro in range(accum)])
        assert rows.shape == (2 * accum, 8)
        seen += range(s.first_batch(step), s.first_batch(step) + s.batches_at(step))
    assert seen == list(range(len(seen)))


def test_a_share_that_does_not_make_whole_batches_of_a_resumed_run_s_data_unit_is_refused():
    """The config's check sees accumulation and processes; the trainer's sees the data unit too, a
    resumed run's from its checkpoint (here 2 batches a step: a quarter of it is half a batch)."""
    ok = schedules("training.batch_schedule=[[0.0, 0.25]]")
    assert ok.problem() is None
    assert "share 0.25 must make whole micro-batches" in dataclasses.replace(ok, per_step=2).problem()


@pytest.mark.parametrize("overrides, message", [
    (["training.batch_schedule=[[0.5, 0.5], [0.2, 1.0]]"], "fractions [0.5, 0.2] must increase"),
    (["training.batch_schedule=[[0.0, 2.0]]"], "training.batch_schedule[0] = [0.0, 2.0] has share 2.0"),
    (["training.seq_len_schedule=[[1.0, 16]]"], "has fraction 1.0: expected one in [0, 1)"),
    (["training.seq_len_schedule=[[0.0, 16.5]]"], "has length 16.5"),
    (["training.seq_len_schedule=[[0.0, 128]]"], "lengths [128] are above training.seq_len = 64"),
    (["training.seq_len_schedule=[0.5]"], "training.seq_len_schedule must be a list of list"),
    (["training.seq_len_schedule=[[0.0, 16]]", 'data.format="chat"'], 'data.format = "chat" trains on whole'),
    (["training.batch_schedule=[[0.0, 0.5]]"], "share × training.grad_accum_steps (1)"),
])
def test_malformed_schedules_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        tiny_config(*overrides)
    assert message in str(e.value)


SCHEDULED = ["training.max_steps=10", "training.grad_accum_steps=4", "checkpoint.every=3", "checkpoint.keep=5",
             "eval.every=0", "training.log_every=1", BATCH, SEQ]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    cfg = tiny_config(*SCHEDULED)
    lines: list[str] = []
    run = create_run_dir(cfg, "test", str(tmp_path_factory.mktemp("sched") / "run"))
    run_in_process(cfg, run, log=lines.append)
    return cfg, run, lines


@pytest.mark.slow
def test_the_log_says_where_each_stage_begins_and_tokens_seen_count_each_step_s_own(uninterrupted):
    cfg, run, lines = uninterrupted
    said = [line for line in lines if line.startswith("schedule: from step")]
    assert [line.split(",")[0] for line in said] == ["schedule: from step 1", "schedule: from step 4",
                                                     "schedule: from step 6", "schedule: from step 7"]
    assert "1 micro-batch(es) a process (0.25 of the step's sequences), sequence length 16" in said[0]
    assert "4 micro-batch(es) a process (1 of the step's sequences), sequence length 64" in said[3]
    rows = read_metrics(run, "step")
    s = Schedules.of(cfg)
    assert [r["tokens_seen"] for r in rows] == [s.tokens_before(step) for step in range(1, 11)]
    assert rows[-1]["tokens_seen"] == run_tokens(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", [3, 6])  # 3: the next step changes the batch; 6: between the length's change and the batch's last
def test_a_resume_from_before_a_change_point_trains_as_the_uninterrupted_run(uninterrupted, checkpoint, tmp_path):
    cfg, run, _ = uninterrupted
    lines: list[str] = []
    resumed = create_run_dir(cfg, "test", str(tmp_path / "resumed"))
    run_in_process(cfg, resumed, log=lines.append, resume_from=run / "checkpoints" / f"step_{checkpoint:06d}")
    ref = {r["step"]: (r["loss"], r["tokens_seen"]) for r in read_metrics(run, "step")}
    got = {r["step"]: (r["loss"], r["tokens_seen"]) for r in read_metrics(resumed, "step")}
    assert sorted(got) == list(range(checkpoint + 1, 11))
    assert all(got[s] == ref[s] for s in got), (got, ref)
    assert any(line.startswith(f"schedule: from step {checkpoint + 1},") for line in lines)


def test_a_watched_run_s_tokens_per_second_and_eta_follow_the_scheduled_steps():
    """The front-ends' figures (core/run/state.py): tokens/s of the last step's own tokens, and an ETA
    that counts the larger steps to come at the pace of the last one, time in proportion to tokens."""
    from lmcockpit.core import protocol as P
    from lmcockpit.core.run.state import RunState

    cfg = tiny_config("training.max_steps=10", "training.grad_accum_steps=4", BATCH, SEQ)
    s = Schedules.of(cfg)
    run = RunState()
    run.apply(P.RunStarted("run", cfg.to_dict(), 1000, "cpu", "fp32", 0, 10, cfg.tokens_per_step))
    for n in range(1, 4):  # steps 1 to 3: a sixteenth of the full step's tokens, a second each
        run.apply(P.StepMetrics(n, 5.0, 1e-3, 1.0, s.step_tokens(n - 1), None, 1.0, s.tokens_before(n)))
    assert run.tokens_per_s == pytest.approx(s.step_tokens(2))
    # steps 4..10 take 2, 2, 8, 16, 16, 16, 16 times step 3's tokens: 76 seconds at its pace
    assert run.eta == pytest.approx((s.tokens_before(10) - s.tokens_before(3)) / s.step_tokens(2))
    assert run.eta == pytest.approx(76.0)
    plain = RunState()
    plain.apply(P.RunStarted("run", tiny_config("training.max_steps=10").to_dict(), 1000, "cpu", "fp32", 0, 10, 512))
    for n in range(1, 4):
        plain.apply(P.StepMetrics(n, 5.0, 1e-3, 1.0, 512.0, None, 1.0, 512 * n))
    assert (plain.tokens_per_s, plain.eta) == (512.0, 7.0)


def test_the_memory_estimate_sizes_for_the_longest_sequences_and_the_micro_batch_a_step_keeps():
    """training.seq_len is the longest a schedule may reach, and a batch schedule varies accumulation
    only: the estimate of a scheduled run is the full run's."""
    from lmcockpit.core.hardware.memory_estimate import estimate

    full = tiny_config("training.grad_accum_steps=4")
    scheduled = tiny_config("training.grad_accum_steps=4", BATCH, SEQ)
    assert estimate(scheduled) == estimate(full)
    assert estimate(tiny_config("training.seq_len=16")).total < estimate(full).total


@pytest.mark.slow
def test_compare_s_tokens_axis_counts_each_scheduled_step_s_own_tokens(uninterrupted):
    from lmcockpit.core.run.curves import load_run

    cfg, run, _ = uninterrupted
    curves = load_run(run)
    s = Schedules.of(cfg)
    xs, points = curves.curve("tokens", 100)
    assert xs == [s.tokens_before(p.step) for p in points]
    assert curves.largest_x("tokens") == run_tokens(cfg)

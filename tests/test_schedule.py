"""The learning-rate schedule, over the steps a run really trains: 0 to max_steps - 1."""

import pytest

from lmcockpit.core.config import OptimizerConfig
from lmcockpit.core.train.optim import lr_multiplier, schedule_warning


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
@pytest.mark.parametrize("max_steps", [21, 22, 23, 50, 400, 3000])
@pytest.mark.parametrize("floor", [0.0, 0.1])
def test_the_schedule_reaches_its_floor_on_the_last_step_trained(schedule, max_steps, floor):
    cfg = OptimizerConfig(schedule=schedule, warmup_steps=20, min_lr_ratio=floor, decay_fraction=0.2)
    rates = [lr_multiplier(step, max_steps, cfg) for step in range(max_steps)]
    assert rates[:20] == [(s + 1) / 20 for s in range(20)]  # warmup up to the peak
    assert rates[-1] == floor  # exactly: the decay ends where training does
    assert all(a >= b for a, b in zip(rates[19:], rates[20:]))  # then only down
    assert all(r > floor for r in rates[20:-1]), "the floor comes before the last step"


def test_wsd_holds_the_peak_until_its_last_fifth():
    cfg = OptimizerConfig(schedule="wsd", warmup_steps=20, min_lr_ratio=0.1, decay_fraction=0.2)
    rates = [lr_multiplier(step, 400, cfg) for step in range(400)]
    assert rates[19:321] == [1.0] * 302 and rates[321] < 1.0
    assert rates[399] == 0.1 and rates[398] == pytest.approx(0.1 + 0.9 / 79)


def test_a_warmup_as_long_as_the_run_is_said_in_the_header():
    cfg = OptimizerConfig(schedule="cosine", warmup_steps=100)
    assert schedule_warning(cfg, 101) is None
    assert schedule_warning(cfg, 50) == (
        "warning: optimizer.warmup_steps = 100 is not below training.max_steps = 50: the learning rate rises to "
        "0.50 of its peak at the last step and never decays; lower optimizer.warmup_steps for a schedule")
    assert "rises to 1.00 of its peak" in schedule_warning(cfg, 100)

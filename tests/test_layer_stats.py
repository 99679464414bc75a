"""Per-layer health on demand (#53 part 4): logging.layer_stats_every records each block's gradient
norm and update/weight ratio (core/train/layer_stats.py) as `layers` rows; the history keeps the last
of them (core/run/layer_history.py); the spike watch warns of a block whose update jumps
(spikes.UpdateRatioWatch); the dashboard's layers panel draws them (tui/widgets/layer_panel.py)."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch

from lmcockpit.core import protocol as P
from lmcockpit.core.config import ConfigError, LoggingConfig
from lmcockpit.core.config_keys import rules_of
from lmcockpit.core.model.gpt import GPT, shape_from_config
from lmcockpit.core.run import history_file, rows
from lmcockpit.core.run.folder import METRICS, read_metrics
from lmcockpit.core.run.history import History
from lmcockpit.core.run.layer_history import KEPT, LayerWindow
from lmcockpit.core.run.resume import truncate_metrics
from lmcockpit.core.run.state import RunState
from lmcockpit.core.train.group import Group
from lmcockpit.core.train.layer_stats import LayerStatsTaker
from lmcockpit.core.train.optim import build_optimizers, step_optimizers
from lmcockpit.core.train.spikes import RATIO_WINDOW, UpdateRatioWatch
from lmcockpit.core.train.step_clock import StepClock
from lmcockpit.tui.widgets.layer_panel import heat_lines, peak_text

from .helpers import FedDashboard, drive_engine, shown_in, tiny_config


def record(step: int, ratios: list[float], grads: list[float] | None = None) -> P.LayerStats:
    return P.LayerStats(step, grads or [1.0] * len(ratios), ratios, 2.0, ratios[0] / 2)


# ------------------------------------------------------------------------------ the config key
def test_the_key_is_a_count_of_steps_off_by_default_and_safe_to_change_on_resume():
    assert tiny_config().logging.layer_stats_every == 0
    assert tiny_config("logging.layer_stats_every=10").logging.layer_stats_every == 10
    with pytest.raises(ConfigError, match="logging.layer_stats_every"):
        tiny_config("logging.layer_stats_every=-1")
    [field] = [f for f in dataclasses.fields(LoggingConfig) if f.name == "layer_stats_every"]
    assert rules_of(field).on_resume == "safe" and "% of a cpu preset step" in rules_of(field).help


# ------------------------------------------------------------------------------- measuring
def tiny_trainer(every: int):
    """What the taker reads of a trainer, around a real 2-block model, its real optimizers and clock."""
    cfg = tiny_config(f"logging.layer_stats_every={every}")
    torch.manual_seed(0)
    model = GPT(shape_from_config(cfg))
    made = []
    tr = SimpleNamespace(cfg=cfg, step=0, clock=StepClock(torch.device("cpu")), model=model, device=torch.device("cpu"),
                         group=Group(), optimizers=build_optimizers(model, cfg.optimizer, torch.device("cpu")),
                         record=made.append, log=made.append)
    return tr, made


def one_step(tr, taker: LayerStatsTaker) -> None:
    """A step as the trainer takes it, with the taker's three calls where the trainer makes them."""
    x = torch.randint(0, tr.model.shape.vocab_size, (4, 16))
    tr.clock.start()
    tr.model(x, x).backward()
    tr.clock.mark("compute")
    taker.before_clip()
    step_optimizers(tr.optimizers, None, 1.0)
    tr.clock.mark("optimizer")
    taker.after_update()
    tr.step += 1
    taker.report()


def test_a_record_holds_each_block_s_norm_and_update_ratio_as_computed_by_hand():
    tr, made = tiny_trainer(every=1)
    taker = LayerStatsTaker(tr)
    one_step(tr, taker)  # Adam's first update differs from the rest: the second is the one checked
    made.clear()
    x = torch.randint(0, tr.model.shape.vocab_size, (4, 16))
    tr.clock.start()
    tr.model(x, x).backward()
    tr.clock.mark("compute")
    blocks = [list(b.parameters()) for b in tr.model.layers]
    grad = [math.sqrt(sum(float(p.grad.double().square().sum()) for p in ps)) for ps in blocks]
    before = [[p.detach().clone() for p in ps] for ps in blocks]
    taker.before_clip()
    step_optimizers(tr.optimizers, None, 1.0)
    tr.clock.mark("optimizer")
    taker.after_update()
    tr.step += 1
    taker.report()
    ratio = [math.sqrt(sum(float((p.detach() - b).double().square().sum()) for p, b in zip(ps, bs)))
             / math.sqrt(sum(float(b.double().square().sum()) for b in bs)) for ps, bs in zip(blocks, before)]
    [stats] = made
    assert isinstance(stats, P.LayerStats) and stats.step == 2
    assert stats.grad_norm == pytest.approx(grad, rel=1e-5) and stats.update_ratio == pytest.approx(ratio, rel=1e-5)
    assert len(stats.grad_norm) == len(tr.model.layers) == 2
    assert stats.embed_grad_norm > 0 and 0 < stats.embed_update_ratio < 1
    assert "layer_stats" in tr.clock.read()  # its work is a part of the step, in the anatomy


def test_nothing_is_taken_on_other_steps_and_a_step_that_went_no_further_leaves_no_record():
    tr, made = tiny_trainer(every=3)
    taker = LayerStatsTaker(tr)
    for _ in range(3):
        one_step(tr, taker)
    assert [r.step for r in made] == [3]
    tr.clock.start()
    tr.step = 5  # the next is a stats step, whose update a spike skips: no after_update, no report
    x = torch.randint(0, tr.model.shape.vocab_size, (4, 16))
    tr.model(x, x).backward()
    taker.before_clip()
    assert taker.taken is not None
    tr.step = 6
    one_step(tr, taker)  # step 7: not a stats step; what step 6 took is dropped
    assert taker.taken is None and [r.step for r in made] == [3]


# ----------------------------------------------------------------------------- the watch
def test_the_watch_warns_once_of_a_block_whose_update_jumps_and_not_of_a_schedule():
    watch = UpdateRatioWatch()
    lines = []
    for k in range(1, 11):  # warmup: the rate and the ratios rise together, no warning
        lr = 1e-3 * k / 10
        lines += watch.check(10 * k, [0.01 * k / 10, 0.02 * k / 10, 0.015 * k / 10], lr)
    assert lines == []
    jumped = watch.check(110, [0.01, 0.142, 0.015], 1e-3)
    assert jumped == ["warning: block 1's update/weight ratio 7.1x its median at step 110: "
                      "the loss may spike next (training goes on)"]
    assert watch.check(120, [0.01, 0.2, 0.015], 1e-3) == []  # the same block: quiet for a while
    for k in range(13, 12 + RATIO_WINDOW):
        assert watch.check(10 * k, [0.01, 0.02, 0.015], 1e-3) == []
    assert watch.check(10 * (12 + RATIO_WINDOW), [0.01, 0.2, 0.015], 1e-3) != []  # heard of again after it
    assert watch.check(999, [0.01, 0.02, 0.015], 0.0) == []  # a rate at zero: nothing to judge


def test_the_watch_judges_nothing_before_a_few_records():
    watch = UpdateRatioWatch()
    assert watch.check(1, [0.001], 1e-3) == [] and watch.check(2, [0.1], 1e-3) == []


# ---------------------------------------------------------------------------- the history
def test_the_window_keeps_the_last_records_and_a_rollback_cuts_them_with_the_steps():
    h = History()
    for step in range(1, 301):
        h.add_step(step, 3.0, 1e-3, 0.1, 1000.0)
        h.fold(rows.row_of(record(step, [0.01, 0.02])))
    assert len(h.layers) == KEPT and [r.step for r in h.layers][0] == 300 - KEPT + 1
    h.cut(251)
    assert [r.step for r in h.layers][-1] == 250
    back = History.from_state(json.loads(json.dumps(h.state())))
    assert list(back.layers) == list(h.layers) and back.layers.blocks == 2
    older = h.state()
    del older["layers"]  # a summary from before layer records
    assert len(History.from_state(older).layers) == 0
    again = LayerWindow()
    again.add(record(5, [0.1]))
    again.add(record(4, [0.1]))  # a step again (a rollback's): the record it redoes goes
    assert [r.step for r in again] == [4]


def test_a_live_state_folds_the_event_as_the_folder_folds_the_row():
    state = RunState()
    state.apply(record(8, [0.01, 0.02]))
    assert [r.step for r in state.history.layers] == [8]
    bad = rows.row_of(record(8, [0.01]))
    bad["update_ratio"] = [0.01, "x"]
    assert not rows.well_formed(bad)


# ------------------------------------------------------------------- a tiny engine's rows
@pytest.fixture(scope="module")
def layered_run(tmp_path_factory):
    """A tiny run of 12 steps recording every 4 (checkpoints at 6 and 12): its folder and events."""
    cfg = tiny_config("logging.layer_stats_every=4", "checkpoint.every=6")
    engine, events = drive_engine(cfg, tmp_path_factory.mktemp("layers") / "run")
    assert engine.final_state == P.FINISHED
    return engine.run_dir, events


@pytest.mark.slow
def test_an_engine_records_each_block_at_the_steps_asked_only(layered_run):
    run_dir, events = layered_run
    metrics = read_metrics(run_dir)
    layers = [r for r in metrics if r["kind"] == "layers"]
    assert [r["step"] for r in layers] == [4, 8, 12]
    for r in layers:
        assert len(r["grad_norm"]) == len(r["update_ratio"]) == 2  # the debug preset's blocks
        values = [*r["grad_norm"], *r["update_ratio"], r["embed_grad_norm"], r["embed_update_ratio"]]
        assert all(math.isfinite(v) and v > 0 for v in values), r
    steps = {r["step"]: r for r in metrics if r["kind"] == "step"}
    assert {s for s, r in steps.items() if "layer_stats" in r["parts"]} == {4, 8, 12}
    # each layers row right after its step's row, and the same record reached the front-end
    order = [(r["kind"], r["step"]) for r in metrics if r["kind"] in ("step", "layers")]
    assert all(order[order.index(("layers", s)) - 1] == ("step", s) for s in (4, 8, 12))
    sent = [e for e in events if isinstance(e, P.LayerStats)]
    assert [rows.row_of(e, 0.0) | {"time": 0.0} for e in sent] == [r | {"time": 0.0} for r in layers]


@pytest.mark.slow
def test_the_folder_s_history_has_the_records_and_a_resume_keeps_those_before_its_checkpoint(layered_run, tmp_path):
    run_dir, events = layered_run
    live = RunState()
    for ev in events:
        live.apply(ev)
    history, _, _ = history_file.load(run_dir, write=False)
    assert list(history.layers) == list(live.history.layers) and [r.step for r in history.layers] == [4, 8, 12]
    copy = tmp_path / "run"
    copy.mkdir()
    (copy / METRICS).write_bytes((run_dir / METRICS).read_bytes())
    truncate_metrics(copy / METRICS, 6)  # what a resume from step 6's checkpoint does to the file
    resumed, _, _ = history_file.load(copy, write=False)
    assert [r.step for r in resumed.layers] == [4]


# -------------------------------------------------------------------------------- the panel
def test_the_heatmap_has_a_row_per_block_and_the_embedding_newest_at_the_right():
    window = LayerWindow()
    for step in range(10, 410, 10):
        window.add(record(step, [1e-3, 1e-2 if step == 400 else 1e-3, float("inf") if step == 390 else 1e-4]))
    lines = [line.plain for line in heat_lines(window, "update", 20)]
    assert [line[:4] for line in lines[:4]] == ["  0 ", "  1 ", "  2 ", "emb "]
    assert all(len(line) == 20 for line in lines[:4])  # 16 records of the 40: the newest
    assert lines[1][-1] == "█" and lines[1][-2] != "█" and lines[2][-2] == "!"
    assert lines[4] == "upd/w 1e-4…1e-2 @400"
    assert heat_lines(LayerWindow(), "update", 20) == []
    assert peak_text(window, "update") == "block 1: upd/w 1.0e-2 @400"
    assert peak_text(window, "grad") == "emb: grad 2.0e0 @400"


def layer_events() -> list[P.LayerStats]:
    """A 4-block run's records every 10 steps to step 240, block 2's update jumping 6x at 200 and 210."""
    out = []
    for step in range(10, 250, 10):
        decay = 1 - step / 500
        ratios = [0.004 * decay * (6.0 if b == 2 and 200 <= step <= 210 else 1.0) * (1 + 0.25 * b) for b in range(4)]
        out.append(P.LayerStats(step, [0.8 / (1 + b) * (2 - decay) for b in range(4)], ratios, 1.5, 0.002 * decay))
    return out


@pytest.mark.slow
def test_layers_panel_snapshot_120x40_open(snap_compare):
    async def open_layers(pilot):
        await pilot.pause()
        dash = pilot.app.screen
        side = dash.query_one("#side")
        side.chosen = "layers"
        dash.redraw()
        side.fit()
        await pilot.pause()
        panel = dash.query_one("#layers")
        assert panel.display and not panel.collapsed and side.max_scroll_y == 0
        lines = shown_in(pilot.app, panel)
        assert "layers" in lines[0] and any("upd/w" in line for line in lines)

    assert snap_compare(FedDashboard(layer_events(), device="cpu", gpus=0), terminal_size=(120, 40),
                        run_before=open_layers)


@pytest.mark.slow
def test_layers_panel_snapshot_80x24_a_line(snap_compare):
    async def collapsed(pilot):
        await pilot.pause()
        dash = pilot.app.screen
        dash.redraw()
        await pilot.pause()
        panel = dash.query_one("#layers")
        [line] = shown_in(pilot.app, panel)
        assert panel.collapsed and line.strip().startswith("▸ layers  block 3: upd/w"), line
        chart = dash.query_one("#loss")
        assert chart.region.width >= 40 and chart.region.height >= 6 and dash.query_one("#side").max_scroll_y == 0

    assert snap_compare(FedDashboard(layer_events(), device="cpu", gpus=0), terminal_size=(80, 24),
                        run_before=collapsed)


async def test_a_click_on_the_panel_switches_to_the_gradient_norm_and_back():
    app = FedDashboard(layer_events(), device="cpu", gpus=0)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        dash = app.screen
        side = dash.query_one("#side")
        side.chosen = "layers"
        side.fit()
        await pilot.pause()
        panel = dash.query_one("#layers")
        assert panel.metric == "update" and not panel.collapsed
        await pilot.click("#layers")
        await pilot.pause()
        lines = shown_in(app, panel)
        assert panel.metric == "grad" and any("gradient norm " in line for line in lines), lines  # the legend, in full
        assert "click: upd/w" in lines[-1]
        await pilot.click("#layers")
        await pilot.pause()
        assert panel.metric == "update" and any("upd/w" in line for line in shown_in(app, panel))

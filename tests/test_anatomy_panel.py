"""The cockpit's time panel: a bar per part of the recent steps, the work between steps, and the
MFU with what stands between it and the peak (tui/widgets/anatomy_panel.py); on the dashboard,
hidden until a step with parts arrives, then holding the run's MFU."""

from __future__ import annotations

import re

from lmcockpit.core import protocol as P
from lmcockpit.core.run.anatomy import Anatomy
from lmcockpit.core.run.history import History
from lmcockpit.tui.widgets.anatomy_panel import anatomy_lines, anatomy_summary

from .helpers import FedDashboard, shown_in


def known() -> Anatomy:
    """One step of a second: data 10%, forward+backward 70%, sync none, optimizer 20%; then an
    evaluation of 0.05 s and a checkpoint that took no time."""
    a = Anatomy()
    a.add({"data": 0.1, "compute": 0.7, "sync": 0.0, "optimizer": 0.2})
    a.add(None, {"evaluation": 0.05, "checkpoints": 0.0})
    return a


def plain(anatomy: Anatomy, mfu: float | None, width: int) -> list[str]:
    return [line.plain for line in anatomy_lines(anatomy, mfu, width)]


def test_a_bar_per_part_of_the_step_then_the_mfu_and_the_work_between_steps():
    # 25 columns (the side column's inside at 80x24): labels 9 wide, the share 5, a bar of 9: the whole step
    assert plain(known(), 0.35, 25) == [
        "data        10% ▉        ",
        "fwd+bwd     70% ██████▎  ",
        "optimizer   20% █▊       ",
        "sync 0%",  # under 1 %: no bar to see, no row of its own
        "MFU 35%, 50% in fwd+bwd",  # forward and backward alone reach 35% / 70%
        "validation 4.8%",  # of the whole run's 1.05 s; the checkpoint took none: not shown
    ]
    wide = plain(known(), 0.35, 33)
    assert wide[1] == "fwd+bwd     70% " + "█" * 11 + "▉     "  # 70% of a bar of 17
    assert wide[4] == "MFU 35% of peak, 50% in fwd+bwd" and all(len(line) <= 33 for line in wide)
    # a single GPU's step: data and sync too small to draw share a line
    gpu = Anatomy()
    gpu.add({"data": 0.00003, "compute": 0.56, "sync": 0.00002, "optimizer": 0.23995})
    assert plain(gpu, 0.41, 25)[:3] == ["fwd+bwd     70% ██████▎  ", "optimizer   30% ██▋      ",
                                        "data <0.1%, sync <0.1%"]


def test_no_mfu_on_a_cpu_no_bars_where_there_is_no_room_and_no_panel_before_parts():
    assert plain(known(), None, 25)[4:] == ["validation 4.8%"]
    assert plain(known(), None, 16) == ["data        10%", "fwd+bwd     70%", "optimizer   20%", "sync 0%",
                                        "validation 4.8%"]
    between_only = Anatomy()
    between_only.add(None, {"compile": 30.0})  # the step that compiled has no parts
    assert plain(Anatomy(), 0.4, 25) == [] and plain(between_only, 0.4, 25) == []


def test_the_work_between_steps_wraps_by_kind_a_share_beside_its_kind():
    a = known()
    a.add(None, {"compile": 0.5, "tasks": 0.2, "samples": 0.1, "checkpoints": 0.15})
    # of the run's 2 s: never "validation" on one line and its "2.5%" on the next
    assert plain(a, None, 25)[4:] == ["compile 25%,", "validation 2.5%,", "tasks 10%, samples 5.0%,", "checkpoints 7.5%"]


def test_the_collapsed_line_gives_forward_backward_first_then_the_rest_as_they_fit():
    a = known()
    assert anatomy_summary(a, 0.35, 60) == "fwd+bwd 70% · optimizer 20% · data 10% · MFU 35%"  # sync: under 1 %
    assert anatomy_summary(a, 0.35, 27) == "fwd+bwd 70% · optimizer 20%"  # no room for " · …" too
    assert anatomy_summary(a, 0.35, 19) == "fwd+bwd 70% · …"
    assert anatomy_summary(a, None, 40) == "fwd+bwd 70% · optimizer 20% · data 10%"


async def test_the_panel_appears_with_the_first_step_that_has_parts_and_takes_the_mfu():
    """A viewer reads a history from before steps had parts: no time panel, the MFU in the
    throughput panel. The engine's next step has parts: the panel shows, open at 120x40, with
    forward+backward's share and the MFU over it; the throughput panel leaves the MFU to it. At
    80x24 it is one line, and every panel still fits the column."""
    from lmcockpit.tui.widgets.panels import Panel

    old = History()
    for step in range(1, 241):
        old.add_step(step, 3.0, 1e-3, 0.8, 655_360.0)
    app = FedDashboard([P.HistoryRead(old)], device="cuda:0", gpus=1)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        dash = app.screen
        dash.redraw()
        await pilot.pause()
        panel, throughput = dash.query_one("#anatomy", Panel), dash.query_one("#throughput", Panel)
        assert not panel.display and "MFU" in dict(throughput.rows)

        parts = {"data": 0.0001, "compute": 0.4, "sync": 0.0001, "optimizer": 0.3998}
        dash.apply_events([P.StepMetrics(241, 3.0, 1e-3, 0.5, 655_360.0, 0.3, 0.8, 241 * 524_288, {}, parts)])
        dash.redraw()
        await pilot.pause()
        assert panel.display and not panel.collapsed and dash.query_one("#side").max_scroll_y == 0
        lines = [line.strip(" │") for line in shown_in(app, panel)]
        assert lines[0].startswith("╭─ time")
        assert re.fullmatch(r"fwd\+bwd +50% █{8}▌ *", lines[1]) and lines[2].startswith("optimizer   50% "), lines
        assert lines[3:] == ["data <0.1%, sync <0.1%", "MFU 30% of peak, 60% in fwd+bwd", "╰" + "─" * 35 + "╯"]
        assert "MFU" not in dict(throughput.rows)

        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        dash.redraw()
        await pilot.pause()
        [line] = shown_in(app, panel)
        assert panel.collapsed and line.strip().startswith("▸ time  fwd+bwd 50%"), line
        assert dash.query_one("#side").max_scroll_y == 0 and not throughput.collapsed

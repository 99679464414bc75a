"""Snapshots of the launch screen and of the dashboard fed a fixed event stream, at 80×24 and
120×40. Update them after an intended change with `pytest --snapshot-update` and review the SVGs."""

from __future__ import annotations

import math

import pytest
from textual.app import App

from lmcockpit.core import protocol as P
from lmcockpit.tui.app import CockpitApp
from lmcockpit.tui.screens.dashboard import DashboardScreen

SIZES = [(80, 24), (120, 40)]


def fixed_events() -> list[object]:
    run = "runs/cpu-20261123-120000"
    events: list[object] = [
        P.StateChanged(P.PREPARING),
        P.LogLine("data: reusing token cache ~/.cache/lmcockpit/9f7e97d0744113f743ad"),
        P.LogLine("model: 5,245,696 parameters, 4 layers, d_model 256, 4 heads / 2 kv heads"),
        P.RunStarted(run, {"sample": {"max_new_tokens": 48}}, 5_245_696, "cpu", "fp32", 0, 400, 4096),
        P.StateChanged(P.RUNNING),
    ]
    for step in range(1, 241):
        loss = 3.2 + 5.8 * math.exp(-step / 40) + 0.15 * math.sin(step / 3)
        lr = 0.006 * min(1.0, step / 20) * (0.55 + 0.45 * math.cos(math.pi * step / 400))
        events.append(P.StepMetrics(step, loss, lr, 0.5, 5000.0, None, 0.82, step * 4096, {}))
        if step % 100 == 0:
            events.append(P.EvalMetrics(step, loss + 0.2, (loss + 0.2) / 2.4))
            events.append(P.StateChanged(P.RUNNING))
    events += [P.CheckpointWritten(200, f"{run}/checkpoints/step_000200"),
               P.LogLine(f"checkpoint: step 200 written to {run}/checkpoints/step_000200")]
    return events


class FedDashboard(App):
    """The dashboard with no engine: events come from the test (the fixed ones, then `then`), the
    clock stands still."""
    CSS_PATH = CockpitApp.CSS_PATH

    def __init__(self, then: list[object] = ()) -> None:
        super().__init__()
        self.then = list(then)

    async def on_mount(self) -> None:
        screen = DashboardScreen(None, "cpu", clock=lambda: 1000.0, telemetry=None)
        await self.push_screen(screen)
        screen.apply_events(fixed_events() + self.then)
        screen.redraw()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_dashboard_snapshot(snap_compare, size):
    assert snap_compare(FedDashboard(), terminal_size=size)


def test_ended_dashboard_snapshot(snap_compare):
    """Aborted at step 240: the footer trades p, c and a for b (back to the launch screen)."""
    assert snap_compare(FedDashboard([P.StateChanged(P.ABORTED)]), terminal_size=(80, 24))


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_launch_screen_snapshot(snap_compare, size, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no runs here: the recent-runs table is empty and stable
    # no token caches either: the token budget is the estimate, not a count another test left
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert snap_compare(CockpitApp(runs_root=tmp_path / "runs", telemetry=False), terminal_size=size)

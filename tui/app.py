"""The cockpit: a Textual app that launches, watches and steers training runs.

It never imports torch: the engine process owns it, and hardware readings come from NVML and
psutil in this process. The launch screen starts runs; each run gets a dashboard.
"""

from __future__ import annotations

import time
from pathlib import Path

from textual.app import App

from lmcockpit.core.config import Config, ConfigError
from lmcockpit.core.rendezvous import Rendezvous
from lmcockpit.core.resume import plan_resume
from lmcockpit.core.runfolder import create_run_dir
from lmcockpit.core.runner import EngineProcess
from lmcockpit.core.telemetry import Telemetry
from lmcockpit.tui.runplan import RunPlan
from lmcockpit.tui.screens.dashboard import DashboardScreen
from lmcockpit.tui.screens.launch import LaunchScreen


class CockpitApp(App):
    CSS_PATH = Path(__file__).with_name("cockpit.tcss")
    TITLE = "lmcockpit"

    def __init__(self, start: RunPlan | None = None, runs_root: Path = Path("runs"),
                 telemetry: bool = True, clock=time.monotonic):
        super().__init__()
        self.start = start
        self.runs_root = runs_root
        self.telemetry = Telemetry() if telemetry else None
        self.clock = clock
        self.engines: list[EngineProcess] = []

    def on_mount(self) -> None:
        if self.start is not None:
            self.start_run(self.start)
        else:
            self.push_screen(LaunchScreen(self.runs_root, self.telemetry))

    def start_run(self, request: RunPlan) -> DashboardScreen:
        engine = EngineProcess(request.cfg, request.run_dir, request.resume_from, request.rendezvous)
        engine.start()
        self.engines.append(engine)
        screen = DashboardScreen(engine, request.title, self.clock, self.telemetry)
        self.push_screen(screen)
        return screen

    def launch(self, cfg: Config, name: str) -> None:
        try:
            # Several machines meet at an endpoint only the command line gives (--rdzv-endpoint):
            # say so here, before a run folder exists, rather than fail in the engine.
            if cfg.world > 1:
                Rendezvous().check(cfg)
            run_dir = create_run_dir(cfg, name, None if self.runs_root == Path("runs") else
                                     str(self.runs_root / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"))
        except ConfigError as e:
            self.notify(str(e), severity="error")
            return
        self.start_run(RunPlan(cfg, run_dir, None, name))

    def resume(self, run: str) -> None:
        try:
            plan = plan_resume(run, [], None)
        except ConfigError as e:
            self.notify(str(e), severity="error")
            return
        self.start_run(RunPlan(plan.cfg, plan.run_dir, plan.checkpoint, Path(run).name))

    def on_unmount(self) -> None:
        """However the app ends, no run is left training unseen: each one checkpoints and stops."""
        from lmcockpit.core import protocol as P

        for engine in self.engines:
            engine.send(P.Abort(save=True, interrupted=True))

    def stop_engines(self, timeout: float = 120) -> None:
        """After the app closes: any run still going is stopped with a checkpoint, never abandoned."""
        from lmcockpit.core import protocol as P

        for engine in self.engines:
            if engine.process.is_alive():
                engine.send(P.Abort(save=True, interrupted=True))
        for engine in self.engines:
            engine.join(timeout)
            engine.kill()

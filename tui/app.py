"""The cockpit: a Textual app that launches, watches and steers training runs.

It never imports torch: the engine process owns it, and hardware readings come from NVML and
psutil in this process. The launch screen starts runs; each run gets a dashboard.

Every run it starts goes through a run host (core/process/host.py), in a session of its own, and
the cockpit is one of the host's viewers: leaving the cockpit (d, the quit dialog's "leave it
training", a closed terminal) leaves the run training, and `lmcockpit attach` comes back to it.
Only the quit dialog's "stop" (or the abort dialog) stops a run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from textual.app import App
from textual.binding import Binding
from textual.worker import Worker

from ..core import protocol as P
from ..core.config import Config, ConfigError
from ..core.hardware.telemetry import Telemetry
from ..core.process import host
from ..core.process.rendezvous import Rendezvous
from ..core.process.viewer import NotLive, RunViewer
from ..core.run.folder import create_run_dir
from ..core.run.resume import plan_resume
from ..core.tasks import hub_tasks
from .runplan import RunPlan, check_before_start
from ..core.run.state import RunState
from .screens.dashboard import DashboardScreen
from .screens.dialogs import QuitDialog
from .screens.launch import LaunchScreen


def exit_code_of(views: list[RunState]) -> int:
    """The exit code of a session that watched these runs, as `--run` says it for one: 1 if one
    failed, else 2 if one was refused for a mistake in its input, else 130 if one was interrupted,
    else 0 (finished, aborted, or left training)."""
    codes = {2 if v.failure is not None and v.failure.user_error else 1 for v in views if v.state == P.FAILED}
    codes |= {130 for v in views if v.state == P.INTERRUPTED}
    return next((code for code in (1, 2, 130) if code in codes), 0)


class CockpitApp(App):
    CSS_PATH = Path(__file__).with_name("cockpit.tcss")
    TITLE = "lmcockpit"
    # Ctrl-C quits as `q` does, through the quit dialog while a run is going, not Textual's "press
    # ctrl+q" notice; text selected on the screen or in a prompt is still copied by it first.
    BINDINGS = [Binding("ctrl+c", "quit_cockpit", "Quit", show=False)]

    def __init__(self, start: RunPlan | None = None, runs_root: Path = Path("runs"),
                 telemetry: bool = True, clock=time.monotonic, attach: Path | None = None):
        super().__init__()
        self.start = start
        self.attach_to = attach
        self.runs_root = runs_root
        self.telemetry = Telemetry() if telemetry else None
        self.clock = clock
        self.engines: list[RunViewer] = []  # the runs this cockpit watches (started here or attached to)
        self.dashboards: list[DashboardScreen] = []  # every run of this session, in order, kept after going back
        self.run_dirs: list[Path] = []  # their folders: the launch screen lists them wherever they are
        self.preparing: Worker | None = None  # the run being checked and made, before its host starts

    def run(self, *args, **kwargs):
        """The app in the terminal; once the terminal is back, each run's folder is printed there."""
        try:
            return super().run(*args, **kwargs)
        finally:
            if report := self.run_report():
                print(report, flush=True)

    @property
    def exit_code(self) -> int:
        """What the command exits with: Textual's own code if the app itself failed, else how this
        session's runs went (exit_code_of)."""
        return self.return_code or exit_code_of([dash.view for dash in self.dashboards])

    def run_report(self) -> str:
        """A line per run started in this session: its folder and how it ended (or that it is being
        stopped with a checkpoint, as `on_unmount` asked)."""
        lines = []
        for dash in self.dashboards:
            v = dash.view
            if v.state in P.TERMINAL_STATES:
                how = f"{v.state} at step {v.step}"
            elif dash.stopping:
                how = f"stopping at step {v.step}, with a checkpoint"
            else:
                how = f"training, at step {v.step}: lmcockpit attach {dash.engine.run_dir}"
            lines.append(f"run folder: {dash.engine.run_dir} ({how})")
        return "\n".join(lines)

    def action_quit_cockpit(self) -> None:
        """As `q` on a dashboard: with its run going, the quit dialog (stop it, or leave it
        training); else quit. From any screen: the dashboard is the newest one in the stack."""
        if isinstance(self.screen, QuitDialog):
            return  # asked already
        dashboards = [s for s in self.screen_stack if isinstance(s, DashboardScreen)]
        if dashboards and dashboards[-1].running:
            self.push_screen(QuitDialog(), dashboards[-1].on_quit_choice)
        else:
            self.exit()

    def on_mount(self) -> None:
        if self.start is not None:
            self.start_run(self.start)
        elif self.attach_to is not None:
            self.attach(self.attach_to)
        else:
            self.push_screen(self.launch_screen())

    def launch_screen(self) -> LaunchScreen:
        return LaunchScreen(self.runs_root, self.telemetry, self.run_dirs)

    def start_run(self, request: RunPlan) -> DashboardScreen | None:
        try:
            process = host.start(request.run_dir, request.resume_from, request.rendezvous, request.title)
            viewer = RunViewer(request.run_dir, process)
        except (host.HostError, NotLive) as e:
            self.no_run(str(e))
            return None
        return self.open_dashboard(viewer, request.title)

    def attach(self, run_dir: Path) -> DashboardScreen | None:
        """A dashboard on a run that a host serves (started here earlier, elsewhere, or by --detach)."""
        try:
            viewer = RunViewer(run_dir)
        except NotLive as e:
            self.no_run(str(e))
            return None
        return self.open_dashboard(viewer, Path(run_dir).name)

    def no_run(self, why: str) -> None:
        self.notify(why, severity="error", timeout=10)
        if not self.screen_stack or len(self.screen_stack) == 1:  # nothing else to show: the launch screen
            self.push_screen(self.launch_screen())

    def open_dashboard(self, engine: RunViewer, title: str) -> DashboardScreen:
        self.engines.append(engine)
        screen = DashboardScreen(engine, title, self.clock, self.telemetry)
        self.dashboards.append(screen)
        if engine.run_dir not in self.run_dirs:
            self.run_dirs.append(engine.run_dir)
        self.push_screen(screen)
        return screen

    def back_to_launch(self) -> None:
        """From an ended run's dashboard to the launch screen it was launched from (which re-reads
        the recent runs as it comes back); started on a run (`lmcockpit PRESET`), to a new one in
        the dashboard's place. Either way the dashboard closes: its run folder stays listed."""
        if isinstance(self.screen_stack[-2] if len(self.screen_stack) > 1 else None, LaunchScreen):
            self.pop_screen()
        else:
            self.switch_screen(self.launch_screen())

    def new_run(self, cfg: Config, name: str, base: str | None = None) -> Worker | None:
        """A new run of `cfg` from the launch screen: checked, its folder made, its host started;
        with `base` (a run or checkpoint folder), a fine-tuning run from it, as --from starts one."""
        def prepare() -> RunPlan:
            nonlocal cfg
            if base:  # here, in the thread: it reads the base's checkpoint and tokenizer
                from ..core.data.base_model import plan_from

                cfg = plan_from(cfg, base)
            # Several machines meet at an endpoint only the command line gives (--rdzv-endpoint):
            # say so here, before a run folder exists, rather than fail in the engine.
            if cfg.world > 1:
                Rendezvous().check(cfg)
            run_dir = create_run_dir(cfg, name, None if self.runs_root == Path("runs") else
                                     str(self.runs_root / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"),
                                     check=check_before_start)
            return RunPlan(cfg, run_dir, None, name)

        if hub := [task for task in cfg.eval.tasks if task in hub_tasks.HUB]:
            self.notify(f"eval.tasks: {', '.join(hub)}: read from the Hugging Face Hub's cache, fetched into it "
                        "the first time…", timeout=10)
        return self.prepare_then_start(prepare)

    def resume(self, run: str) -> Worker | None:
        def prepare() -> RunPlan:
            plan = plan_resume(run, [], None, check=check_before_start)
            return RunPlan(plan.cfg, plan.run_dir, plan.checkpoint, Path(run).name, in_place=plan.in_place)

        return self.prepare_then_start(prepare)

    def prepare_then_start(self, prepare: Callable[[], RunPlan]) -> Worker | None:
        """`prepare` in a thread, then its run started, or its refusal shown: the checks may fetch a
        Hub task (minutes, the first time) or reach a rendezvous endpoint, and the cockpit keeps
        drawing meanwhile. One run is prepared at a time; `self.preparing` is its worker."""
        if self.preparing is not None and self.preparing.is_running:
            self.notify("a run is being prepared: one at a time", severity="warning")
            return None

        def work() -> None:
            try:
                plan = prepare()
            except ConfigError as e:
                self.call_from_thread(self.notify, str(e), severity="error")
                return
            self.call_from_thread(self.start_run, plan)

        self.preparing = self.run_worker(work, name="prepare a run", group="prepare", thread=True)
        return self.preparing

    def on_unmount(self) -> None:
        """However the app ends, the runs go on (their hosts serve them): it only lets go of them."""
        for engine in self.engines:
            engine.close()

    def stop_runs(self, timeout: float = 120) -> None:
        """Stop every run this cockpit watched that is still going, with a checkpoint, and wait for
        their hosts to end: what tests do after the app, and what "stop" in the quit dialog does."""
        for engine in self.engines:
            if engine.host_alive:
                engine.send(P.Abort(save=True, interrupted=True))
        for engine in self.engines:
            engine.join(timeout)

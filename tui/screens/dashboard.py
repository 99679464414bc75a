"""The dashboard: a live run's charts, panels, log, controls, failure panel and chat pane.

Engine events arrive in batches through the bridge's thread worker. Applying a batch only folds
events into the RunState and writes log lines; panels and charts redraw from a timer at a bounded
rate.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Input, Static

from ...core import protocol as P
from ...core.process.notify import in_tmux, terminal_escape
from ...core.config import ConfigError
from ...core.hardware.telemetry import ProcessLoad, Reading, Telemetry, find_gpu
from ...core.infer.chat_model import trained_to_chat
from ...core.process.viewer import RunViewer
from ...core.run.curves import load_run
from ..bridge import EngineEvents, drain
from ..formatting import fmt_duration
from ...core.run.state import RunState
from .dialogs import AbortDialog, BaselinePicker, HelpScreen, QuitDialog, past_runs
from ..widgets.anatomy_panel import AnatomyPanel
from ..widgets.charts import Baseline, LossChart
from ..widgets.chat_pane import ChatPane
from ..widgets.glance import device_lines, failure_text, run_gpus, step_text
from ..widgets.layer_panel import LayerPanel
from ..widgets.log_pane import LogPane
from ..widgets.panels import (Panel, SideColumn, cpu_memory_rows, gpu_layout, gpu_panel, host_rows,
                                          memory_rows, spark, state_rows, state_text, target_text, throughput_rows)
from ..widgets.task_panel import TaskPanel, references_of

# Seconds between redraws of a dashboard that changed: a redraw (Textual laying out and rendering
# every panel, plotext rebuilding the chart) costs some 50 ms of a core here whatever the run's
# length; twice a second made watching cost 12-14 % of one of two cores beside the run it watches.
REDRAW_EVERY = 1.0
NARROW, SHORT, TALL = 100, 30, 40  # below the first two the side panels and the log shrink; from TALL the log grows
CHAT_BESIDE = 140  # from this width the chat pane opens beside the chart; below, under it
CHAT_TITLE = "chat · Esc leaves the prompt · t closes"
# What the run host logs as each viewer comes and goes (core/process/host.py): a count for the top
# bar, not lines for the log pane, which at 80x24 shows two.
VIEWERS_LINE = re.compile(r"host: a viewer (?:attached|detached) \((\d+) watching\)")


def height(content: Text | str, width: int) -> int:
    """The lines `content` takes at `width`, its long lines wrapped."""
    text = content if isinstance(content, Text) else Text(content)
    return sum(max(1, -(-line.cell_len // width)) for line in text.split("\n", allow_blank=True))


class ProfileKey:
    """The dashboard's `f`: torch.profiler over the run's next steps while it trains on
    (core/train/profiling.py); the trace goes to the run folder, the summary to the log."""

    def action_profile(self) -> None:
        if self.running:
            ask = P.Profile()
            self.engine.send(ask)
            self.notify(f"profile: the next {ask.steps} steps after a warm-up step; the trace goes to "
                        f"{self.view.run_dir}/profiles/step_N/trace.json.gz, the summary to the log", timeout=6)


class DashboardScreen(ProfileKey, Screen):
    BINDINGS = [
        ("p", "toggle_pause", "Pause/Resume"),
        ("c", "checkpoint", "Checkpoint"),
        Binding("f", "profile", "Profile the next steps", show=False),  # no room in the footer at 80 columns; ? lists it
        ("a", "abort", "Abort"),
        ("l", "log_scale", "Log scale"),
        ("t", "chat", "Chat"),
        ("d", "detach", "Detach"),
        ("e", "expand", "Panels"),
        # Esc reaches the screen from the chat prompt too (the prompt takes every other key)
        Binding("escape", "leave_chat", "Chat: leave the prompt, then close", show=False),
        ("b", "baseline", "Baseline"),
        # once the run has ended (p, c and a then leave the footer): back to the launch screen
        ("n", "back", "New run"),
        ("question_mark", "help", "Help"),
        ("q", "quit_run", "Quit"),
    ]

    def __init__(self, engine: RunViewer | None, title: str, clock=time.monotonic,
                 telemetry: Telemetry | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.run_title = title
        self.view = RunState(clock=clock)
        self.shown: dict[str, Text | str] = {}  # what `put` last put in each line of the screen
        if engine is not None:  # known before the engine says anything, so a failure can show it
            self.view.run_dir = str(engine.run_dir)
        self.telemetry = telemetry
        self.reading: Reading | None = None
        # the run's processes, read on this machine (a viewer attaches through a local socket)
        self.run_pid: int | None = engine.pid if engine is not None else None
        self.load: ProcessLoad | None = None
        self.util_history: dict[int, list[float]] = {}  # by NVML index: every GPU, so none starts blank
        self.devices: tuple[str, ...] | None = None  # this node's devices, once RunStarted names them
        self.device_uuids: tuple[str, ...] = ()  # theirs, where the engine sent them
        self.world = 1
        self.gpu_keys: list[str] = []  # gpu_layout's keys of the GPU panels now mounted
        self.gpu_panels: list[Panel] = []
        self.dirty = True
        self.quit_when_done = self.stopping = False  # stopping: this cockpit asked the run to stop, so quitting does not leave it training
        self.baseline_path = ""  # the run drawn under the live curves, if any
        self.watching = engine.viewers if engine is not None else 0  # cockpits attached to the run, this one too

    # --------------------------------------------------------------------------------- layout
    def compose(self) -> ComposeResult:
        yield Static(id="topbar")
        with Horizontal(id="body"):  # vertical when the chat pane goes under the chart
            with Vertical(id="work"):
                with Horizontal(id="main"):
                    with Vertical(id="left"):
                        yield LossChart(id="loss")
                        yield Static(id="lr")
                    with SideColumn(id="side"):
                        yield Panel("run", id="state")
                        yield Panel("target", id="target")  # hidden while the run has no target
                        yield Panel("throughput", id="throughput")
                        yield AnatomyPanel(id="anatomy")  # hidden until a step has parts
                        yield LayerPanel(id="layers")  # hidden until the run records layer stats
                        yield TaskPanel(id="tasks")  # hidden while the run has no tasks
                        yield Vertical(id="gpus")  # one panel per GPU the run uses, mounted by redraw
                        yield Panel("memory", id="memory")
                        yield Panel("host", id="host")
                yield Static(id="stepline")
                yield Static(id="devices")  # a bar per GPU, or the CPU run's own load
                yield Static(id="failure")
                yield LogPane(5000, id="log")
            yield ChatPane(self.send_sample, id="chat")
        yield Footer(show_command_palette=False)  # its room goes to the run's keys; Ctrl+P still opens it

    def on_mount(self) -> None:
        self.query_one("#log", LogPane).border_title = "log"
        self.query_one("#target", Panel).display = False
        self.query_one("#chat").border_title = CHAT_TITLE
        self.on_resize()
        self.set_interval(REDRAW_EVERY, self.redraw)
        if self.telemetry is not None:
            self.sample_telemetry()
            self.set_interval(1.0, self.sample_telemetry)
        if self.engine is not None:
            self.drain_engine()
        self.redraw()

    def on_resize(self, event=None) -> None:
        self.set_class(self.size.width < NARROW, "narrow")
        self.set_class(self.size.height < SHORT, "short")
        self.set_class(self.size.height >= TALL, "tall")
        self.set_class(self.size.width < CHAT_BESIDE, "stacked")
        self.dirty = True  # the GPU panels' layout follows the width

    # ---------------------------------------------------------------------------- the bridge
    @work(thread=True, exclusive=True, group="engine-events")
    def drain_engine(self) -> None:
        drain(self.engine, self)

    def on_engine_events(self, message: EngineEvents) -> None:
        self.apply_events(message.events)

    def apply_events(self, events: list[object]) -> None:
        log = self.query_one("#log", LogPane)
        for ev in events:
            self.view.apply(ev)
            if isinstance(ev, P.LogLine):
                if viewers := VIEWERS_LINE.fullmatch(ev.text):
                    self.watching = int(viewers[1])
                else:
                    log.add(ev.text)
            elif isinstance(ev, P.SampleText):
                self.query_one(ChatPane).receive(ev)
            elif isinstance(ev, P.RunStarted):
                if self.view.config:
                    self.query_one(ChatPane).configure(self.view.config.sample, chat=trained_to_chat(self.view.config))
                self.devices, self.world = ev.devices or (ev.device,), ev.world
                self.device_uuids = ev.device_uuids
            elif isinstance(ev, P.StateChanged) and ev.state in P.TERMINAL_STATES:
                self.on_terminal(ev)
            elif isinstance(ev, P.StateChanged) and ev.state == P.STALLED:
                self.announce("stalled", f"run stalled at step {self.view.step}: {ev.detail}", "error")
            elif isinstance(ev, P.SpikeSeen) and ev.live:
                self.announce("spike", f"loss spike at step {ev.step}: {ev.loss:.4g} ({ev.action})", "warning")
            elif isinstance(ev, P.TargetReached):
                what = "val loss" if ev.what == "val_loss" else ev.what
                after = f" after {fmt_duration(ev.seconds)} of training" if ev.seconds is not None else ""
                self.announce("target", f"target {what} {ev.target:g} reached at step {ev.step}{after}")
        self.dirty = True
        if any(isinstance(ev, P.HistoryRead) for ev in events):
            self.redraw()  # the run as it stands, at once: not up to a REDRAW_EVERY later

    def announce(self, what: str, text: str, severity: str = "information") -> None:
        """A toast; with notify.terminal, the terminal's own notification (OSC 777 and 9, wrapped
        for tmux's passthrough inside tmux) and its bell, which always gets through."""
        self.notify(text, severity=severity, timeout=10)
        if self.view.config and not self.view.config.notify.terminal:
            return
        app = self.app
        # Textual's driver is private, and kept: Textual has no public way to send the terminal an
        # escape sequence of one's own (App.bell and copy_to_clipboard write theirs the same way).
        if not app.is_headless and app._driver is not None:  # as App.bell writes its BEL
            app._driver.write(terminal_escape(f"lmcockpit: {what}", text, tmux=in_tmux()))

    def on_terminal(self, ev: P.StateChanged) -> None:
        v = self.view
        if ev.state == P.FAILED:
            self.show_failure()
            self.announce("failed", f"run failed at step {v.step}", "error")
        else:
            self.announce(ev.state, f"run {ev.state} at step {v.step}: n goes back to the launch screen")
        self.refresh_bindings()  # p, c and a leave the footer; n joins it
        if self.quit_when_done:
            self.app.exit()

    def show_failure(self) -> None:
        self.query_one("#failure", Static).update(failure_text(self.view))
        self.add_class("failed")

    # --------------------------------------------------------------------------------- redraw
    def sample_telemetry(self) -> None:
        self.reading = self.telemetry.read()
        self.load = self.telemetry.process_load(self.run_pid) if self.run_pid is not None else None
        for g in self.reading.gpus:
            if g.util is not None:
                self.util_history[g.index] = (self.util_history.get(g.index, []) + [g.util])[-120:]
        self.dirty = True

    def gpu_indices(self) -> list[int]:
        """NVML indices of the GPUs this run trains on here; until RunStarted names them (while
        preparing or compiling), the first GPU; empty for a CPU run."""
        return run_gpus(self.devices, self.device_uuids, self.reading)

    @property
    def on_gpu(self) -> bool:
        return any(d.startswith("cuda") for d in self.devices or ())

    def redraw_gpus(self, indices: list[int], inside: int) -> None:
        narrow = self.has_class("narrow")
        keys = ["unlisted"] if self.on_gpu and not indices else gpu_layout(indices, narrow)
        if keys != self.gpu_keys:
            self.mount_gpu_panels(keys)
        no_gpu = self.telemetry.nvml_error if self.telemetry else ""
        for key, panel in zip(keys, self.gpu_panels, strict=True):
            panel.border_title, content = gpu_panel(key, indices, self.reading, self.util_history, no_gpu, narrow)
            if isinstance(content, list):
                panel.show_rows(content, inside)
            else:
                panel.show(content)

    def mount_gpu_panels(self, keys: list[str]) -> None:
        """Replace the GPU panels: classes, not ids, name them, as the old ones leave only after
        this call returns."""
        box = self.query_one("#gpus", Vertical)
        box.remove_children()
        self.gpu_keys = keys
        self.gpu_panels = [Panel("GPU", classes=f"gpu gpu-{key}") for key in keys]
        box.mount_all(self.gpu_panels)

    def redraw(self) -> None:
        if not self.dirty:
            chart = self.query_one("#loss", LossChart)
            if chart.waiting:  # a paused run's newest points, say
                chart.redraw()
            return
        self.dirty = False
        v = self.view
        # other cockpits attached to the run: a count here, not a line in the log at each coming and going
        others = f" · {self.watching} watching" if self.watching > 1 else ""
        top = Text.assemble((f" lmcockpit · {self.run_title} ", "bold reverse"), "  ", state_text(v),
                            (f" · step {v.step}/{v.max_steps}" if v.max_steps else "", "bold"), (others, "dim"))
        self.put("#topbar", top)
        side = self.query_one(SideColumn)
        # an open panel's inside: the column's width less the panel's border and padding
        inside = (side.size.width or (29 if self.has_class("narrow") else 37)) - 4
        self.query_one("#state", Panel).show_rows(state_rows(v, self.world), inside)
        target = self.query_one("#target", Panel)
        ahead = target_text(v)
        if target.display != (ahead is not None):
            target.display = ahead is not None
        target.show_rows([("", ahead or "")], inside)
        timed = self.query_one("#anatomy", AnatomyPanel).show_anatomy(v, inside)  # it holds the MFU then
        self.query_one("#throughput", Panel).show_rows(throughput_rows(v, target=False, mfu=not timed), inside)
        self.query_one("#layers", LayerPanel).show_layers(v, inside)
        self.query_one("#tasks", TaskPanel).show_tasks(v, inside, references_of(v.config))
        gpus = self.gpu_indices()
        self.redraw_gpus(gpus, inside)
        memory = (memory_rows(v, find_gpu(self.reading, gpus[0]) if gpus else None) if gpus or self.on_gpu
                  else cpu_memory_rows(self.load, self.reading))
        self.query_one("#memory", Panel).show_rows(memory, inside)
        self.query_one("#host", Panel).show_rows(host_rows(self.reading), inside)
        lr_line = f"lr {v.lr:.2e} " if v.lr is not None else "lr – "
        width = max(8, self.query_one("#lr").size.width - len(lr_line) - 1)
        # The history gives between n and 2n points for 2n asked: `width` of them, evenly taken.
        points = v.history.points(2 * width)
        lrs = [points[i * len(points) // width].lr for i in range(width)] if len(points) > width else [p.lr for p in points]
        lr_max = max(lrs) if lrs else 1.0
        self.put("#lr", lr_line + spark([x / lr_max * 100 for x in lrs], width))
        width = self.query_one("#stepline").content_region.width or self.size.width
        self.put("#stepline", step_text(v, width))
        self.put("#devices", device_lines(self, gpus, width))
        side.fit()
        chart = self.query_one("#loss", LossChart)
        chart.set_data(v.history)
        chart.redraw()

    def put(self, selector: str, content: Text | str) -> None:
        """`content` in the Static at `selector`, only where it changed: each update renders the
        widget again, and most lines stay the same from one redraw to the next."""
        before = self.shown.get(selector)
        if before != content:
            self.shown[selector] = content
            widget = self.query_one(selector, Static)
            # the screen laid out again only where the widget's height changes (a layout of the
            # whole dashboard costs more than rendering one line)
            width = widget.content_size.width
            widget.update(content, layout=before is None or not width or height(before, width) != height(content, width))

    # -------------------------------------------------------------------------------- actions
    @property
    def running(self) -> bool:
        return self.engine is not None and not self.engine.done

    @property
    def ended(self) -> bool:
        """The run reached its end (finished, failed, aborted, interrupted), as the events told."""
        return self.view.state in P.TERMINAL_STATES

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # the run's controls only while it runs; the way back only once it has ended
        if action in ("toggle_pause", "checkpoint", "abort", "detach", "profile"):
            return not self.ended
        if action == "back":
            return self.ended
        return True

    def action_back(self) -> None:
        # The run's notices ("run finished at step N: n goes back…") are the dashboard's: they
        # would stay over the launch screen's tables for their timeout.
        self.app.clear_notifications()
        self.app.back_to_launch()

    def action_toggle_pause(self) -> None:
        if self.running:
            self.engine.send(P.Resume() if self.view.paused else P.Pause())

    def action_checkpoint(self) -> None:
        if self.running:
            self.engine.send(P.CheckpointNow())
            self.notify("checkpoint requested: written after the current step")

    def action_abort(self) -> None:
        if self.running:
            self.app.push_screen(AbortDialog(), self.on_abort_choice)

    def action_detach(self) -> None:
        """Leave the cockpit; the run trains on, and `lmcockpit attach` comes back to it."""
        if self.running:
            self.app.exit()

    def on_abort_choice(self, choice: str | None) -> None:
        if choice in ("save", "nosave") and self.running:
            self.stopping = True
            self.engine.send(P.Abort(save=choice == "save"))
            self.notify("stopping: " + ("writing a checkpoint first" if choice == "save" else "without saving"))

    def action_expand(self) -> None:
        """Open the next side panel; the others collapse to a line each where they do not fit."""
        side = self.query_one(SideColumn)
        name = side.cycle()
        shut = all(p.collapsed for p in dict(side.groups()).get(name, []))
        self.notify(f"{name} panel " + ("chosen: no room to open it here" if shut else "open"), timeout=2)

    def action_baseline(self) -> None:
        """Pick a past run (any with steps: finished, stopped, failed) to draw under the live curves,
        or take the one shown away."""
        runs = past_runs(self.view.run_dir, getattr(self.app, "runs_root", Path("runs")),
                         getattr(self.app, "run_dirs", []))
        showing = self.query_one("#loss", LossChart).baseline
        if not runs and showing is None:
            self.notify(f"no other run with steps under {getattr(self.app, 'runs_root', 'runs')}/ to draw as a "
                        "baseline", severity="warning")
            return
        self.app.push_screen(BaselinePicker(runs, self.baseline_path), self.on_baseline_choice)

    def on_baseline_choice(self, path: str | None) -> None:
        if path is None:
            return
        if not path:
            self.show_baseline("", None)
            return
        self.load_baseline(path)

    @work(thread=True, exclusive=True, group="baseline")
    def load_baseline(self, path: str) -> None:
        """Read in a thread: a long run's metrics.jsonl takes a second or more."""
        try:
            baseline = Baseline.of(load_run(path))
        except (ConfigError, OSError, ValueError) as e:
            self.app.call_from_thread(self.notify, f"baseline: {e}", severity="error")
            return
        self.app.call_from_thread(self.show_baseline, path, baseline)

    def show_baseline(self, path: str, baseline: Baseline | None) -> None:
        self.baseline_path = path
        chart = self.query_one("#loss", LossChart)
        chart.baseline = baseline
        self.dirty = True
        self.redraw()
        self.notify(f"baseline: {baseline.name}" if baseline else "baseline removed", timeout=3)

    def action_log_scale(self) -> None:
        chart = self.query_one("#loss", LossChart)
        chart.log_scale = not chart.log_scale
        self.dirty = True
        self.redraw()

    def action_chat(self) -> None:
        self.toggle_class("chatting")
        if self.has_class("chatting"):
            self.query_one("#chat-input", Input).focus()
        else:
            self.leave_chat_input()

    def action_leave_chat(self) -> None:
        """Esc: out of the chat prompt, so the cockpit's keys work again (t then closes the pane);
        with the prompt already left, Esc closes the pane."""
        if not self.has_class("chatting"):
            return
        if not self.leave_chat_input():
            self.remove_class("chatting")

    def leave_chat_input(self) -> bool:
        """Take the focus off the chat pane; whether it had it."""
        focused = self.focused
        if focused is not None and self.query_one(ChatPane) in focused.ancestors_with_self:
            self.set_focus(None)
            return True
        return False

    def send_sample(self, request: P.Sample) -> bool:
        if not self.running:
            return False
        self.engine.send(request)
        return True

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen(self.BINDINGS))

    def action_quit_run(self) -> None:
        if not self.running:
            self.app.exit()
            return
        self.app.push_screen(QuitDialog(), self.on_quit_choice)

    def on_quit_choice(self, choice: str | None) -> None:
        if choice == "detach":
            self.app.exit()
        elif choice == "stop" and self.running:
            self.quit_when_done = self.stopping = True
            self.engine.send(P.Abort(save=True))
            self.notify("stopping the run: writing a checkpoint, then quitting")

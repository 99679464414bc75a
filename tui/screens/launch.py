"""The launch screen: the hardware, the presets and their settings, and the runs to attach or resume.

This machine's hardware, the presets, the selected preset's settings (edited
with validation as you type, saved as a new TOML), and the runs: those training in the background
first (Enter attaches; dead ones say so and resume), then the recent ones to resume."""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter
from pathlib import Path

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Container, Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input, Static

from ...core.config import Config, ConfigError, load_config, shipped_presets, toml_value
from ...core.data import budget as data_budget
from ...core.hardware.compute_estimate import training_time
from ...core.hardware.telemetry import GPUReading, Reading, Telemetry, cuda_gpu_count
from ...core.process import live
from ...core.run.folder import CONFIG, UNREADABLE, recent_runs, run_summary, write_config
from ..rows import VERDICT_STYLE, preset_rows
from ..formatting import DASH, fmt_duration


def flatten(cfg: Config) -> list[tuple[str, str]]:
    return [(f"{section}.{key}", toml_value(value))
            for section, values in cfg.to_dict().items() for key, value in values.items()]


COUNTING = "counting the source's tokens…"  # the settings' border until count_budget reports
PART_ROW = "#"  # a mixture part's row key: data.sources#0, ...; not a setting of its own
PART_NAME = 28  # a part's name in the settings' key column: no wider than the longest key
FINE_TUNE_PRESET = "chat-cpu"  # what `f` on a run fine-tunes it with, unless a chat preset is chosen


def part_name(source: str) -> str:
    """A part as its settings row names it: a file or folder by its name, a Hub dataset by its
    name and path (its owner left out); cut from the left (the end tells parts apart) to fit
    beside the keys."""
    if source.startswith("hf:"):
        name = source[3:].split("/", 1)[-1]
    else:
        name = Path(source).name or source
    return name if len(name) <= PART_NAME else "…" + name[-(PART_NAME - 1):]


def part_key(i: int) -> str:
    return f"data.sources{PART_ROW}{i}"


def part_label(source: str, style: str) -> Text:
    """A mixture part's row's key cell, under data.sources."""
    return Text(f" └ {part_name(source)}", style=style)


def gpu_summary(gpus: list[GPUReading], usable: int) -> str:
    """"GPU: name (80 GiB)"; with more, how many and of which kinds, and how many CUDA may use
    when CUDA_VISIBLE_DEVICES hides some."""
    kinds = Counter(g.name + (f" ({g.mem_total / 2**30:.0f} GiB)" if g.mem_total is not None else "") for g in gpus)
    if len(gpus) == 1:
        return f"GPU: {next(iter(kinds))}"
    hidden = f" ({usable} visible to CUDA)" if usable < len(gpus) else ""
    return f"{len(gpus)} GPUs{hidden}: " + ", ".join(f"{n}× {kind}" for kind, n in kinds.items())


def hardware_line(telemetry: Telemetry | None, reading: Reading | None, usable: int) -> Text:
    if reading and reading.gpus:
        return Text(f"{gpu_summary(reading.gpus, usable)} · driver {telemetry.driver}", style="bold")
    return Text("no GPU: CPU run", style="bold") + Text(f"   ({telemetry.nvml_error})" if telemetry else "",
                                                       style="dim")


def nproc_cycle(current: int, gpus: int) -> list[int]:
    """The process counts `p` tries after `current`, in order: the next one up to `gpus`, then
    round from 1 (a count the config refuses is skipped)."""
    start = current if current < gpus else 0
    return [n for n in [*range(start + 1, gpus + 1), *range(1, start + 1)] if n != current]


# Below NARROW columns the presets, the settings and the recent runs stack, each full width; at
# ROOMY and wider the presets show every column beside the settings. Between the two, on a terminal
# of SHORT rows or more (120x40), the presets take the whole width above the settings and the runs,
# so that they too show every column. Below SHORT rows (80x24) the stacked tables share the
# height: the focused one grows, the others keep their cursor row in view.
NARROW, ROOMY, SHORT = 110, 160, 30
# What a preset is picked by comes first, so a narrow table cuts only the extras on the right.
PRESET_COLUMNS = [("preset", 0), ("params", 2), ("est. memory", 4), ("fit", 5), ("tokens/step", 3), ("GPU class", 1)]
FIT_WIDTH = max(map(len, VERDICT_STYLE))  # the longest verdict: the column never crops one


class Table(DataTable):
    """A row-cursor DataTable that keeps its cursor row in view when it shrinks (on a short
    terminal the launch screen gives the height to the focused table)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", **kwargs)

    def on_resize(self) -> None:
        # the cursor row when the new size has settled, not now: a key may move it meanwhile
        self.call_after_refresh(lambda: self.row_count and self.move_cursor(row=self.cursor_row))


class LaunchScreen(Screen):
    BINDINGS = [
        ("enter", "launch", "Launch"),
        ("e", "edit", "Edit"),
        ("s", "save_as", "Save as"),
        ("r", "resume", "Resume"),
        ("o", "open_chat", "Chat"),
        Binding("f", "fine_tune", "Fine-tune the run on conversations (a chat preset: chat-cpu unless one is chosen)",
                show=False),
        # Left off the footer, which has no room at 80 columns; `?` lists them, and the runs
        # table says how many are marked.
        Binding("space", "mark", "Mark a run to compare", show=False),
        Binding("c", "compare", "Compare the marked runs", show=False),
        ("p", "processes", "Processes"),
        ("question_mark", "help", "Help"),
        ("q", "app.quit", "Quit"),
    ]

    def __init__(self, runs_root: Path = Path("runs"), telemetry: Telemetry | None = None,
                 session_runs: list[Path] | None = None):
        super().__init__()
        self.runs_root = runs_root
        self.session_runs = session_runs if session_runs is not None else []  # the app's runs, wherever they are
        self.telemetry = telemetry
        self.presets = shipped_presets()
        self.preset_name = "cpu" if "cpu" in self.presets else sorted(self.presets)[0]
        self.overrides: dict[str, str] = {}  # key → TOML value text, as --set takes them
        self.editing: str | None = None
        self.runs: list[Path] = []
        self.marked: list[str] = []  # run folders (the runs table's row keys) marked to compare, in order
        self.live: dict[str, live.LiveRun] = {}  # by run folder: the runs a host serves, or did until it died
        self.gpu_count = 0  # GPUs CUDA may use here: `p` offers 1 to this many processes
        self.card = ""  # this machine's first GPU, by name: what the training time is worked out for
        self.shown: Config | None = None  # the settings on screen, whose budget is being counted or shown
        self.counted = asyncio.Event()  # set once the budget of the settings shown is on screen

    def compose(self) -> ComposeResult:
        yield Static(id="hardware")
        # a grid when wide (presets over runs, settings beside both); stacked in this order when narrow
        with Container(id="launch-main"):
            yield Table(id="presets")
            with Vertical(id="settings-box"):
                yield Table(id="settings")
                yield Input(id="edit", disabled=True)
                yield Static(id="edit-status")
                yield Input(placeholder="save as: path of the new preset TOML", id="saveas")
            yield Table(id="runs")
        yield Footer()

    def on_resize(self, event=None) -> None:
        width, height = self.size
        self.set_class(width < NARROW, "narrow")
        self.set_class(width >= ROOMY, "roomy")
        self.set_class(height < SHORT, "short")
        self.set_class(NARROW <= width < ROOMY and height >= SHORT, "mid")

    def on_mount(self) -> None:
        reading = self.telemetry.read() if self.telemetry else None
        if reading:
            self.gpu_count = cuda_gpu_count(len(reading.gpus), os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.refresh_bindings()
        self.on_resize()
        self.query_one("#hardware", Static).update(hardware_line(self.telemetry, reading, self.gpu_count))
        presets = self.query_one("#presets", DataTable)
        presets.border_title = "presets · Enter launches"
        for label, _ in PRESET_COLUMNS:
            presets.add_column(label, width=FIT_WIDTH if label == "fit" else None)
        card = reading.gpus[0].mem_total if reading and reading.gpus else None
        self.card = reading.gpus[0].name if reading and reading.gpus else ""
        rows = preset_rows(card)
        for row in rows:
            cells = [*row[:-1], Text(row[-1], style=VERDICT_STYLE.get(row[-1], ""))]
            presets.add_row(*(cells[i] for _, i in PRESET_COLUMNS), key=row[0])
        presets.move_cursor(row=[r[0] for r in rows].index(self.preset_name))
        self.setting_column, self.value_column = self.query_one("#settings", DataTable).add_columns("setting", "value")
        self.query_one("#settings", DataTable).border_title = "settings"
        runs = self.query_one("#runs", DataTable)
        runs.border_title = "runs · Enter attaches or resumes · o chats"
        # the status last: the longest (a live run's ETA and viewers), so it is what a narrow table
        # cuts, never the loss
        runs.add_columns("run", "step", "loss", "status")
        self.refresh_runs()
        self.set_interval(2.0, self.refresh_runs)  # live runs move on
        self.show_settings()
        presets.focus()

    # ---------------------------------------------------------------------------- contents
    def current_config(self, extra: dict[str, str] | None = None) -> Config:
        overrides = {**self.overrides, **(extra or {})}
        cfg, _ = load_config(self.preset_name, [f"{k}={v}" for k, v in overrides.items()])
        return cfg

    def show_settings(self) -> None:
        """The settings again, the cursor kept on its key (an edit of data.sources is followed by
        its parts' rows, in view). The token budget follows from a thread (count_budget)."""
        table = self.query_one("#settings", DataTable)
        selected = (table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
                    if table.row_count else None)
        table.clear()
        cfg = self.shown = self.current_config()
        table.border_subtitle = COUNTING
        for key, value in flatten(cfg):
            style = "bold yellow" if key in self.overrides else ""
            table.add_row(Text(key, style=style), Text(value, style=style), key=key)
            if key == "data.sources":
                for i, spec in enumerate(cfg.data.sources):
                    table.add_row(part_label(spec.source, "dim"), Text("counting…", style="dim"), key=part_key(i))
        table.border_title = (f"settings · {self.preset_name}" + (" (edited)" if self.overrides else "")
                              + " · e edits")
        if selected is not None and selected in table.rows:
            row = table.get_row_index(selected)
            if selected == "data.sources" and cfg.data.sources:
                # through the last part's row, so the scroll that follows the cursor shows them all
                table.move_cursor(row=row + len(cfg.data.sources))
                table.call_after_refresh(table.move_cursor, row=row)
            else:
                table.move_cursor(row=row)
        self.counted.clear()
        threading.Thread(target=self.count_budget, args=(cfg,), name="budget", daemon=True).start()

    def count_budget(self, cfg: Config) -> None:
        """In a thread: a source is listed (a folder of 100k files takes seconds) and its text
        estimated before the budget is known, and the screen must answer keys meanwhile. A daemon
        thread, not a Textual worker: Python joins a worker's executor at exit, and quitting in
        the middle of a count waited for the whole of it."""
        try:
            parts: list[data_budget.Part] | Exception = data_budget.parts(cfg)
        except Exception as e:  # noqa: BLE001 - a defect, not the source's (those are each part's `problem`): said
            parts = e
        try:
            self.app.call_from_thread(self.show_budget, cfg, parts)
        except RuntimeError:
            pass  # the app has ended meanwhile

    def show_budget(self, cfg: Config, parts: list[data_budget.Part] | Exception) -> None:
        """The budget of the settings shown, on the border (in yellow past MANY_EPOCHS) and in a
        mixture's part rows: their share, train tokens and epochs. Dropped if the settings have
        changed since it was counted: their own count follows. A count that failed says so there
        and in a notification, and the screen goes on: the figure is an aid, not the run."""
        if cfg is not self.shown:
            return
        table = self.query_one("#settings", DataTable)
        if isinstance(parts, Exception):
            table.border_subtitle = "[red]the token count failed[/]"
            self.notify(f"counting the source's tokens failed: {type(parts).__name__}: {parts}", severity="error")
            self.counted.set()
            return
        short = data_budget.whole(cfg, parts).short(parts)
        if took := training_time(cfg, self.card or cfg.hardware.gpu_class):  # on this GPU, or the one it was sized for
            short = f"{took.short()} on {took.card_name} · {short}"  # first: a narrow border cuts the end
        table.border_subtitle = f"[yellow]{short}[/]" if any(p.budget.warning() for p in parts) else short
        for i, part in enumerate(parts if cfg.data.sources else []):
            style = "yellow" if part.budget.warning() else "dim"
            table.update_cell(part_key(i), self.setting_column, part_label(part.source, style))
            table.update_cell(part_key(i), self.value_column, Text(part.short(), style=style))
        self.counted.set()

    def refresh_runs(self) -> None:
        """Read the runs again (live ones first, then the runs folder's), keeping the cursor on the
        run it was on."""
        table = self.query_one("#runs", DataTable)
        selected = (table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
                    if table.row_count else None)
        table.clear()
        self.live = {str(r.run_dir): r for r in live.live_runs()}
        found = recent_runs(self.runs_root)
        seen = {p.resolve() for p in found}
        found += [p for p in self.session_runs if p.resolve() not in seen and (p / CONFIG).is_file()]
        others = sorted((p for p in found if str(p.resolve()) not in self.live), key=lambda p: p.stat().st_mtime,
                        reverse=True)
        self.runs = [r.run_dir for r in self.live.values()] + others
        for run in self.live.values():
            name, *cells = live_row(run)
            table.add_row(self.marked_name(str(run.run_dir), name), *cells, key=str(run.run_dir))
        for run in others:
            name, *cells = past_row(run_summary(run))
            table.add_row(self.marked_name(str(run), name), *cells, key=str(run))
        listed = set(map(str, self.runs))
        self.marked = [m for m in self.marked if m in listed]  # a run folder deleted meanwhile
        self.show_marked()
        if selected in listed:
            table.move_cursor(row=table.get_row_index(selected))

    def marked_name(self, key: str, name: str | Text) -> str | Text:
        """The run cell: a marked run's name after a ●."""
        return Text.assemble(("● ", "bold magenta"), name) if key in self.marked else name

    def show_marked(self) -> None:
        self.query_one("#runs", DataTable).border_subtitle = (
            f"{len(self.marked)} marked · c compares" if self.marked else "")

    def on_screen_resume(self) -> None:
        """Back from a run's dashboard or a chat: the runs folder may have changed (a new run, a
        resumed one gone further)."""
        if self.is_mounted and self.query_one("#runs", DataTable).columns:
            self.refresh_runs()

    # ------------------------------------------------------------------------------ events
    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id != "presets":
            return
        # The preset under the cursor now, not the event's: the table's first rows highlight row 0
        # before on_mount moves the cursor to the default, and those events arrive after it. Taken
        # at their word they switched the settings to the first preset and back, counting the
        # source's tokens three times over at start-up.
        table = event.data_table
        current = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        if current != self.preset_name:
            self.preset_name = current
            self.overrides = {}
            self.show_settings()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.data_table.id == "presets":
            self.action_launch()
        elif event.data_table.id == "settings":
            self.action_edit()
        elif event.data_table.id == "runs":
            self.action_resume()

    def action_edit(self) -> None:
        table = self.query_one("#settings", DataTable)
        if table.row_count == 0:
            return
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value.split(PART_ROW)[0]
        self.editing = key
        value = dict(flatten(self.current_config()))[key]
        edit = self.query_one("#edit", Input)
        edit.disabled = False
        self.add_class("editing")
        edit.border_title = key
        edit.value = value
        edit.focus()
        self.query_one("#edit-status", Static).update(Text(f"editing {key}: Enter applies, Esc cancels", style="dim"))

    def validate_edit(self, text: str) -> str | None:
        """None when `editing = text` makes a valid config; else the message saying why not."""
        return self.problem_with(self.editing, text)

    def problem_with(self, key: str, text: str) -> str | None:
        try:
            self.current_config({key: text})
        except ConfigError as e:
            return e.detail  # beside the key being edited: what is wrong, without the file or --set it blames
        return None

    def set_override(self, key: str, text: str) -> str | None:
        """Record `key = text` for save-as and launch when the config stays valid; else say why not."""
        problem = self.problem_with(key, text)
        if problem is None:
            self.overrides[key] = text
            self.show_settings()
        return problem

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id != "edit" or self.editing is None:
            return
        problem = self.validate_edit(event.value)
        status = self.query_one("#edit-status", Static)
        status.update(Text(f"✗ {problem}", style="bold red") if problem else Text("✓ valid", style="green"))
        event.input.set_class(problem is not None, "invalid")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "edit" and self.editing is not None:
            if problem := self.set_override(self.editing, event.value):
                self.notify(problem, severity="error")
                return
            self.finish_edit()
        elif event.input.id == "saveas":
            self.save_as(event.value.strip())

    def finish_edit(self) -> None:
        self.editing = None
        edit = self.query_one("#edit", Input)
        edit.value, edit.disabled = "", True
        self.remove_class("editing")
        self.query_one("#edit-status", Static).update("")
        self.query_one("#settings", DataTable).focus()

    def key_escape(self) -> None:
        if self.editing is not None:
            self.finish_edit()
        self.remove_class("saving")

    # ----------------------------------------------------------------------------- actions
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # one GPU or none: a single process is all there is, so `p` is neither shown nor run
        return self.gpu_count >= 2 if action == "processes" else True

    def action_processes(self) -> None:
        """The next distributed.nproc, 1 to the number of GPUs, set as if typed in with `e`."""
        key = "distributed.nproc"
        problems = []
        for n in nproc_cycle(self.current_config().distributed.nproc, self.gpu_count):
            if problem := self.set_override(key, str(n)):
                problems.append(problem)
                continue
            table = self.query_one("#settings", DataTable)
            table.move_cursor(row=table.get_row_index(key))
            self.notify(f"{key} = {n}: " + ("one process" if n == 1 else f"{n} processes, one per GPU"))
            return
        if problems:
            self.notify(problems[0], severity="error")

    def action_save_as(self) -> None:
        self.add_class("saving")
        box = self.query_one("#saveas", Input)
        box.value = f"presets/{self.preset_name}-custom.toml"
        box.focus()

    def save_as(self, target: str) -> None:
        path = Path(target).expanduser()
        if path.suffix != ".toml":
            self.notify(f"{target}: a preset file must end in .toml", severity="error")
            return
        if path.exists():
            self.notify(f"{path} already exists: choose another name", severity="error")
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_config(self.current_config(), path)
        except OSError as e:
            self.notify(f"cannot write {path}: {e.strerror}", severity="error")
            return
        self.remove_class("saving")
        self.notify(f"saved {path}: `lmcockpit --run {path}` runs it")
        self.query_one("#presets", DataTable).focus()

    def action_launch(self) -> None:
        try:
            cfg = self.current_config()
        except ConfigError as e:
            self.notify(str(e), severity="error")
            return
        self.app.new_run(cfg, self.preset_name)

    def selected_run(self) -> str | None:
        table = self.query_one("#runs", DataTable)
        if table.row_count == 0:
            self.notify("no runs under " + str(self.runs_root), severity="warning")
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    def action_resume(self) -> None:
        if not (run := self.selected_run()):
            return
        if run in self.live and self.live[run].live:
            self.app.attach(Path(run))
        else:
            self.app.resume(run)

    def action_open_chat(self) -> None:
        if run := self.selected_run():
            from .checkpoint_chat import ChatScreen

            self.app.push_screen(ChatScreen(run))

    def action_fine_tune(self) -> None:
        if run := self.selected_run():
            fine_tune(self, run)

    def action_mark(self) -> None:
        """Space on a run: marked to compare, or unmarked; the ● stays through the table's refreshes."""
        table = self.query_one("#runs", DataTable)
        if not table.has_focus:
            return
        if not (run := self.selected_run()):
            return
        if run in self.marked:
            self.marked.remove(run)
        else:
            self.marked.append(run)
        self.refresh_runs()

    def action_compare(self) -> None:
        if len(self.marked) < 2:
            self.notify("mark two runs or more to compare: space on each in the runs table, then c",
                        severity="warning")
            return
        self.notify(f"reading {len(self.marked)} runs' metrics…", timeout=2)
        self.read_runs([Path(m) for m in self.marked])

    @work(thread=True, exclusive=True, group="compare")
    def read_runs(self, paths: list[Path]) -> None:
        """In a thread: a long run's metrics.jsonl takes a second or more to read."""
        from ...core.run.curves import load_runs
        from .side_by_side import CompareScreen

        try:
            runs = load_runs(paths)
        except ConfigError as e:
            self.app.call_from_thread(self.notify, str(e), severity="error")
            return
        self.app.call_from_thread(self.app.push_screen, CompareScreen(runs))

    def action_help(self) -> None:
        from .dialogs import HelpScreen

        self.app.push_screen(HelpScreen(self.BINDINGS))


def fine_tune(screen: LaunchScreen, run: str) -> None:
    """A fine-tuning run from `run`'s latest checkpoint: with the preset chosen, and its edits, when
    it is a chat preset; else with FINE_TUNE_PRESET as shipped (a pretraining preset cannot fine-tune)."""
    try:
        cfg, name = screen.current_config(), screen.preset_name
        if cfg.data.format != "chat":
            cfg, name = load_config(FINE_TUNE_PRESET)[0], FINE_TUNE_PRESET
    except ConfigError as e:
        screen.notify(str(e), severity="error")
        return
    screen.notify(f"fine-tuning {Path(run).name} with {name}…", timeout=3)
    screen.app.new_run(cfg, name, base=run)


def past_row(s: dict) -> tuple[Text | str, ...]:
    """A run no host serves, as run_summary sees it: name, step, loss, status; one whose
    metrics.jsonl holds rows that are not lmcockpit's, in red, unreadable, with no figures to mislead."""
    name = s["name"]
    if s["status"] == UNREADABLE:
        return Text(name, style="red"), DASH, DASH, Text(f"{UNREADABLE} metrics.jsonl", style="red")
    step = f"{s['step']}/{s['max_steps']}" if s["max_steps"] else str(s["step"])
    loss = f"{s['loss']:.3f}" if s["loss"] is not None else DASH
    return name, step, loss, s["status"]


def live_row(run: live.LiveRun) -> tuple[Text | str, ...]:
    """A run a host serves: name, step, loss, and its state, time left and viewers; one whose
    host died, in red, dead."""
    r = run.record
    step = f"{r.step}/{r.max_steps}" if r.max_steps else str(r.step)
    loss = f"{r.loss:.3f}" if r.loss is not None else DASH
    if not run.live:
        return Text(run.run_dir.name, style="red"), step, loss, Text("dead · Enter resumes", style="red")
    eta = f" · ETA {fmt_duration(r.eta_s)}" if r.eta_s is not None else ""
    status = f"{r.state}{eta} · {r.viewers} watching"
    return Text(run.run_dir.name, style="bold"), step, loss, Text(status, style="green")

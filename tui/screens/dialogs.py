"""Modal dialogs: abort, quit with a run in progress, the key help, and the pick of a baseline run.

Abort (save or not) and quit with a run in progress (stop it or leave it) are each a question
answered by one key (`ChoiceDialog`); then the key help, and the pick of a baseline run. In each,
Ctrl-C quits as it does everywhere in the cockpit (CockpitApp.action_quit_cockpit): a modal screen
keeps the app's own bindings from its keys, so each names it."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from ...core.run.folder import recent_runs, run_summary

QUIT = Binding("ctrl+c", "app.quit_cockpit", "Quit", show=False)


class ChoiceDialog(ModalScreen[str | None]):
    """A question answered by one key: each of the subclass's BINDINGS chooses (Esc: None, nothing
    changes), and TEXT asks it, a line per key."""

    TEXT = ""
    BINDINGS = [QUIT]

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.TEXT)

    def action_choose(self, choice: str | None) -> None:
        self.dismiss(choice)


class AbortDialog(ChoiceDialog):
    """Enter: checkpoint then stop. d: stop without saving. Esc: keep training."""

    BINDINGS = [("enter", "choose('save')", "Save and stop"), ("d", "choose('nosave')", "Stop, don't save"),
                ("escape", "choose(None)", "Cancel")]
    TEXT = ("[b]Abort the run?[/b]\n\n"
            "[b]Enter[/b]  write a checkpoint, then stop\n"
            "[b]d[/b]      stop without saving\n"
            "[b]Esc[/b]    keep training")


class QuitDialog(ChoiceDialog):
    """Enter: stop the run with a checkpoint, then quit. d: quit and leave it training (attach again
    with `lmcockpit attach`). Esc: stay."""

    BINDINGS = [("enter", "choose('stop')", "Stop and quit"), ("d", "choose('detach')", "Leave it training"),
                ("escape", "choose(None)", "Cancel")]
    TEXT = ("[b]A run is in progress.[/b]\n\n"
            "[b]Enter[/b]  stop it (writing a checkpoint) and quit\n"
            "[b]d[/b]      leave it training and quit (lmcockpit attach comes back)\n"
            "[b]Esc[/b]    stay")


class HelpScreen(ModalScreen[None]):
    BINDINGS = [("escape", "dismiss", "Close"), ("question_mark", "dismiss", "Close"), ("q", "dismiss", "Close"), QUIT]

    def __init__(self, bindings: list[tuple[str, str, str] | Binding]):
        super().__init__()
        self.keys = bindings

    def compose(self) -> ComposeResult:
        names = {"question_mark": "?", "escape": "Esc"}
        keys = [(b.key, b.description) if isinstance(b, Binding) else (b[0], b[2]) for b in self.keys]
        lines = "\n".join(f"[b]{names.get(k, k):>3}[/b]  {desc}" for k, desc in keys)
        with Vertical(classes="dialog"):
            yield Static(f"[b]Keys[/b]\n\n{lines}\n\n[dim]Esc closes this help[/dim]")


class BaselinePicker(ModalScreen[str | None]):
    """A past run to draw under the live curves: Enter picks the highlighted one ("" removes the
    baseline shown), Esc leaves things as they are."""

    BINDINGS = [("escape", "cancel", "Cancel"), QUIT]

    def __init__(self, runs: list[tuple[str, str]], showing: str = ""):
        """`runs`: (folder, what to show for it); `showing`: the folder drawn now, if any."""
        super().__init__()
        self.runs = runs
        self.showing = showing

    def compose(self) -> ComposeResult:
        options = [Option(label, id=path) for path, label in self.runs]
        if self.showing:
            options.insert(0, Option("no baseline", id=""))
        with Vertical(classes="dialog picker"):
            yield Static("[b]Baseline[/b]: a finished run drawn under the live curves\n"
                         "[dim]Enter picks · Esc cancels[/dim]")
            yield OptionList(*options, id="baselines")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)


def past_runs(own: str | None, runs_root: Path, run_dirs: list[Path]) -> list[tuple[str, str]]:
    """(folder, what to show for it) of every run with steps (finished, stopped, failed) under
    `runs_root` or named on the command line, `own` (the run on the screen) left out."""
    own_path = Path(own).resolve() if own else None
    found = recent_runs(runs_root)
    found += [p for p in run_dirs if p not in found]
    runs = []
    for path in found:
        if path.resolve() == own_path:
            continue
        s = run_summary(path)
        if s["step"]:
            loss = f"loss {s['loss']:.3f}" if s["loss"] is not None else ""
            runs.append((str(path), f"{s['name']}  {s['status']} · step {s['step']} · {loss}"))
    return runs


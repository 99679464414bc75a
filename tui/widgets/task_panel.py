"""The dashboard's tasks panel: each downstream task's latest scores and its accuracy over steps.

A task's row gives its latest accuracy and centred score (CORE's (accuracy − chance) /
(1 − chance), 0 at chance: the events do not carry the chance level itself). Under it, while the
tasks are few, its accuracy at each scoring is drawn as a braille line across the steps so far,
two rows high, with the range's top and bottom at its right, and each reference model's score for
that task (the run's `eval.references`, which a preset may name) as a dotted line. Many tasks get
a row each with a sparkline.

Collapsed, the panel is one line: CORE where the run has it, then each task's latest scores. A
run whose config names no task and that has no scores has no panel; one that names tasks and has
no score yet says in one row at which step the first come."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from ...core.config import Config
from ..formatting import DASH
from ...core.run.state import RunState
from .panels import Panel, spark

# Reference models' accuracy by task, drawn on that task's plot. GPT-2 124M's HellaSwag is llm.c's
# scoring (0.2955). No config key names them yet: see references_of.

PLOT_ROWS = 2  # a task's plot: 8 braille dots high
MAX_PLOTTED = 2  # more tasks than this: a row each, a sparkline instead of a plot
MIN_NAME = 8  # the fewest columns a task's name is cut to in the collapsed line
MIN_SPAN = 0.02  # the smallest accuracy range a plot spans, so one scoring or a flat line sits mid-plot
BRAILLE = 0x2800
DOTS = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))  # a cell's dot bits by [row][column]
LINE, REFERENCE = "cyan", "magenta"


def references_of(config: Config | None) -> dict[str, dict[str, float]]:
    """{task: {model label: accuracy}} to draw: the run's `eval.references` (a preset's: the
    gpt2-fineweb preset names GPT-2 124M's HellaSwag)."""
    return config.eval.references if config else {}


def scores_text(name: str, scores: dict[str, float], width: int, tail: str = "") -> Text:
    """`name accuracy (+centred)` in `width` columns: the name gives way first."""
    acc = scores.get("accuracy")
    centred = scores.get("centered")
    figures = f" {acc:.3f}" if acc is not None else f" {DASH}"
    figures += f" ({centred:+.2f})" if centred is not None else ""
    text = Text(name, style="bold")
    text.truncate(max(MIN_NAME, width - len(figures) - len(tail)), overflow="ellipsis")
    text.append(figures)
    if tail:
        text.append(tail, style=LINE)
    return text


def plot_range(values: list[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if hi - lo < MIN_SPAN:
        mid = (lo + hi) / 2
        lo, hi = mid - MIN_SPAN / 2, mid + MIN_SPAN / 2
    return lo, hi


def braille_plot(points: list[tuple[int, float]], last_step: int, width: int, lo: float, hi: float,
                 refs: list[float] = (), rows: int = PLOT_ROWS) -> list[Text]:
    """`rows` lines of `width` braille cells: the (step, accuracy) points joined by a line, steps
    0 to `last_step` across, accuracies `lo` to `hi` up; each of `refs` a dotted line across."""
    cols, height = 2 * width, 4 * rows

    def x_of(step: int) -> int:
        return round(step / last_step * (cols - 1)) if last_step > 0 else cols - 1

    def y_of(value: float) -> int:  # 0 is the bottom row of dots
        return min(height - 1, max(0, round((value - lo) / (hi - lo) * (height - 1))))

    xy = [(x_of(s), y_of(a)) for s, a in points]
    line = set(xy[:1])
    for (x0, y0), (x1, y1) in zip(xy, xy[1:]):
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        line.update((round(x0 + (x1 - x0) * i / n), round(y0 + (y1 - y0) * i / n)) for i in range(n + 1))
    dotted = {(x, y_of(r)) for r in refs for x in range(0, cols, 2)}
    out = []
    for row in range(rows):
        text = Text()
        for cell in range(width):
            mine = theirs = 0
            for dy in range(4):
                y = height - 1 - (4 * row + dy)
                for dx in range(2):
                    if (2 * cell + dx, y) in line:
                        mine |= DOTS[dy][dx]
                    elif (2 * cell + dx, y) in dotted:
                        theirs |= DOTS[dy][dx]
            if mine or theirs:
                text.append(chr(BRAILLE + (mine | theirs)), style=LINE if mine else REFERENCE)
            else:
                text.append(" ")
        out.append(text)
    return out


def task_plot(history: list[tuple[int, float]], last_step: int, width: int,
              refs: dict[str, float]) -> list[Text]:
    """The task's plot with its range at the right, then a legend line per reference model."""
    lo, hi = plot_range([a for _, a in history] + list(refs.values()))
    labels = [f"{hi:.2f}", f"{lo:.2f}"]
    room = max(4, width - max(map(len, labels)) - 1)
    lines = braille_plot(history, last_step, room, lo, hi, list(refs.values()))
    for n, line in enumerate(lines):
        label = labels[0] if n == 0 else labels[1] if n == len(lines) - 1 else ""
        line.append(" " + label, style="dim")
    for model, acc in refs.items():
        legend = Text("┄ ", style=REFERENCE)
        legend.append(f"{model} {acc:.4g}", style="dim")
        legend.truncate(width, overflow="ellipsis")
        lines.append(legend)
    return lines


def task_lines(v: RunState, width: int, references: dict[str, dict[str, float]]) -> list[Text]:
    """The panel's rows, a line each: CORE where the run has it; per task its scores, and its plot
    while the tasks are few (a sparkline on its row when many). None: no panel."""
    if not v.last_tasks:
        e = v.config.eval if v.config else None
        if e is None or not e.tasks:
            return []
        every = e.tasks_every or e.every
        first = -(-max(v.step, 1) // every) * every if every else 0  # the next step the cadence scores at
        return [Text(f"first at step {first}" if first else "none scored yet", style="dim")]
    lines = [scores_text("CORE", {"accuracy": v.last_core}, width)] if v.last_core is not None else []
    plotted = len(v.last_tasks) <= MAX_PLOTTED
    for name, scores in v.last_tasks.items():
        history = v.tasks.get(name, [])
        if plotted:
            lines.append(scores_text(name, scores, width))
            if history:
                last_step = max(v.step, history[-1][0])
                lines += task_plot(history, last_step, width, references.get(name, {}))
        else:
            lo, hi = plot_range([a for _, a in history] or [0.0])
            trend = " " + spark([100 * (a - lo) / (hi - lo) for _, a in history], 6) if len(history) > 1 else ""
            lines.append(scores_text(name, scores, width, trend))
    return lines


def fitted(name: str, scores: dict[str, float], room: int) -> str | None:
    """`name accuracy (+centred)` in `room` columns, the name cut (to MIN_NAME at least), else
    without the centred score; None where neither fits."""
    for shown in (scores, {"accuracy": scores.get("accuracy")}):
        if min(len(name), MIN_NAME) + len(scores_text("", shown, 0)) <= room:
            return scores_text(name, shown, room).plain
    return None


def task_summary(v: RunState, width: int) -> str:
    """The collapsed panel's figures in `width` columns: CORE, then each task's latest accuracy and
    centred score (`fitted`); the tasks that do not fit are an ellipsis."""
    parts = [f"CORE {v.last_core:.3f}"] if v.last_core is not None else []
    tasks = list(v.last_tasks.items())
    for n, (name, scores) in enumerate(tasks):
        room = width - (len(" · ".join([*parts, ""])) if parts else 0) - (len(" · …") if n < len(tasks) - 1 else 0)
        part = fitted(name, scores, room)
        if part is None:
            parts.append("…" if parts else scores_text(name, scores, room).plain)
            break
        parts.append(part)
    return " · ".join(parts)


class TaskPanel(Panel):
    """The tasks panel: hidden while the run has no tasks, a row per task and its plot otherwise."""

    def __init__(self, **kwargs):
        super().__init__("tasks", **kwargs)
        self.view: RunState | None = None
        self.inside = 0  # inside the panel when open
        self.rows: list[Text] = []

    def show_tasks(self, v: RunState, width: int, references: dict[str, dict[str, float]]) -> None:
        """Redraw from the run; `width`: its inside width when open."""
        rows = task_lines(v, max(12, width), references)
        if rows == self.rows and max(12, width) == self.inside:
            return  # the same lines: a redraw once a second would render them again for nothing
        self.view, self.inside, self.rows = v, max(12, width), rows
        self.display = bool(self.rows)
        table = Table.grid()
        table.add_column(no_wrap=True)
        for row in self.rows:
            table.add_row(row)
        self.show(table)

    def summary(self) -> Text:
        text = Text("▸ ", style="dim")
        text.append(self.border_title or "", style="bold")
        room = self.inside + 2 - text.cell_len - 2  # collapsed: no border, the same padding
        figures = task_summary(self.view, room) if self.view and self.view.last_tasks else ""
        text.append("  " + (figures or (self.rows[0].plain if self.rows else "")))
        text.no_wrap, text.overflow = True, "ellipsis"
        return text

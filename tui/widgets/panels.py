"""The dashboard's number panels: run state, throughput, memory, GPU and host.

Each renders from the RunState (engine figures) and the latest telemetry Reading (NVML/psutil,
sampled at 1 Hz). A panel's labels are never cut: its values wrap under their label instead, to
the width the panel has (the target forecast, a reason there is no reading); a path is cut from
the left, its end kept.

A run's GPUs are the devices RunStarted names, mapped from CUDA's numbering to NVML's: a panel
each while they are few, one panel with a row per GPU when they are many."""

from __future__ import annotations

import textwrap

from rich.table import Table
from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

from ...core import protocol as P
from ...core.hardware.telemetry import GPUReading, ProcessLoad, Reading, find_gpu
from ..formatting import DASH, fmt_count, fmt_duration
from ...core.run import lineage
from ...core.run.state import RunState

STATE_STYLE = {P.RUNNING: "bold green", P.PAUSED: "bold yellow", P.FAILED: "bold red", P.FINISHED: "bold cyan",
               P.ABORTED: "bold magenta", P.INTERRUPTED: "bold magenta", P.COMPILING: "bold blue",
               P.PREPARING: "bold blue", P.EVALUATING: "bold blue", P.CHECKPOINTING: "bold blue",
               P.STALLED: "bold red"}
SPARK = "▁▂▃▄▅▆▇█"


def gib(n: float) -> str:
    return f"{n / 2**30:.1f}G"


def spark(values: list[float], width: int = 16, top: float = 100.0) -> str:
    vals = values[-width:]
    return "".join(SPARK[min(7, int(max(0.0, v) / top * 7.999))] for v in vals)


def kv_table(rows: list[tuple[str, str]]) -> Table:
    """A label column as wide as its longest label, so no label is ever cut, and the values beside
    it; rows whose labels are all empty are one column of values."""
    t = Table.grid(padding=(0, 1))
    if any(k for k, _ in rows):
        t.add_column(style="dim", no_wrap=True, min_width=max(len(k) for k, _ in rows))
    t.add_column(no_wrap=True)
    for k, v in rows:
        t.add_row(*([k] if len(t.columns) == 2 else []), v)
    return t


def wrapped(rows: list[tuple[str, str]], width: int) -> list[tuple[str, str]]:
    """`rows` with each value longer than the room beside the labels (in `width` columns) wrapped
    onto rows of its own, their labels blank (`wrap`): a row is still a line, and no label and no
    figure is cut."""
    labels = max((len(k) for k, _ in rows), default=0)
    room = max(8, width - labels - (1 if labels else 0))
    out = []
    for k, v in rows:
        lines = wrap(v, room)
        out += [(k, lines[0])] + [("", line) for line in lines[1:]]
    return out


def wrap(value: str, room: int) -> list[str]:
    """`value` in lines of `room` columns at most, wrapped at spaces. A path (no spaces, a slash)
    keeps its end, the run's own folder, which tells it apart: its start is cut at a slash, or,
    where the folder's name alone is too long, that name is what is shown, wrapped."""
    if len(value) <= room:
        return [value]
    if " " in value or "/" not in value:
        return textwrap.wrap(value, room) or [""]
    parts = value.rstrip("/").split("/")
    for n in range(len(parts) - 1, 0, -1):
        if len(tail := "…/" + "/".join(parts[n:])) <= room:
            return [tail]
    return textwrap.wrap(parts[-1], room)


def state_text(v: RunState) -> Text:
    text = Text(v.state.upper(), style=STATE_STYLE.get(v.state, "bold"))
    if v.progress and v.state == P.PREPARING and v.progress.total:
        text.append(f"  {v.progress.phase} {100 * v.progress.done / v.progress.total:.0f}%", style="dim")
    elif v.state_detail and v.state != P.FAILED:
        text.append(f"  {v.state_detail}", style="dim")
    return text


def state_rows(v: RunState, world: int) -> list[tuple[str, str]]:
    """What the run is: its device and precision (and processes, `world`), size and folder, and a
    fine-tuning run's base ("fine-tuned from cpu-1 at step 300", read as one phrase across the row)."""
    procs = f" · {world} procs" if world > 1 else ""
    rows = [
        ("device", f"{v.device} {v.precision}{procs}".strip() or DASH),
        ("params", f"{v.n_params / 1e6:.2f}M" if v.n_params else DASH),
        ("tok/step", f"{v.tokens_per_step:,}" if v.tokens_per_step else DASH),
        ("folder", v.run_dir or DASH),
    ]
    if base := lineage.of_config(v.config):
        rows.append(("fine-tuned", base.removeprefix("fine-tuned ")))
    return rows


def throughput_rows(v: RunState, target: bool = True, mfu: bool = True) -> list[tuple[str, str]]:
    """The run's figures; with `target`, when it should reach its target (the dashboard gives that
    a panel of its own: `target_text`); without `mfu`, no MFU (the dashboard's time panel holds it,
    with what stands between it and the peak, once steps have parts)."""
    rows = [
        ("tokens/s", fmt_count(v.tokens_per_s) if v.tokens_per_s else DASH),
        ("steps/s", f"{v.steps_per_s:.2f}" if v.steps_per_s else DASH),
        ("MFU", f"{100 * v.mfu:.1f}%" if v.mfu is not None else DASH),
        ("ETA", fmt_duration(v.eta) if v.eta is not None else DASH),
        ("elapsed", fmt_duration(v.elapsed)),
        ("tokens", fmt_count(v.tokens_seen) if v.tokens_seen else DASH),  # seen so far
        ("loss", f"{v.loss:.4f}" if v.loss is not None else DASH),
        ("val loss", f"{v.last_eval.val_loss:.4f} @ {v.last_eval.step}" if v.last_eval else DASH),
        ("lr", f"{v.lr:.2e}" if v.lr is not None else DASH),
    ]
    if not mfu:
        rows = [row for row in rows if row[0] != "MFU"]
    if target and (ahead := target_text(v)) is not None:
        rows.append(("target", ahead))
    return rows


def target_text(v: RunState) -> str | None:
    """When the run should reach training.target_val_loss (or its target_task's accuracy), where
    and at what cost; None for a run with no target."""
    return ahead.short(v.cost_per_hour) if (ahead := v.forecast) is not None else None


def memory_rows(v: RunState, gpu: GPUReading | None) -> list[tuple[str, str]]:
    """Allocator figures from the engine; "GPU used" from NVML for `gpu`, the run's first device."""
    mem = v.mem or {}
    return [
        ("allocated", gib(mem["allocated"]) if "allocated" in mem else DASH),
        ("reserved", gib(mem["reserved"]) if "reserved" in mem else DASH),
        ("peak", gib(mem["peak"]) if "peak" in mem else DASH),
        ("GPU used", gpu_memory(gpu, " / ") if gpu else DASH),
    ]


def cpu_memory_rows(load: ProcessLoad | None, reading: Reading | None) -> list[tuple[str, str]]:
    """A CPU run's memory panel: what its processes hold of the RAM (the allocator figures are
    CUDA's: a CPU run has none), and that it has no GPU, said once (it has no GPU panel)."""
    total = f" of {gib(reading.ram_total)}" if reading and reading.ram_total else ""
    return [("RSS", gib(load.rss) + total if load else DASH), ("GPU", "none (CPU run)")]


# ------------------------------------------------------------------------------------- GPUs
MAX_GPU_PANELS = 2  # more GPUs than this share one panel, a row each, so the side column still fits


def pct(value: float | None, width: int = 0) -> str:
    return f"{value:{width}.0f}%" if value is not None else DASH


def gpu_memory(g: GPUReading, sep: str = "/") -> str:
    used = gib(g.mem_used) if g.mem_used is not None else DASH
    return used + sep + (gib(g.mem_total) if g.mem_total is not None else DASH)


def gpu_layout(indices: list[int], narrow: bool) -> list[str]:
    """The GPU panels to show, by key: none for a CPU run (its memory panel says it has no GPU),
    one per GPU index while they are few (one only, on a narrow terminal), else "table": one
    panel with a row per GPU."""
    if not indices:
        return []
    if len(indices) > (1 if narrow else MAX_GPU_PANELS):
        return ["table"]
    return [str(i) for i in indices]


def gpu_panel(key: str, indices: list[int], reading: Reading | None, histories: dict[int, list[float]],
              no_gpu_reason: str, narrow: bool) -> tuple[str, Table | list[tuple[str, str]]]:
    """Title and contents of GPU panel `key` (one of gpu_layout's, or "unlisted": a GPU run none of
    whose GPUs NVML lists by their UUIDs, or no NVML): a table, or rows for Panel.show_rows. The
    title says "GPU": a row never says it again."""
    if key == "unlisted":
        return "GPU", [("", "no reading of the run's GPU"), ("", no_gpu_reason or "NVML does not list it")]
    if key == "table":
        return gpu_table_title(indices, reading), gpu_table(indices, reading, histories, narrow)
    index = int(key)
    g = find_gpu(reading, index)
    if g is None:  # no NVML, or NVML does not list the GPU the run named
        return f"GPU {index}", [("", "no reading"), ("", no_gpu_reason or "")]
    history = histories.get(index, [])
    if len(indices) == 1 and not narrow:
        return f"GPU {index}", gpu_rows(g, history)
    return f"GPU {index} · {g.name}", gpu_compact_rows(g, history, narrow)


def gpu_rows(g: GPUReading, util_history: list[float]) -> list[tuple[str, str]]:
    return [
        ("name", g.name),
        ("util", f"{pct(g.util)}  {spark(util_history)}"),
        ("mem util", pct(g.mem_util)),
        ("power", f"{g.power:.0f} W" if g.power is not None else DASH),
        ("temp", f"{g.temperature:.0f} °C" if g.temperature is not None else DASH),
        ("SM clock", f"{g.sm_clock} MHz" if g.sm_clock is not None else DASH),
    ]


def gpu_compact_rows(g: GPUReading, util_history: list[float], narrow: bool) -> list[tuple[str, str]]:
    """Two rows (the name goes in the title): util with its history; memory, temperature and,
    where there is room, power."""
    extras = [f"{g.temperature:.0f}°C" if g.temperature is not None else "",
              f"{g.power:.0f} W" if g.power is not None and not narrow else ""]
    return [("util", f"{pct(g.util, 3)} {spark(util_history, 8 if narrow else 14)}"),
            ("mem", "  ".join([gpu_memory(g), *filter(None, extras)]))]


def gpu_table_title(indices: list[int], reading: Reading | None) -> str:
    names = {g.name for i in indices if (g := find_gpu(reading, i))}
    return f"{len(indices)} GPUs" + (f" · {names.pop()}" if len(names) == 1 else "")


def gpu_table(indices: list[int], reading: Reading | None, histories: dict[int, list[float]],
              narrow: bool) -> Table:
    """A row per GPU: index, util, its history, memory, temperature. Narrow: two GPUs a row with
    index, util and memory only, so eight GPUs take four rows."""
    cells = [gpu_cells(i, find_gpu(reading, i), histories.get(i, []), narrow) for i in indices]
    per_row = 2 if narrow else 1
    t = Table.grid(padding=(0, 1))
    for group in range(per_row):
        if group:
            t.add_column(style="dim")  # the rule between two GPUs of a row
        t.add_column(style="dim", no_wrap=True)  # the index
        for _ in cells[0][1:]:
            t.add_column(no_wrap=True)
    for start in range(0, len(cells), per_row):
        row = cells[start:start + per_row]
        row += [[""] * len(cells[0])] * (per_row - len(row))
        t.add_row(*[c for n, cell in enumerate(row) for c in ([] if n == 0 else ["│"]) + cell])
    return t


def gpu_cells(index: int, g: GPUReading | None, history: list[float], narrow: bool) -> list[str]:
    if g is None:
        return [str(index), DASH, ""] if narrow else [str(index), DASH, "", "", ""]
    used = f"{g.mem_used / 2**30:.0f}" if g.mem_used is not None else DASH
    total = f"{g.mem_total / 2**30:.0f}" if g.mem_total is not None else DASH
    if narrow:
        return [str(index), pct(g.util, 3), f"{used}G"]
    return [str(index), pct(g.util, 3), spark(history, 10), f"{used}/{total}G",
            f"{g.temperature:.0f}°C" if g.temperature is not None else ""]


def host_rows(reading: Reading | None) -> list[tuple[str, str]]:
    if reading is None:
        return [("CPU", DASH), ("RAM", DASH)]
    return [("CPU", f"{reading.cpu_percent:.0f}%"), ("RAM", f"{gib(reading.ram_used)} / {gib(reading.ram_total)}")]


class Panel(Static):
    """A titled box of key/value rows; collapsed, one line: its title and its first rows' figures."""

    def __init__(self, title: str, **kwargs):
        super().__init__(**kwargs)
        self.border_title = title
        self.body: Table = kv_table([])
        self.collapsed = False
        self.rows: list[tuple[str, str]] | None = None  # what show_rows last showed, before wrapping
        self.wrapped_to = 0  # the width show_rows last wrapped them to
        self.summed: list[tuple[str, str]] | None = None  # the rows the collapsed line gives, unwrapped
        self.height_painted = 0  # lines it took when last painted: layout only when that changes

    def show_rows(self, rows: list[tuple[str, str]], width: int = 0) -> None:
        """The rows, each value wrapped to `width` columns (its inside when open; 0: not wrapped),
        painted only where they changed: a dashboard redraws every panel once a second, and
        Textual renders again each one painted."""
        if rows != self.rows or width != self.wrapped_to:
            self.rows, self.wrapped_to = list(rows), width
            self.show(kv_table(wrapped(rows, width) if width else rows), self.rows)

    def show(self, table: Table, rows: list[tuple[str, str]] | None = None) -> None:
        """`table` as its body; `rows`, where it was made from them, for its collapsed line."""
        self.body, self.summed = table, rows
        self.paint()

    @property
    def lines(self) -> int:
        """Its height expanded, borders included (every cell is no_wrap: a row is a line)."""
        return len(self.body.rows) + 2

    def summary(self) -> Text:
        """Its title and its first three rows, whole (not as wrapped when open), on one line."""
        if self.summed is not None:
            rows = [" ".join(c for c in row if c.strip()) for row in self.summed]
        else:
            cells = [[str(c) for c in column.cells] for column in self.body.columns]
            rows = [" ".join(c for c in row if c.strip()) for row in zip(*cells)]
        text = Text("▸ ", style="dim")
        text.append(self.border_title or "", style="bold")
        text.append("  " + " · ".join(r for r in rows[:3] if r.strip()))
        text.no_wrap, text.overflow = True, "ellipsis"
        return text

    def collapse(self, collapsed: bool) -> None:
        if collapsed != self.collapsed:
            self.collapsed = collapsed
            self.set_class(collapsed, "collapsed")
            self.paint()

    def paint(self) -> None:
        """Its content again; the screen laid out again only where its height changed (a layout
        of the whole dashboard costs more than rendering one panel)."""
        height = 1 if self.collapsed else self.lines
        self.update(self.summary() if self.collapsed else self.body, layout=height != self.height_painted)
        self.height_painted = height


class SideColumn(VerticalScroll):
    """The panels beside the chart. Those that do not all fit collapse to a line each: the one
    chosen (`cycle` moves the choice) stays open where it fits, then as many of the others, in
    order, as fit. Nothing is ever cut off: the column never needs scrolling. Until a choice is
    made, the target's panel is chosen where the run has a target (its forecast, the figure the
    user is after, is too long for a collapsed line), else throughput."""

    GROUPS = ("state", "target", "throughput", "anatomy", "layers", "tasks", "gpu", "memory", "host")

    def __init__(self, *children, **kwargs):
        super().__init__(*children, **kwargs)
        self.chosen: str | None = None  # None: none chosen yet (`current`)

    def groups(self) -> list[tuple[str, list[Panel]]]:
        """The panels shown, by group: every GPU panel is one group."""
        shown = [p for p in self.query(Panel) if p.styles.display != "none"]
        by_group = [(g, [p for p in shown if (p.has_class("gpu") if g == "gpu" else p.id == g)]) for g in self.GROUPS]
        return [(g, panels) for g, panels in by_group if panels]

    def current(self, names: list[str]) -> str:
        """The group chosen, among `names` (those shown)."""
        if self.chosen in names:
            return self.chosen
        return next((name for name in ("target", "throughput") if name in names), names[0])

    def cycle(self) -> str:
        """Choose the next group (opened where it fits); its name."""
        names = [g for g, _ in self.groups()]
        if not names:
            return ""
        self.chosen = names[(names.index(self.current(names)) + 1) % len(names)]
        self.fit()
        return self.chosen

    def fit(self) -> None:
        height = self.size.height
        groups = self.groups()
        if not height or not groups:
            return
        chosen = self.current([name for name, _ in groups])
        opened, used = set(), sum(len(panels) for _, panels in groups)  # all collapsed: a line each
        for name, panels in sorted(groups, key=lambda gp: gp[0] != chosen):  # the chosen first
            extra = sum(p.lines - 1 for p in panels)
            if used + extra <= height:  # the chosen one too: a panel cut off would mean scrolling
                opened.add(name)
                used += extra
        for name, panels in groups:
            for p in panels:
                p.collapse(name not in opened)

    def on_resize(self) -> None:
        self.fit()

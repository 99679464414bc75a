"""The dashboard's one-line readings: the step line, and a bar per GPU (or the CPU run's own use).

For a terminal of any size: the step line (step/total, loss,
tokens/s, MFU, ETA) and a bar per GPU (or, on a CPU run, the run's own CPU and memory).

Each line is fitted to the width it gets: fields are dropped least useful first and bars shrink,
rather than letting the terminal cut the line.
"""

from __future__ import annotations

import math
import os

from rich.text import Text

from ...core import protocol as P
from ...core.hardware.telemetry import GPUReading, ProcessLoad, Reading, find_gpu, run_gpu_indices
from ..formatting import DASH, bar, fmt_count, fmt_duration
from ...core.run.state import RunState
from .panels import gib

SEP = " · "
MIN_BAR = 4
TRACK = " on grey27"  # a bar's empty part shows as a track, so 5% reads as 5% of something


def fit(fields: list[tuple[int, str]], width: int, sep: str = SEP) -> str:
    """The fields (priority, text) that fit in `width` joined by `sep`, in their order: those of
    the highest priority number leave first."""
    kept = [f for f in fields if f[1]]
    while kept and len(sep.join(t for _, t in kept)) > width:
        kept.remove(max(kept, key=lambda f: f[0]))
    return sep.join(t for _, t in kept)


def step_text(v: RunState, width: int) -> Text:
    """step/total with a bar, then loss, tokens/s, MFU and ETA; the bar takes what is left."""
    frac = v.step / v.max_steps if v.max_steps else 0.0
    state = "" if v.state in (P.RUNNING, P.PAUSED) else f"{v.state.upper()}  "  # paused shows in the top bar
    head = f"{state}step {v.step}/{v.max_steps or DASH}"
    fields = [
        (0, f"loss {v.loss:.4f}" if v.loss is not None else f"loss {DASH}"),
        (1, f"{fmt_count(v.tokens_per_s)} tok/s" if v.tokens_per_s else f"{DASH} tok/s"),
        (3, f"MFU {100 * v.mfu:.1f}%" if v.mfu is not None else ""),
        (2, f"ETA {fmt_duration(v.eta)}" if v.eta is not None else f"ETA {DASH}"),
        (4, f"val {v.last_eval.val_loss:.4f}" if v.last_eval else ""),
    ]
    rest = fit(fields, width - len(head) - len(SEP))
    room = width - len(head) - len(SEP) - len(rest) - len(" 100%") - 2
    text = Text(head, style="bold")
    if room >= MIN_BAR and v.max_steps:
        text.append(" ")
        text.append(bar(frac, min(room, 40)), style="cyan" + TRACK)
        text.append(f" {100 * frac:3.0f}%")
    if rest:
        text.append(SEP + rest)
    return text


# ------------------------------------------------------------------------------------ GPU bars
def gpu_cell(index: int, g: GPUReading | None, width: int) -> Text:
    """One GPU in `width` columns: utilisation and VRAM as bars with their figures, then (where
    there is room) temperature, power and the GPU's name."""
    label = f"GPU{index}"
    if g is None:
        return Text(f"{label} no reading"[:width], style="dim")
    util = f"{g.util:3.0f}%" if g.util is not None else f"{DASH:>4}"
    used = f"{g.mem_used / 2**30:.1f}" if g.mem_used is not None else DASH
    total = f"{g.mem_total / 2**30:.0f}G" if g.mem_total is not None else DASH
    mem = f"{used}/{total}"
    mem_frac = g.mem_used / g.mem_total if g.mem_used is not None and g.mem_total else 0.0
    extras = [f"{g.temperature:.0f}°C" if g.temperature is not None else "",
              f"{g.power:.0f}W" if g.power is not None else "", g.name]
    # richest first: all extras, then fewer; then one bar; then figures only
    for n_extra in (3, 2, 1, 0):
        tail = " ".join(e for e in extras[:n_extra] if e)
        fixed = len(label) + 1 + len(util) + 2 + len(mem) + 2 + (len(tail) + 2 if tail else 0)
        room = (width - fixed) // 2 - 1
        if room >= MIN_BAR:
            room = min(room, 24)
            text = Text(label + " ", style="bold")
            text.append(bar((g.util or 0) / 100, room), style="green" + TRACK)
            text.append(f" {util}  ")
            text.append(bar(mem_frac, room), style="magenta" + TRACK)
            text.append(f" {mem}")
            if tail:
                text.append("  " + tail, style="dim")
            return text
    room = width - len(label) - len(util) - len(mem) - 4
    text = Text(label + " ", style="bold")
    if room >= MIN_BAR:
        text.append(bar((g.util or 0) / 100, min(room, 24)), style="green" + TRACK)
        text.append(" ")
    text.append(f"{util} {mem}")
    text.truncate(width)
    return text


def gpu_lines(indices: list[int], reading: Reading | None, width: int, max_lines: int) -> list[Text]:
    """A cell per GPU, as many to a line as `max_lines` lines need."""
    per_line = max(1, math.ceil(len(indices) / max_lines))
    cell_width = (width - 3 * (per_line - 1)) // per_line
    cells = [gpu_cell(i, find_gpu(reading, i), cell_width) for i in indices]
    lines = []
    for start in range(0, len(cells), per_line):
        line = Text()
        for n, cell in enumerate(cells[start:start + per_line]):
            if n:
                line.append(" │ ", style="dim")
            cell.pad_right(cell_width - cell.cell_len)
            line.append_text(cell)
        lines.append(line)
    return lines


def cpu_line(load: ProcessLoad | None, reading: Reading | None, width: int) -> Text:
    """A CPU run's bar: the run's processes' CPU (of every core) and resident memory (of the RAM)."""
    if load is None:
        return Text(f"CPU run · engine CPU {DASH} · RSS {DASH}", style="dim")
    cpu = f"{load.cpu_percent:.0f}% of {load.cores} cores"
    ram_total = reading.ram_total if reading else 0
    rss = gib(load.rss) + (f"/{gib(ram_total)}" if ram_total else "")
    fixed = len("engine CPU ") + len(cpu) + len("  RSS ") + len(rss) + 2
    room = min(24, (width - fixed) // 2)
    text = Text("engine CPU ", style="bold")
    if room >= MIN_BAR:
        text.append(bar(load.cpu_percent / (100 * load.cores), room), style="green" + TRACK)
        text.append(" ")
    text.append(cpu)
    text.append("  RSS ", style="bold")
    if room >= MIN_BAR and ram_total:
        text.append(bar(load.rss / ram_total, room), style="magenta" + TRACK)
        text.append(" ")
    text.append(rss)
    text.truncate(width)
    return text


def device_lines(screen, gpus: list[int], width: int) -> Text:
    """A bar per GPU of the run (two to four lines at most, several GPUs to a line when they are
    many), or the CPU run's own CPU and memory; `screen`: the dashboard, with its readings."""
    if gpus:
        lines = gpu_lines(gpus, screen.reading, width, 2 if screen.has_class("short") else 4)
    elif screen.on_gpu:
        nvml_error = screen.telemetry.nvml_error if screen.telemetry else ""
        lines = [Text("GPU: no reading of the run's GPU" + (f" ({nvml_error})" if nvml_error else ""), style="dim")]
    else:
        lines = [cpu_line(screen.load, screen.reading, width)]
    return Text("\n").join(lines)


def run_gpus(devices: tuple[str, ...] | None, uuids: tuple[str, ...], reading: Reading | None) -> list[int]:
    """NVML indices of the GPUs a run trains on here (`devices` as RunStarted names them); before
    it names them (preparing, compiling), the first GPU; empty for a CPU run."""
    if devices is None:
        return [g.index for g in reading.gpus[:1]] if reading else []
    # the engine inherits this process's environment, so its CUDA numbering is ours
    return run_gpu_indices(devices, os.environ.get("CUDA_VISIBLE_DEVICES"), uuids, reading.gpus if reading else [])


def failure_text(v: RunState) -> Text:
    """What a failed run's dashboard shows in place of its panels: the error, the end of its
    traceback, where the run and its last checkpoint are."""
    f = v.failure
    text = Text("RUN FAILED\n", style="bold red")
    text.append((f.message if f else v.state_detail or "the engine stopped") + "\n", style="bold")
    if f and f.traceback:
        text.append("\n".join(f.traceback.rstrip().splitlines()[-8:]) + "\n", style="red")
    text.append(f"run folder: {v.run_dir or '–'}\n")
    text.append(f"last checkpoint: {v.last_checkpoint or 'none'}")
    return text


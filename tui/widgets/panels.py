"""The dashboard's number panels: run state, throughput, memory, GPU and host. Each renders from
the RunView (engine figures) and the latest telemetry Reading (NVML/psutil, sampled at 1 Hz)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from lmcockpit.core import protocol as P
from lmcockpit.core.telemetry import Reading
from lmcockpit.tui.runview import DASH, RunView, fmt_count, fmt_duration

STATE_STYLE = {P.RUNNING: "bold green", P.PAUSED: "bold yellow", P.FAILED: "bold red", P.FINISHED: "bold cyan",
               P.ABORTED: "bold magenta", P.INTERRUPTED: "bold magenta", P.COMPILING: "bold blue",
               P.PREPARING: "bold blue", P.EVALUATING: "bold blue", P.CHECKPOINTING: "bold blue"}
SPARK = "▁▂▃▄▅▆▇█"


def gib(n: float) -> str:
    return f"{n / 2**30:.1f}G"


def spark(values: list[float], width: int = 16, top: float = 100.0) -> str:
    vals = values[-width:]
    return "".join(SPARK[min(7, int(max(0.0, v) / top * 7.999))] for v in vals)


def kv_table(rows: list[tuple[str, str]]) -> Table:
    t = Table.grid(padding=(0, 1))
    t.add_column(style="dim", no_wrap=True)
    t.add_column(no_wrap=True)
    for k, v in rows:
        t.add_row(k, v)
    return t


def state_text(v: RunView) -> Text:
    text = Text(v.state.upper(), style=STATE_STYLE.get(v.state, "bold"))
    if v.progress and v.state == P.PREPARING and v.progress.total:
        text.append(f"  {v.progress.phase} {100 * v.progress.done / v.progress.total:.0f}%", style="dim")
    elif v.state_detail and v.state != P.FAILED:
        text.append(f"  {v.state_detail}", style="dim")
    return text


def throughput_rows(v: RunView) -> list[tuple[str, str]]:
    return [
        ("tokens/s", fmt_count(v.tokens_per_s) if v.tokens_per_s else DASH),
        ("steps/s", f"{1 / v.dt_ema:.2f}" if v.dt_ema else DASH),
        ("MFU", f"{100 * v.mfu:.1f}%" if v.mfu is not None else DASH),
        ("ETA", fmt_duration(v.eta) if v.eta is not None else DASH),
        ("elapsed", fmt_duration(v.elapsed)),
        ("tokens seen", fmt_count(v.tokens_seen) if v.tokens_seen else DASH),
        ("loss", f"{v.loss:.4f}" if v.loss is not None else DASH),
        ("val loss", f"{v.last_eval.val_loss:.4f} @ {v.last_eval.step}" if v.last_eval else DASH),
        ("lr", f"{v.lr:.2e}" if v.lr is not None else DASH),
    ]


def memory_rows(v: RunView, reading: Reading | None) -> list[tuple[str, str]]:
    mem = v.mem or {}
    gpu = reading.gpus[0] if reading and reading.gpus else None
    return [
        ("allocated", gib(mem["allocated"]) if "allocated" in mem else DASH),
        ("reserved", gib(mem["reserved"]) if "reserved" in mem else DASH),
        ("peak", gib(mem["peak"]) if "peak" in mem else DASH),
        ("GPU used", f"{gib(gpu.mem_used)} / {gib(gpu.mem_total)}" if gpu else DASH),
    ]


def gpu_rows(reading: Reading | None, util_history: list[float], no_gpu_reason: str) -> list[tuple[str, str]]:
    if not reading or not reading.gpus:
        return [("GPU", "none: CPU run"), ("", no_gpu_reason or "")]
    g = reading.gpus[0]
    return [
        ("name", g.name),
        ("util", f"{g.util:.0f}%  {spark(util_history)}"),
        ("mem util", f"{g.mem_util:.0f}%"),
        ("power", f"{g.power:.0f} W" if g.power is not None else DASH),
        ("temp", f"{g.temperature:.0f} °C" if g.temperature is not None else DASH),
        ("SM clock", f"{g.sm_clock} MHz" if g.sm_clock is not None else DASH),
    ]


def host_rows(reading: Reading | None) -> list[tuple[str, str]]:
    if reading is None:
        return [("CPU", DASH), ("RAM", DASH)]
    return [("CPU", f"{reading.cpu_percent:.0f}%"), ("RAM", f"{gib(reading.ram_used)} / {gib(reading.ram_total)}")]


class Panel(Static):
    """A titled box of key/value rows."""

    def __init__(self, title: str, **kwargs):
        super().__init__(**kwargs)
        self.border_title = title

    def show_rows(self, rows: list[tuple[str, str]]) -> None:
        self.update(kv_table(rows))

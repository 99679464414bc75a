"""The dashboard's time panel: where the recent steps' seconds go, and the work between steps.

A bar per part of a step (data, forward+backward, sync, optimizer), each its share of the recent
steps (Anatomy.recent: about the last ten, smoothed), so a change shows within seconds; the parts
under 1 % share a line, with no bar. Under them, the share of the run's whole time that the work
between steps took (validation, tasks, samples, checkpoints, compile), each kind that took any.
Where the run has an MFU (a GPU with a known peak), what stands between it and the peak: forward
and backward alone reach the MFU over their share of the step, and the rest of the step is what
keeps the run from that figure (`mfu_text`). The panel holds the run's MFU: the throughput panel
leaves its row out while this one shows.

Hidden until a step with parts arrives (a run from before steps had them has none). Collapsed,
one line: forward+backward's share, the other parts' by size, then the MFU, as many as fit."""

from __future__ import annotations

import textwrap
from typing import Mapping

from rich.table import Table
from rich.text import Text

from ...core.run.anatomy import LABELS, OUTSIDE, STEP_PARTS, Anatomy, ordered, pct
from ...core.run.state import RunState
from ..formatting import bar
from .glance import MIN_BAR, TRACK
from .panels import Panel

# A row's label is never cut, and "forward+backward" would leave the bars a third of the room.
SHORT = {"compute": "fwd+bwd"}
SHARE = 5  # columns of a share: "<0.1%", " 100%"
SMALL = 0.01  # a part under this share of the step gets no bar, nor a row of its own
SEP = " · "
BAR_STYLE = "cyan" + TRACK


def label(name: str) -> str:
    return SHORT.get(name) or LABELS.get(name, name)


def packed(items: list[str], width: int, sep: str = ", ") -> list[str]:
    """`items` joined by `sep`, as many to a line of `width` as fit: an item is never split."""
    lines: list[str] = []
    for n, item in enumerate(items):
        item += sep.rstrip() if n < len(items) - 1 else ""
        if lines and len(lines[-1]) + 1 + len(item) <= width:
            lines[-1] += " " + item
        else:
            lines.append(item)
    return lines


def part_lines(recent: Mapping[str, float], width: int) -> list[Text]:
    """A line per part of the recent steps that takes 1 % of them or more: its label, its share,
    and a bar of it (the whole room: the whole step) where `width` leaves room for one; then the
    parts under 1 % (a bar too short to see), their shares on one line (a single GPU's sync, a
    prefetched batch's data): the side column has no rows to spare."""
    names = ordered(recent, STEP_PARTS)
    barred = [n for n in names if recent[n] >= SMALL]
    labels = max((len(label(n)) for n in barred), default=0)
    room = width - labels - 1 - SHARE - 1
    lines = []
    for name in barred:
        line = Text(f"{label(name):<{labels}} ", style="dim")
        line.append(f"{pct(recent[name]):>{SHARE}}")
        if room >= MIN_BAR:
            line.append(" ")
            line.append(bar(recent[name], room), style=BAR_STYLE)
        lines.append(line)
    small = [f"{label(n)} {pct(recent[n])}" for n in names if n not in barred]
    return lines + [Text(line, style="dim") for line in packed(small, width)]


def mfu_text(mfu: float, compute: float | None, width: int) -> str:
    """The MFU and what forward and backward alone reach (MFU over their share of the step), in
    the longer wording where it fits `width` (the shorter is wrapped where it does not)."""
    if not compute:
        return f"MFU {pct(mfu)} of peak"
    alone = pct(mfu / compute)
    longer = f"MFU {pct(mfu)} of peak, {alone} in fwd+bwd"
    return longer if len(longer) <= width else f"MFU {pct(mfu)}, {alone} in fwd+bwd"


def between_lines(anatomy: Anatomy, width: int) -> list[str]:
    """Each kind of work between steps that took any time, with its share of the whole run, as
    many to a line of `width` as fit: a share stays on its kind's line."""
    wall = anatomy.wall
    kinds = [n for n in ordered(anatomy.between, OUTSIDE) if anatomy.between[n] > 0] if wall > 0 else []
    return packed([f"{label(n)} {pct(anatomy.between[n] / wall)}" for n in kinds], width)


def anatomy_lines(anatomy: Anatomy, mfu: float | None, width: int) -> list[Text]:
    """The open panel's lines, each at most `width` columns: the parts' bars, the MFU where known,
    the work between steps. None before a step has parts."""
    if not anatomy.recent:
        return []
    lines = part_lines(anatomy.recent, width)
    if mfu is not None:
        lines += [Text(line) for line in textwrap.wrap(mfu_text(mfu, anatomy.compute_share(), width), width)]
    lines += [Text(line, style="dim") for line in between_lines(anatomy, width)]
    return lines


def anatomy_summary(anatomy: Anatomy, mfu: float | None, width: int) -> str:
    """The collapsed line's figures in `width` columns: forward+backward's share, the other parts'
    by size (those of 1 % or more), the MFU; as many as fit whole, then an ellipsis where one fits."""
    recent = anatomy.recent
    others = sorted((n for n in recent if n != "compute" and recent[n] >= SMALL), key=lambda n: -recent[n])
    first = ["compute"] if "compute" in recent else []
    pieces = [f"{label(n)} {pct(recent[n])}" for n in first + others]
    pieces += [f"MFU {pct(mfu)}"] if mfu is not None else []
    shown = []
    while pieces and len(SEP.join([*shown, pieces[0]])) <= width:
        shown.append(pieces.pop(0))
    if pieces and len(SEP.join([*shown, "…"])) <= width:
        shown.append("…")
    return SEP.join(shown)


class AnatomyPanel(Panel):
    """The time panel: hidden until the run has a step with parts; bars, the MFU, the rest."""

    def __init__(self, **kwargs):
        super().__init__("time", **kwargs)
        self.display = False
        self.anatomy, self.mfu = Anatomy(), None
        self.inside = 0  # inside the panel when open
        self.shown: list[Text] = []

    def show_anatomy(self, v: RunState, width: int) -> bool:
        """Redraw from the run; `width`: its inside width when open. Whether it shows."""
        anatomy, width = v.history.anatomy, max(12, width)
        lines = anatomy_lines(anatomy, v.mfu, width)
        if self.display != bool(lines):
            self.display = bool(lines)
        if lines == self.shown and width == self.inside:
            return bool(lines)  # the same lines: a redraw once a second would render them again for nothing
        self.anatomy, self.mfu, self.inside, self.shown = anatomy, v.mfu, width, lines
        table = Table.grid()
        table.add_column(no_wrap=True)
        for line in lines:
            table.add_row(line)
        self.show(table)
        return bool(lines)

    def summary(self) -> Text:
        text = Text("▸ ", style="dim")
        text.append(self.border_title or "", style="bold")
        room = self.inside + 2 - text.cell_len - 2  # collapsed: no border, the same padding
        text.append("  " + anatomy_summary(self.anatomy, self.mfu, room))
        text.no_wrap, text.overflow = True, "ellipsis"
        return text

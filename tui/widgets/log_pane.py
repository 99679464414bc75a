"""A log pane whose lines wrap again to its width whenever that changes.

Textual's RichLog wraps a line once, when it is written, and to the width of the terminal's
console rather than its own: after a resize the old lines kept their old breaks (cut short on a
wider terminal, past the pane's edge on a narrower one). This one keeps the text of its last lines,
wraps each to the pane's own width, and writes them all again when that width changes."""

from __future__ import annotations

from collections import deque

from textual.events import Resize
from textual.widgets import RichLog


class LogPane(RichLog):
    """Plain lines (no markup, no highlighting), wrapped to the pane; `add` writes one."""

    def __init__(self, max_lines: int, **kwargs) -> None:
        super().__init__(max_lines=max_lines, markup=False, highlight=False, wrap=True, **kwargs)
        self.texts: deque[str] = deque(maxlen=max_lines)  # a line wraps to one or more: never more are kept
        self.wrapped_at = 0  # the width the lines shown were wrapped to; 0 until the pane has one
        self.rows_shown = 0  # the pane's height the scroll position was last at

    def add(self, text: str) -> None:
        self.texts.append(text)
        if not self.wrapped_at:
            return  # written once the pane has its width
        if self.scrollable_content_region.width != self.wrapped_at:  # a scrollbar came or went
            self.rewrap()
        else:
            self.write(text, width=self.wrapped_at)

    def on_resize(self, event: Resize) -> None:
        # In place of RichLog's handler, which writes what came before the first size at the
        # console's width
        event.prevent_default()
        self.rewrap()
        self.rows_shown = self.scrollable_content_region.height

    def rewrap(self) -> None:
        """Every line kept, written again at the pane's width if that has changed; the end stays
        in view if it was (judged at the height it had: a resize has changed it already)."""
        width = self.scrollable_content_region.width
        if not width or width == self.wrapped_at:
            return
        self._size_known = True
        at_end = not self.wrapped_at or self.scroll_offset.y + self.rows_shown >= len(self.lines)
        self.clear()
        self.wrapped_at = width
        for text in self.texts:
            self.write(text, width=width, scroll_end=at_end)

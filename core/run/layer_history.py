"""The last records of each block's health (`layers` rows, P.LayerStats): what the layers panel draws.

A bounded window, KEPT records, whatever the run's length: the panel is a few dozen columns wide,
and a record every step for days would otherwise grow a history.json without end. Cut like the
steps by a rollback or a resume (the steps after it are redone, and so are their records). Saved
in history.json as the rows themselves, read back through rows.py's checks. No torch.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator

from .. import protocol as P
from . import rows

KEPT = 120  # records: wider than the widest panel's heatmap


class LayerWindow:
    """The last KEPT LayerStats, oldest first."""

    def __init__(self) -> None:
        self.records: deque[P.LayerStats] = deque(maxlen=KEPT)

    def add(self, record: P.LayerStats) -> None:
        """A record; one at or before the last step first drops those it redoes."""
        self.cut(record.step)
        self.records.append(record)

    def fold(self, row: dict[str, Any]) -> None:
        """A well-formed `layers` row of metrics.jsonl."""
        record = rows.event_of(row)
        if record is not None:
            self.add(record)

    def cut(self, step: int) -> None:
        """Drop the records at or past `step`: the run went back and redoes them."""
        while self.records and self.records[-1].step >= step:
            self.records.pop()

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[P.LayerStats]:
        return iter(self.records)

    @property
    def blocks(self) -> int:
        """The blocks the last record has (0: none recorded)."""
        return len(self.records[-1].grad_norm) if self.records else 0

    def state(self) -> list[dict[str, Any]]:
        return [rows.row_of(r, 0.0) for r in self.records]

    @classmethod
    def from_state(cls, s: list) -> LayerWindow:
        """As `state` saved it; a row that is not a well-formed record is left out (ValueError for
        a state that is not a list)."""
        if not isinstance(s, list):
            raise ValueError("not a list of layer records")
        window = cls()
        for row in s[-KEPT:]:
            window.fold(row)
        return window

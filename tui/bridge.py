"""Engine events into Textual, posted in batches so that a fast run never floods the message loop.

A thread worker blocks on the engine's queue and posts what
arrives in batches (everything queued within a 50 ms window becomes one message), so a fast run
never floods the message loop."""

from __future__ import annotations

import time

from textual.message import Message
from textual.message_pump import MessagePump
from textual.worker import get_current_worker

from ..core.process.runner import ProcessHandle

BATCH_WINDOW = 0.05


class EngineEvents(Message):
    def __init__(self, events: list[object]) -> None:
        super().__init__()
        self.events = events


def drain(handle: ProcessHandle, target: MessagePump) -> None:
    """Run in a thread worker until the process has ended and every event was posted."""
    worker = get_current_worker()
    while not worker.is_cancelled and not handle.done:
        first = handle.poll(timeout=0.2)
        if first is None:
            continue
        batch, deadline = [first], time.monotonic() + BATCH_WINDOW
        while time.monotonic() < deadline and not handle.done:
            ev = handle.poll(timeout=max(0.0, deadline - time.monotonic()))
            if ev is None:
                break
            batch.append(ev)
        target.post_message(EngineEvents(batch))

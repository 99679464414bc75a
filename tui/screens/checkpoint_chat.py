"""The chat screen: a past run's checkpoint in a chat engine process, and the chat pane.

Chat with a past run: its checkpoint loads in a chat engine process (the cockpit stays
torch-free), and the chat pane talks to it: as a conversation when the checkpoint is a chat
model's (core/infer/chat_model.py), else continuing text."""

from __future__ import annotations

import threading

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import Footer, Static

from ...core import protocol as P
from ...core.infer.chat_engine import ChatEngine
from ...core.infer.chat_model import is_chat_model
from ..bridge import EngineEvents, drain
from ...core.run.state import run_config
from ..widgets.chat_pane import ChatPane
from ..widgets.log_pane import LogPane


CLOSE_GRACE = 5.0  # seconds a closing chat engine gets to exit on its own before it is killed


class ChatScreen(Screen):
    BINDINGS = [("escape", "close", "Back")]

    def __init__(self, checkpoint: str):
        super().__init__()
        self.checkpoint = checkpoint
        self.engine = ChatEngine(checkpoint)

    def compose(self) -> ComposeResult:
        yield Static(Text(f" loading {self.checkpoint} …", style="bold"), id="topbar")
        yield ChatPane(self.send_sample, id="chat-full")
        yield LogPane(500, id="log")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#log", LogPane).border_title = "chat engine log"
        self.query_one("#chat-input").focus()
        self.engine.start()
        self.drain_engine()

    @work(thread=True, exclusive=True, group="chat-events")
    def drain_engine(self) -> None:
        drain(self.engine, self)

    def on_engine_events(self, message: EngineEvents) -> None:
        top = self.query_one("#topbar", Static)
        for ev in message.events:
            if isinstance(ev, P.SampleText):
                self.query_one(ChatPane).receive(ev)
            elif isinstance(ev, P.LogLine):
                self.query_one("#log", LogPane).add(ev.text)
            elif isinstance(ev, P.RunStarted):
                if config := run_config(ev.config):
                    self.query_one(ChatPane).configure(config.sample, chat=is_chat_model(ev.run_dir))
                top.update(Text(f" chat · {ev.run_dir} · step {ev.start_step} · {ev.n_params / 1e6:.2f}M params "
                                f"· {ev.device} {ev.precision}", style="bold"))
            elif isinstance(ev, P.Failure):
                top.update(Text(f" cannot chat: {ev.message}", style="bold red"))

    def send_sample(self, request: P.Sample) -> bool | str:
        """True once sent; otherwise why it could not be (the chat pane shows it)."""
        engine = self.engine
        if engine.failure is not None or engine.done:
            why = engine.failure.message if engine.failure is not None else "it was closed"
            if engine.loaded is None:
                return f"the checkpoint could not be loaded: {why}"
            return f"the chat engine has stopped: {why}"
        if engine.loaded is None:
            return "still loading the checkpoint; try again in a moment"
        engine.send(request)
        return True

    def on_unmount(self) -> None:
        self.engine.send(P.Abort(save=False))

    def action_close(self) -> None:
        """Back at once: the Abort also stops a generation under way (after its current token), and
        the wait for the engine to exit, then a kill if it has not (a chat engine holds nothing
        to save), happens off the UI thread."""
        self.engine.send(P.Abort(save=False))
        threading.Thread(target=self.engine.close, args=(CLOSE_GRACE,), name="lmcockpit-chat-close",
                         daemon=True).start()
        self.app.pop_screen()

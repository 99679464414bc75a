"""The chat pane: a prompt box, the streamed samples, editable settings and the session's history.

It sends `Sample` requests through a callback (the live training engine, or a chat engine on a
past checkpoint; it returns True once sent, else False or the reason it was not) and shows the
`SampleText` pieces that come back, row by row. Settings are edited in the prompt box with
`/set KEY VALUE`, checked by the same rules as `lmcockpit chat`.

On a chat model (`configure(..., chat=True)`: core/infer/chat_model.py decides) the pane holds a
conversation: each prompt is the user's turn, sent with the turns before it (and `/system TEXT`'s
system prompt) for the engine to render in the chat template; the replies are shown as turns, and
`/reset` starts a new conversation. A base model's pane continues text, as before.
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Input, Static

from ...core import protocol as P
from ...core.config import ConfigError, SampleConfig
from ...core.protocol import SAMPLE_SETTINGS, parse_setting

EDITABLE = ("temperature", "top_k", "top_p", "max_new_tokens", "num_samples", "seed")
COMPLETION_HINT = "a prompt; /set temperature 0.5 · /greedy TEXT · /help"
CHAT_HINT = "your turn; /system TEXT · /reset · /set temperature 0.5 · /help"


@dataclass
class Exchange:
    """One request and what came back, row by row."""
    prompt: str
    step: int | None = None
    rows: dict[int, str] = field(default_factory=dict)
    done: bool = False


class ChatPane(Vertical):
    def __init__(self, send: Callable[[P.Sample], bool | str], settings: dict[str, Any] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.send_request = send
        self.settings = {"max_new_tokens": 64, "temperature": 0.8, "top_k": 50, "top_p": 1.0, "num_samples": 1,
                         "seed": 0, **(settings or {})}
        self.history: dict[str, Exchange] = {}
        self.ids = itertools.count(1)
        # Several cockpits may watch one run, and every SampleText reaches all of them: each pane
        # knows its own requests by this prefix.
        self.prefix = f"chat-{secrets.token_hex(3)}"
        self.chat = False  # a chat model: a conversation in its template, not text continued
        self.system = ""
        self.conversation: list[str] = []  # request ids of this conversation's turns, in order

    def compose(self) -> ComposeResult:
        yield Static(id="chat-settings")
        with VerticalScroll(id="chat-scroll"):
            yield Static(id="chat-output")
        yield Input(placeholder=COMPLETION_HINT, id="chat-input")

    def on_mount(self) -> None:
        self.show_settings()
        self.show_history()

    def configure(self, sample: SampleConfig, chat: bool = False) -> None:
        """Start from a run's [sample] settings; `chat`: the model is a chat model."""
        self.settings.update({k: getattr(sample, k) for k in EDITABLE if hasattr(sample, k)})
        self.chat = chat
        self.query_one("#chat-input", Input).placeholder = CHAT_HINT if chat else COMPLETION_HINT
        self.show_settings()
        self.show_history()

    def show_settings(self) -> None:
        s = self.settings
        line = Text(f"temp {s['temperature']} · top-k {s['top_k']} · top-p {s['top_p']} · "
                    f"max {s['max_new_tokens']} · samples {s['num_samples']} · seed {s['seed']}", style="dim")
        if self.chat:
            line = Text.assemble(("chat model", "bold"), (f" · system: {self.system}" if self.system else "", "dim"),
                                 " · ", line)
        self.query_one("#chat-settings", Static).update(line)

    def show_history(self) -> None:
        if self.chat:
            return self.show_conversation()
        parts = []
        for ex in self.history.values():
            head = Text("» ", style="bold")
            head.append(ex.prompt, style="bold cyan")
            if ex.step is not None:
                head.append(f"   (step {ex.step})", style="dim")
            parts.append(head)
            for row in sorted(ex.rows):
                if len(ex.rows) > 1:
                    parts.append(Text(f"  [{row + 1}]", style="dim"))
                parts.append(Text(ex.prompt + ex.rows[row], style="" if ex.done else "italic"))
            parts.append(Text(""))
        self.query_one("#chat-output", Static).update(Group(*parts) if parts else
                                                      Text("Ask the model to continue a prompt.", style="dim"))
        self.query_one("#chat-scroll", VerticalScroll).scroll_end(animate=False)

    def show_conversation(self) -> None:
        """The conversation's turns: the user's, then the model's reply (in italics while it comes),
        each text in a column of its own so a reply's code keeps its indentation."""
        turns = Table.grid(padding=(0, 1))
        turns.add_column(style="bold", no_wrap=True)
        turns.add_column()
        for request_id in self.conversation:
            ex = self.history[request_id]
            turns.add_row("you", Text(ex.prompt, style="bold cyan"))
            reply = Text(ex.rows.get(0, "").strip("\n") or "…", style="" if ex.done else "italic")
            if ex.step is not None:
                reply.append(f"   (step {ex.step})", style="dim")
            turns.add_row("model", reply)
        self.query_one("#chat-output", Static).update(turns if self.conversation else Text(
            "A chat model: type your turn; /system TEXT sets the system prompt, /reset starts anew.", style="dim"))
        self.query_one("#chat-scroll", VerticalScroll).scroll_end(animate=False)

    def note(self, text: str, style: str = "yellow") -> None:
        self.app.notify(text, severity="error" if style == "red" else "information")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        text = event.value
        event.input.value = ""
        if text.startswith("/"):
            self.command(text[1:])
        elif text.strip():
            self.ask(text)

    def command(self, line: str) -> None:
        name, _, rest = line.partition(" ")
        if name == "set":
            key, _, value = rest.strip().partition(" ")
            if key not in EDITABLE:
                self.note(f"/set {key}: not a setting; these are: {', '.join(EDITABLE)}", "red")
                return
            try:
                self.settings[key] = parse_setting(key, value.strip())
            except ConfigError as e:
                self.note(f"/set {key}: {e}", "red")
                return
            self.show_settings()
        elif name == "greedy" and rest.strip():
            self.ask(rest, greedy=True, num_samples=1)
        elif name in ("reset", "system") and self.chat:
            self.converse(name, rest.strip())
        else:
            chat = " · /system TEXT · /reset" if self.chat else ""
            self.note("/set KEY VALUE (" + ", ".join(f"{k}: {SAMPLE_SETTINGS[k].expected}" for k in EDITABLE)
                      + f") · /greedy TEXT{chat} · anything else is a " + ("turn" if self.chat else "prompt"))

    def converse(self, name: str, rest: str) -> None:
        """/reset: a new conversation (the system prompt stays); /system TEXT: the system prompt."""
        if name == "reset":
            self.conversation = []
        else:
            self.system = rest
        self.show_settings()
        self.show_history()

    def messages(self, text: str) -> tuple[tuple[str, str], ...]:
        """A turn's request: the system prompt, the conversation's finished turns, then `text`."""
        turns = [(role, said) for ex in (self.history[i] for i in self.conversation)
                 for role, said in (("user", ex.prompt), ("assistant", ex.rows.get(0, "")))]
        return ((("system", self.system),) if self.system else ()) + (*turns, ("user", text))

    def ask(self, prompt: str, **overrides: Any) -> None:
        if self.chat and self.conversation and not self.history[self.conversation[-1]].done:
            self.note("the model is still answering; your turn comes after its reply")
            return
        request_id = f"{self.prefix}-{next(self.ids)}"
        s = {**self.settings, **overrides, **({"num_samples": 1} if self.chat else {})}
        request = P.Sample(request_id, prompt, s["max_new_tokens"], s["temperature"], s["top_k"], s["seed"],
                           s["top_p"], s["num_samples"], s.get("greedy", False),
                           self.messages(prompt) if self.chat else ())
        sent = self.send_request(request)  # True, or False (the run has ended), or why it was not sent
        if sent is not True:
            self.note(sent if isinstance(sent, str) else
                      "nothing is listening: the run has ended (open it from the launch screen to chat)", "red")
            return
        self.history[request_id] = Exchange(prompt)
        if self.chat:
            self.conversation.append(request_id)
        self.settings["seed"] += 1  # the same prompt again gives new text; a seed still reproduces one
        self.show_settings()
        self.show_history()

    def receive(self, ev: P.SampleText) -> None:
        ex = self.history.get(ev.request_id)
        if ex is None:  # periodic samples from the trainer: shown in the log, not here
            return
        ex.step = ev.step
        ex.rows[ev.row] = ex.rows.get(ev.row, "") + ev.text
        ex.done = ex.done or ev.done
        self.show_history()

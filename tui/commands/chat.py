"""`lmcockpit chat RUN_OR_CHECKPOINT`: a sampling REPL, or one-shot generation for scripts.

The model runs in a chat engine process (core/infer/chat_engine.py): this front-end imports no torch,
and refuses bad input (a missing checkpoint, nonsense settings) before any engine starts. Text
goes to stdout, everything else (the banner, errors, the engine's log lines) to stderr, so that
`lmcockpit chat RUN --greedy --prompt X` prints exactly the prompt and its greedy continuation.

A chat model (core/infer/chat_model.py: fine-tuned on conversations) is spoken to in its template:
each line is the user's turn, the reply alone is printed, ending where the model ends its turn, and
the conversation is kept for the next line (`reset` starts a new one, `system TEXT` sets the system
prompt). `--completion` continues text instead, as for a base model.
"""

from __future__ import annotations

import argparse
import difflib
import os
import signal
import sys
import threading
from typing import Any, Self, TextIO

from ...core import protocol as P
from ...core.config import ConfigError
from ...core.infer.chat_engine import ChatEngine
from ...core.infer.chat_model import is_chat_model
from ...core.protocol import SAMPLE_SETTINGS, parse_setting
from ...core.run.checkpoint_folder import find_checkpoint
from . import command_parser
from ..completers import run_folders
from ..usage import UsageError, error

HELP = """\
Type text to continue it with the current settings. Commands (also with a leading /, as in the
cockpit's chat: /set temperature 0.5):
  greedy TEXT        the most likely continuation of TEXT
  batch TEXT         `batch` samples of TEXT side by side (set batch N)
  settings           the current settings
  set KEY VALUE      change one: max_new_tokens, temperature, top_k (0: off), top_p (1: off),
                     num_samples, greedy (on/off), seed (the next request's; it counts up), batch
  help               this text
  quit               leave (so do Ctrl-D, Ctrl-C at the prompt and an empty stdin)
Ctrl-C while text is coming stops that generation; a second Ctrl-C leaves."""
CHAT_HELP = """\
A chat model: each line is your turn, and the model answers it; the conversation is kept.
  reset              start a new conversation (the system prompt stays)
  system TEXT        the system prompt, for the conversation from now on (`system` alone: none)"""
COMMANDS = ("greedy", "batch", "settings", "set", "reset", "system", "help", "quit", "exit")

FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
         "top_p": "--top-p", "num_samples": "--num-samples", "seed": "--seed"}
DEFAULT_BATCH = 4


def build_parser() -> argparse.ArgumentParser:
    p = command_parser(__name__, description="Sample from a trained model: an interactive prompt, "
                        "or with --prompt one generation printed for scripts (prompt and continuation, one block "
                        "per sample).")
    p.add_argument("path", metavar="RUN_OR_CHECKPOINT", help="a run folder (its latest checkpoint) or a checkpoint folder"
                   ).completer = run_folders
    p.add_argument("--prompt", help="generate once from this text, print it and exit")
    p.add_argument("--max-new-tokens", metavar="N", help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", metavar="T", help="sampling temperature, 0 means greedy (default 0.8)")
    p.add_argument("--top-k", metavar="K", help="sample among the K most likely tokens, 0: all (default 50)")
    p.add_argument("--top-p", metavar="P", help="nucleus sampling: the smallest set holding P, 1: off (default 1)")
    p.add_argument("--greedy", action="store_true", help="always the most likely token")
    p.add_argument("--num-samples", metavar="N", help="samples drawn side by side, 1 to 64 (default 1)")
    p.add_argument("--seed", metavar="S", help="seed of the sampling generator (default 0)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--system", metavar="TEXT", default="", help="a chat model's system prompt")
    p.add_argument("--completion", action="store_true", help="continue text even on a chat model, as on a base model")
    return p


def settings_from(args: argparse.Namespace) -> dict[str, Any]:
    defaults = P.Sample("", "")
    settings = {key: getattr(defaults, key) for key in SAMPLE_SETTINGS}
    settings["greedy"] = args.greedy
    for key, flag in FLAGS.items():
        text = getattr(args, key)
        if text is not None:
            try:
                settings[key] = parse_setting(key, text)
            except ConfigError as e:
                raise UsageError(f"{flag}: {e}") from None
    dev = args.device
    if not (dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())):
        raise UsageError(f"--device {dev!r}: expected auto, cpu, cuda or cuda:N")
    return settings


class EngineGone(Exception):
    pass


class Interrupts:
    """Ctrl-C counted instead of raised while a generation streams (so the engine's event queue is
    never read half-way through a message), in the main thread; the second one raises
    KeyboardInterrupt, or the first with `first_raises`."""

    def __init__(self, first_raises: bool = False):
        self.first_raises, self.count, self.previous = first_raises, 0, None

    def _on_sigint(self, signum, frame) -> None:
        self.count += 1
        if self.first_raises or self.count > 1:
            raise KeyboardInterrupt

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


class Session:
    """Requests to the chat engine and their text on stdout."""

    def __init__(self, engine: ChatEngine, settings: dict[str, Any], out: TextIO = sys.stdout, chat: bool = False,
                 system: str = ""):
        self.engine, self.settings, self.out = engine, settings, out
        self.batch = DEFAULT_BATCH
        self.requests = 0
        self.chat, self.system = chat, system  # chat: the model speaks the template
        self.turns: list[tuple[str, str]] = []  # the conversation so far: (role, text), the user's first

    def messages(self, text: str) -> tuple[tuple[str, str], ...]:
        """A chat turn's request: the system prompt, the conversation so far, then `text`."""
        return ((("system", self.system),) if self.system else ()) + (*self.turns, ("user", text))

    def wait_ready(self) -> P.RunStarted:
        while self.engine.loaded is None:
            self._next_event()
        return self.engine.loaded

    def generate(self, prompt: str, cancel_on_interrupt: bool = False, **overrides: Any) -> None:
        """Print prompt + continuation: streamed for one sample, numbered blocks for several. With
        `cancel_on_interrupt` (the REPL), Ctrl-C stops this generation and keeps what came so far,
        and a second Ctrl-C raises KeyboardInterrupt; otherwise the first one does."""
        self.requests += 1
        messages = self.messages(prompt) if self.chat else ()
        request = P.Sample(f"chat-{self.requests}", prompt, **{**self.settings, **overrides}, messages=messages)
        shown = "" if self.chat else prompt  # a chat model's reply is printed alone
        rows = [""] * request.num_samples
        streaming = request.num_samples == 1
        if streaming:
            self.out.write(shown)
            self.out.flush()
        self.engine.send(request)
        with Interrupts(first_raises=not cancel_on_interrupt) as interrupts:
            cancelled = False
            while True:
                if interrupts.count and not cancelled:
                    self.engine.cancel(request.request_id)  # its done marker follows within a token
                    cancelled = True
                ev = self._poll(timeout=0.1)
                if not isinstance(ev, P.SampleText) or ev.request_id != request.request_id:
                    continue
                if ev.done:
                    break
                rows[ev.row] += ev.text
                if streaming:
                    self.out.write(ev.text)
                    self.out.flush()
        if streaming:
            self.out.write("\n")
        else:
            for i, text in enumerate(rows, 1):
                self.out.write(f"--- sample {i} of {len(rows)} ---\n{shown}{text}\n")
        self.out.flush()
        if self.chat and streaming:  # a reply drawn among several is no turn of the conversation
            self.turns += [("user", prompt), ("assistant", rows[0])]
        if cancelled:
            print("(stopped by Ctrl-C; Ctrl-C at the prompt, or Ctrl-D, leaves)", file=sys.stderr)

    def _next_event(self) -> object:
        while (ev := self._poll(timeout=0.5)) is None:
            pass
        return ev

    def _poll(self, timeout: float) -> object | None:
        """The next event other than a log line (those go to stderr), or None after `timeout`."""
        ev = self.engine.poll(timeout=timeout)
        if isinstance(ev, P.LogLine):
            print(ev.text, file=sys.stderr)
            return None
        if ev is None and self.engine.done:
            raise EngineGone()
        return ev

    # --------------------------------------------------------------------------------- REPL
    def repl(self, stdin: TextIO) -> None:
        interactive = stdin.isatty()
        if interactive:
            import readline  # noqa: F401 - line editing and history for input()
        while True:
            try:
                line = input("> ") if interactive else stdin.readline()
            except EOFError:  # Ctrl-D
                if interactive:
                    print(file=self.out)  # the shell's prompt goes on a line of its own
                return
            except KeyboardInterrupt:
                if interactive:
                    print(file=self.out)
                raise
            if not line:  # end of a piped stdin
                return
            line = line.rstrip("\r\n")
            slash = line.startswith("/")  # the cockpit's form: /set temperature 0.5, /greedy TEXT
            if slash:
                line = line[1:]
            word, _, rest = line.partition(" ")
            command = line.strip()
            if not command and not slash:
                continue
            if command in ("quit", "exit"):
                return
            if command == "help":
                print(HELP + ("\n" + CHAT_HELP if self.chat else ""), file=self.out)
            elif word in ("reset", "system") and (self.chat or slash):  # on a base model, words to continue
                self.converse(word, rest)
            elif command == "settings":
                self.show_settings()
            elif word == "set":
                self.set(rest)
            elif word in ("greedy", "batch") and not rest.strip():
                error(f"{'/' if slash else ''}{word}: expected the text to continue after it ({word} TEXT)")
            elif word == "greedy":
                self.generate(rest, cancel_on_interrupt=True, greedy=True, num_samples=1)
                self.requests_done()
            elif word == "batch":
                self.generate(rest, cancel_on_interrupt=True, num_samples=self.batch)
                self.requests_done()
            elif slash:
                error(f"/{word}: not a command; the commands are {', '.join(COMMANDS)} (with or without "
                      "the /), and a line without / is a prompt")
            else:
                self.generate(line, cancel_on_interrupt=True)
                self.requests_done()

    def converse(self, word: str, rest: str) -> None:
        """`reset` and `system TEXT`, a chat model's commands."""
        if not self.chat:
            error(f"{word}: only for a chat model (a run fine-tuned on conversations); this one continues text")
        elif word == "reset":
            self.turns = []
            print("(a new conversation)", file=sys.stderr)
        else:
            self.system = rest.strip()
            print(f"(system prompt: {self.system!r})" if self.system else "(no system prompt)", file=sys.stderr)

    def requests_done(self) -> None:
        """A REPL draws new text each time: the next request takes the next seed."""
        self.settings["seed"] += 1

    def show_settings(self) -> None:
        for key, value in {**self.settings, "batch": self.batch}.items():
            shown = ("on" if value else "off") if isinstance(value, bool) else value
            print(f"{key} = {shown}", file=self.out)

    def set(self, rest: str) -> None:
        key, _, value = rest.strip().partition(" ")
        value = value.strip()
        known = [*SAMPLE_SETTINGS, "batch"]
        if key not in known:
            match = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {match[0]}?)" if match else f" (settings: {', '.join(known)})"
            error(f"set {key}: unknown setting{hint}")
            return
        try:
            parsed = parse_setting("num_samples" if key == "batch" else key, value)
        except ConfigError as e:
            error(f"set {key}: {e}")
            return
        if key == "batch":
            self.batch = parsed
        else:
            self.settings[key] = parsed


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    settings = settings_from(args)
    checkpoint = find_checkpoint(args.path)
    chat = is_chat_model(checkpoint) and not args.completion
    if args.system and not chat:
        raise UsageError(f"--system: only for a chat model (a run fine-tuned on conversations); {args.path} "
                         + ("is spoken to as a base model (--completion)" if args.completion else "continues text"))
    engine = ChatEngine(checkpoint, args.device)
    engine.start()
    session = Session(engine, settings, chat=chat, system=args.system)
    try:
        loaded = session.wait_ready()
        if args.prompt is not None:
            session.generate(args.prompt)
        else:
            kind = "a chat model: your turn, then its reply" if chat else "text continued"
            print(f"chat: step {loaded.start_step} of {checkpoint} ({loaded.n_params:,} parameters, {loaded.device}, "
                  f"{loaded.precision}; {kind}); type `help` for commands", file=sys.stderr)
            session.repl(sys.stdin)
        return 0
    except EngineGone:
        failure = engine.failure or P.Failure("the chat engine stopped")
        if failure.user_error:
            return error(failure.message)
        if failure.traceback:
            print(failure.traceback, end="", file=sys.stderr)
        error(failure.message)
        return 1
    except KeyboardInterrupt:
        engine.kill()  # a chat engine holds nothing to save: no waiting on a generation or a load
        return 130
    except BrokenPipeError:
        # The reader is gone (`| head -c 20`): what is left to generate has nowhere to go. Stopped
        # as an interrupt is; stdout goes to /dev/null so that the interpreter's last flush of
        # what was buffered for the gone reader does not fail in turn.
        engine.kill()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 130
    finally:
        engine.close()

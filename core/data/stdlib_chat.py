"""The built-in conversation set `python-stdlib-chat`: requests for the standard library's functions, answered with them.

Offline, from this interpreter's standard library like `python-stdlib`: each function with a
docstring gives the conversation

    user:      Write a function `name(args)` that <its docstring's first sentence>.
    assistant: <the function's source, dedented>

split as the `python-stdlib` token cache and the `python-functions` task split it: by file, a file
on the validation side of split.Selection(1.0, data.val_fraction) by its path under the stdlib. The
training side's functions are the set (`conversations`); the validation side's are held out
(`held_out`), for a chat-form task and the run's validation loss, and a training function whose
source is also a held-out one's (a copy in two files) is left out. So a model fine-tuned on the set
has seen neither its evaluation's answers nor, in pretraining on `python-stdlib`, their files.
Torch, numpy: never.
"""

from __future__ import annotations

import ast
import functools
import re

from ..config import DataConfig
from . import sources, split
from .python_source import documented_functions

NAME = "python-stdlib-chat"
VERSION = 1  # of the requests' wording and selection: in the cache key, so a change makes a new cache
MAX_SOURCE_CHARS = 900  # a function's source: about 250 tokens of the cpu preset's BPE, its whole context
MIN_SENTENCE, MAX_SENTENCE = 12, 200  # characters of the docstring's first sentence
TESTS = {"test", "tests", "idle_test"}  # folders of test suites: left out
SENTENCE_END = re.compile(r"(?<=[.!?])\s")
# A docstring's opening verb as a command ("Return the ..."): said of the function ("that returns").
VERBS = {"accept", "add", "append", "apply", "build", "calculate", "call", "cancel", "change", "check", "clear",
         "close", "compare", "compute", "connect", "construct", "convert", "copy", "count", "create", "decode",
         "define", "deserialize", "delete", "detect", "determine", "disable", "dispatch", "emit", "enable", "encode", "ensure",
         "escape", "evaluate", "execute", "extract", "fetch", "filter", "find", "flush", "format", "generate",
         "get", "handle", "initialize", "insert", "iterate", "join", "list", "load", "look", "make", "mark",
         "match", "merge", "move", "normalize", "open", "parse", "pause", "pop", "prepare", "print", "process",
         "push", "put", "read", "receive", "register", "reload", "remove", "render", "replace", "report",
         "request", "reset", "resolve", "restore", "resume", "retrieve", "return", "reverse", "run", "save",
         "search", "select", "send", "serialize", "set", "show", "skip", "sort", "split", "start", "stop", "store", "strip",
         "submit", "terminate", "test", "translate", "truncate", "try", "turn", "update", "use", "validate",
         "verify", "wait", "walk", "warn", "wrap", "write", "yield"}


def listing() -> sources.Source:
    """The stdlib's files as the `python-stdlib` source lists them (what the cache key covers)."""
    stdlib = sources.list_source(DataConfig(source=sources.STDLIB))
    return sources.Source(f"{NAME}:{stdlib.desc}:v{VERSION}", stdlib.files, False)


def conversations(val_fraction: float) -> list[list[dict]]:
    """The set: a conversation for each function of the training side's files."""
    return sides(val_fraction)[0]


def held_out(val_fraction: float) -> list[list[dict]]:
    """The validation side's functions, as the same conversations: never in the set."""
    return sides(val_fraction)[1]


@functools.lru_cache(maxsize=4)
def sides(val_fraction: float, only: tuple[str, ...] = ()) -> tuple[list[list[dict]], list[list[dict]]]:
    """(the set, the held-out conversations); `only`: of these files alone (paths under the stdlib),
    as a test reads a few. Test suites' files are left out of both: their functions test, they
    are no request's answer (and they are half the stdlib's files, and of the time to parse it)."""
    root = sources.stdlib_root()
    selection = split.Selection(1.0, val_fraction)
    found: tuple[list, list] = ([], [])
    for path in sorted(sources.stdlib_files(root)):
        rel = str(path.relative_to(root))
        if (only and rel not in only) or TESTS & set(path.relative_to(root).parts[:-1]):
            continue
        found[selection.is_val(rel)].extend(requests(path.read_bytes().decode("utf-8", errors="replace")))
    held = {answer for _, answer in found[1]}
    train = [pair for pair in _unique(found[0]) if pair[1] not in held]
    return [_messages(*pair) for pair in train], [_messages(*pair) for pair in _unique(found[1])]


def _unique(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The first of each answer: a function twice (copies, overloads) is one conversation."""
    seen, out = set(), []
    for request, answer in pairs:
        if answer not in seen:
            seen.add(answer)
            out.append((request, answer))
    return out


def _messages(request: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": request}, {"role": "assistant", "content": answer}]


def requests(text: str) -> list[tuple[str, str]]:
    """(request, source) of each function in `text` with a docstring whose first sentence reads as
    a request, its source at most MAX_SOURCE_CHARS; dunder methods left out."""
    out = []
    for f in documented_functions(text):
        if f.node.name.startswith("__"):
            continue
        sentence = first_sentence(f.docstring)
        if sentence is None or len(f.source) > MAX_SOURCE_CHARS:
            continue
        out.append((f"Write a function `{f.node.name}({ast.unparse(f.node.args)})` that {sentence}", f.source.rstrip() + "\n"))
    return out


def first_sentence(docstring: str) -> str | None:
    """The docstring's first sentence, to follow "that": its opening verb said of the function, a
    capital that only opens the sentence lowered, one full stop at its end. None for none, or one
    too short or too long to be a request."""
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    sentence = SENTENCE_END.split(paragraph, maxsplit=1)[0].rstrip(".!?:; ")
    word, _, rest = sentence.partition(" ")
    if not MIN_SENTENCE <= len(sentence) <= MAX_SENTENCE or not word.isalpha():  # not "od.copy() -> ..."
        return None
    if word[1:].islower() or len(word) == 1:
        word = word.lower()
    if word in VERBS:
        word = word[:-1] + "ies" if word.endswith("y") and word[-2] not in "aeiou" else \
            word + ("es" if word.endswith(("s", "sh", "ch", "x", "z")) else "s")
    return f"{word} {rest}".rstrip() + "."

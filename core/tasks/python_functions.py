"""The built-in task `python-functions`: pick a held-out function's real body among four.

Made from the run's validation documents only (the `python-stdlib` source's held-out files, by
the same split the token cache uses), so the model has never trained on an item. Each item is a
function with a docstring: its `def` line and docstring are the context, its body one of four
choices; the other three are the bodies of other held-out functions nearest it in length.

Scored by how much the `def` line and docstring lower each body's summed loss below its loss after
a neutral `def` line (the item's `neutral` context), not by the lowest mean loss: a short, common
body is likely after any `def`, and its own typicality must not decide.
Torch: never.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from ..config import Config, ConfigError
from ..data import sources, split
from ..data.python_source import documented_functions
from .items import FEWSHOT_SEED, MULTIPLE_CHOICE, Item, Task

NAME = "python-functions"
CHOICES = 4
NEUTRAL = "def f():\n"
MAX_HEADER_CHARS = 600  # the def line and docstring: long ones would crowd the body out of a small context
MAX_BODY_CHARS = 500


def check(cfg: Config) -> None:
    """Whether the task can be made for this run, without making it."""
    if cfg.data.source != sources.STDLIB or cfg.data.sources:
        raise ConfigError(f"eval.tasks: {NAME} is made from the held-out files of data.source = "
                          f"{sources.STDLIB!r}; this run reads {cfg.data.source!r}: take it out of "
                          "eval.tasks (--set 'eval.tasks=[]' scores no task)")


def task(cfg: Config) -> Task:
    """The task from the validation files of `cfg`'s source."""
    check(cfg)
    return from_documents(validation_documents(cfg))


def validation_documents(cfg: Config) -> Iterable[tuple[str, str]]:
    """(id, text) of each file on the validation side of the split the token cache makes. Those
    data.max_bytes leaves out as well are taken too: they are no training document either."""
    root = sources.stdlib_root()
    selection = split.Selection(1.0, cfg.data.val_fraction)
    for path in sorted(sources.stdlib_files(root)):
        doc_id = str(path.relative_to(root))
        if selection.is_val(doc_id):
            yield doc_id, path.read_bytes().decode("utf-8", errors="replace")


def functions(text: str) -> list[tuple[str, str]]:
    """(def line and docstring, body) of each function in `text` that has a docstring and a body,
    dedented to its `def`."""
    out = []
    for f in documented_functions(text):
        if len(f.node.body) < 2:
            continue
        cut = f.node.body[0].end_lineno - f.node.lineno + 1  # the def line(s) and the docstring
        split_at = sum(len(line) for line in f.source.splitlines(keepends=True)[:cut])
        header, body = f.source[:split_at], f.source[split_at:]
        if not body.strip() or len(header) > MAX_HEADER_CHARS or len(body) > MAX_BODY_CHARS:
            continue
        out.append((header, body if body.endswith("\n") else body + "\n"))
    return out


def from_documents(documents: Iterable[tuple[str, str]]) -> Task:
    found = [f for _, text in documents for f in functions(text)]
    seen, unique = set(), []
    for header, body in found:  # a body twice (overloads, copies) would make two right answers
        if body not in seen:
            seen.add(body)
            unique.append((header, body))
    return Task(NAME, MULTIPLE_CHOICE, tuple(_item(unique, i) for i in range(len(unique))) if len(unique) > CHOICES
                else ())


def _item(found: list[tuple[str, str]], index: int) -> Item:
    header, body = found[index]
    nearest = sorted((abs(len(b) - len(body)), j) for j, (_, b) in enumerate(found) if j != index)
    choices = [found[j][1] for _, j in nearest[:CHOICES - 1]]
    gold = random.Random(FEWSHOT_SEED + index).randrange(CHOICES)
    choices.insert(gold, body)
    return Item((header,), tuple(choices), gold, NEUTRAL)

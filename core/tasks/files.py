"""A task from a local JSON-lines file: one item a line, its kind read from its fields.

* multiple choice: `{"context": TEXT, "choices": [TEXT, ...], "gold": INDEX}`, with an optional
  `"neutral": TEXT` (each choice then scored by how much the context lowers its summed loss below
  its loss after the neutral text);
* schema: `{"contexts": [TEXT, ...], "continuation": TEXT, "gold": INDEX}`;
* language modelling: `{"context": TEXT, "continuation": TEXT}`.

A continuation's tokens are those `context + continuation` adds to `context`'s: put the space
between them where the text has one. A first line with none of these fields sets the task's
`fewshot` (examples shown before each item; 0 unless it says so), `delimiter` (put between
context and continuation) and `chance` (the accuracy of a guess; else 1 / choices).
Torch: never.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ..config import SHOWN_CHARS, ConfigError, shown
from . import reading
from .items import KINDS, LANGUAGE_MODELING, MULTIPLE_CHOICE, SCHEMA, Item, Task

FIELDS = {MULTIPLE_CHOICE: {"context", "choices", "gold"}, SCHEMA: {"contexts", "continuation", "gold"},
          LANGUAGE_MODELING: {"context", "continuation"}}
OPTIONAL_FIELDS = {MULTIPLE_CHOICE: {"neutral"}, SCHEMA: set(), LANGUAGE_MODELING: set()}
HEADER = {"fewshot": int, "delimiter": str, "chance": (int, float)}
ITEM_FIELDS = set().union(*FIELDS.values(), *OPTIONAL_FIELDS.values())


def read_task(path: Path, name: str | None = None) -> Task:
    """The task in `path`; a ConfigError naming the file, the line and what was expected."""
    header: dict = {}
    kind, items = None, []
    for where, row in json_rows(path, "no such task file"):
        if not items and kind is None and not header and not row.keys() & ITEM_FIELDS:
            header = _header(row, where)
            continue
        row_kind = kind_of(row, where)
        if kind is not None and row_kind != kind:
            raise ConfigError(f"{where}: a {row_kind.replace('_', ' ')} item in a file of {kind.replace('_', ' ')} "
                              "items: one kind per file")
        kind = row_kind
        items.append(item_from_row(row, kind, where))
    if not items:
        raise ConfigError(f"eval.tasks: {path}: holds no items (one JSON object a line: see `lmcockpit eval --help`)")
    return Task(name or path.stem, kind, tuple(items), **header)


def json_rows(path: Path, missing: str) -> Iterator[tuple[str, dict]]:
    """(`file:line`, object) for each line of a JSON-lines file that is not blank; a ConfigError
    naming the file (`missing` when there is none) or the line."""
    try:
        lines = reading.read_lines(path)
        for number, line in lines:
            if line.strip():
                where = f"{path}:{number}"
                yield where, _row(line, where)
    except FileNotFoundError:
        raise ConfigError(f"eval.tasks: {path}: {missing}") from None
    except ConfigError as e:
        raise ConfigError(f"eval.tasks: {e}" if str(e).startswith(f"{path}: ") else str(e)) from None
    except OSError as e:
        raise ConfigError(f"eval.tasks: {path}: cannot be read ({e.strerror})") from None


def as_json(value) -> str:
    """A value of the file as JSON spells it (true, null, "text"), not as Python does (True, None,
    'text'): the message quotes the file. Abbreviated past SHOWN_CHARS, as shown() abbreviates."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (ValueError, RecursionError):  # json.loads gave it, so never expected; the message still goes out
        return shown(value)
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS // 2]}…{text[-SHOWN_CHARS // 4:]} ({len(text):,} characters)"


def _row(line: str, where: str) -> dict:
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ConfigError(f"{where}: not a JSON object ({getattr(e, 'msg', e)})") from None
    except ValueError:  # int()'s limit on digits, which json.loads lets out as a plain ValueError
        raise ConfigError(f"{where}: an integer of more than {reading.digits_limit():,} digits: expected a small "
                          "count (gold, fewshot)") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: not a JSON object")
    return row


def _header(row: dict, where: str) -> dict:
    for key, value in row.items():
        if key not in HEADER:
            raise ConfigError(f"{where}: {key!r} is neither an item's field nor a task setting "
                              f"(a multiple choice item has {sorted(FIELDS[MULTIPLE_CHOICE])}; "
                              f"settings: {sorted(HEADER)})")
        if not isinstance(value, HEADER[key]) or isinstance(value, bool):
            raise ConfigError(f"{where}: {key} = {as_json(value)}: expected {'a whole number' if key == 'fewshot' else 'text' if key == 'delimiter' else 'a number'}")
    if row.get("fewshot", 0) < 0 or not 0 <= row.get("chance", 0) < 1:
        raise ConfigError(f"{where}: fewshot must be 0 or more and chance between 0 and 1")
    return row


def kind_of(row: dict, where: str) -> str:
    for kind in KINDS:
        if FIELDS[kind] <= row.keys() and not row.keys() - FIELDS[kind] - OPTIONAL_FIELDS[kind]:
            return kind
    raise ConfigError(f"{where}: fields {sorted(row)} match no kind of item: multiple choice has "
                      f"{sorted(FIELDS[MULTIPLE_CHOICE])}, schema {sorted(FIELDS[SCHEMA])}, language modelling "
                      f"{sorted(FIELDS[LANGUAGE_MODELING])}")


def item_from_row(row: dict, kind: str, where: str) -> Item:
    def text(key: str, value) -> str:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: {key} = {as_json(value)}: expected non-empty text")
        return value

    def texts(key: str) -> tuple[str, ...]:
        value = row[key]
        if not isinstance(value, list) or len(value) < 2:
            raise ConfigError(f"{where}: {key}: expected a list of two or more texts")
        return tuple(text(f"{key}[{i}]", v) for i, v in enumerate(value))

    if kind == MULTIPLE_CHOICE:
        contexts, continuations = (text("context", row["context"]),), texts("choices")
        options = len(continuations)
    elif kind == SCHEMA:
        contexts, continuations = texts("contexts"), (text("continuation", row["continuation"]),)
        options = len(contexts)
    else:
        contexts, continuations = (text("context", row["context"]),), (text("continuation", row["continuation"]),)
        options = 1
    gold = row.get("gold", 0)
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < options:
        raise ConfigError(f"{where}: gold = {as_json(gold)}: expected the index of the right one, 0 to {options - 1}")
    neutral = text("neutral", row["neutral"]) if "neutral" in row else ""
    return Item(contexts, continuations, gold, neutral)

"""metrics.jsonl's rows: each one protocol event with a `kind`, written and read through here alone.

A row is `{"kind": K, "time": T, <the event's fields in order>}` on one line. What a row must hold
is read off the event's dataclass (protocol.py): its fields, their types, their choices. Nothing
else in the project spells a row's fields: a field added to an event is written, checked and read
back with no other change. No torch.
"""

from __future__ import annotations

import dataclasses
import json
import time
import types
import typing
from typing import Any, Callable, NamedTuple

import orjson  # 3× json's speed reading a row, and a long run's first reading folds a million

from .. import protocol as P

INT_LIMIT = 2**63  # past what a row of ours holds: a number that big is someone else's, or damage

ROW_EVENTS = (P.StepMetrics, P.EvalMetrics, P.CheckpointWritten, P.SpikeSeen, P.RolledBack, P.TargetReached,
              P.Sampled, P.Ended, P.Failed, P.Note)
KINDS: dict[str, type] = {cls.kind: cls for cls in ROW_EVENTS}


def is_count(value: object) -> bool:
    return type(value) is int and 0 <= value < INT_LIMIT


def is_number(value: object) -> bool:
    """A float, or an integer that one holds (bool is neither)."""
    return type(value) is float or type(value) is int and -INT_LIMIT < value < INT_LIMIT


def _is_text(value: object) -> bool:
    return type(value) is str


def _is_flag(value: object) -> bool:
    return type(value) is bool


SIMPLE = {int: is_count, float: is_number, str: _is_text, bool: _is_flag}


def check_of(hint: Any, choices: tuple[str, ...] | None = None) -> Callable[[object], bool]:
    """What a value of type `hint` must be to be written by us: int a count, float a number, a
    str one of `choices` where given, a dict by its keys' and values' types, a TypedDict by each
    of its keys; `X | None` also None."""
    if choices is not None:
        return lambda v: type(v) is str and v in choices
    if hint in SIMPLE:
        return SIMPLE[hint]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [check_of(a) for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"no row check for {hint}")
        one = inner[0]
        return lambda v: v is None or one(v)
    if origin is dict and args[0] is str:
        each = check_of(args[1])
        return lambda v: type(v) is dict and all(type(k) is str for k in v) and all(map(each, v.values()))
    if typing.is_typeddict(hint):
        keys = [(k, check_of(h)) for k, h in typing.get_type_hints(hint).items()]
        return lambda v: type(v) is dict and all(k in v and fits(v[k]) for k, fits in keys)
    raise TypeError(f"no row check for {hint}")


class Field(NamedTuple):
    name: str
    fits: Callable[[object], bool]
    may_lack: bool  # a row without it is read with the field's default, or None
    has_default: bool


def _row_fields(cls: type) -> tuple[Field, ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.metadata.get("row", True):
            continue
        hint = hints[f.name]
        nullable = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        out.append(Field(f.name, check_of(hint, f.metadata.get("choices")), nullable or has_default, has_default))
    return tuple(out)


FIELDS: dict[str, tuple[Field, ...]] = {kind: _row_fields(cls) for kind, cls in KINDS.items()}


# --------------------------------------------------------------------------------- writing
def row_of(event: Any, at: float | None = None) -> dict[str, Any]:
    """The row of `event`, dated `at` (now)."""
    row = {"kind": event.kind, "time": round(time.time() if at is None else at, 3)}
    row.update((f.name, getattr(event, f.name)) for f in FIELDS[event.kind])
    return row


def line_of(event: Any, at: float | None = None) -> bytes:
    return (json.dumps(row_of(event, at)) + "\n").encode()


# --------------------------------------------------------------------------------- reading
def loads(line: bytes | str) -> Any:
    """A line's JSON, or None where it is none (cut short by a kill, not ours). orjson refuses
    NaN and Infinity, which json writes for a gradient that overflowed: json reads those."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        try:
            return json.loads(line)
        except (ValueError, RecursionError):  # an integer past int()'s digits, nested thousands deep
            return None


_ABSENT = object()


def well_formed(row: object) -> bool:
    """Whether `row` holds every field its kind's event has, each of its type (fields beyond
    those are let be: a newer lmcockpit's). A row of a kind no event has needs only a step, if
    it has one, that is a step."""
    if type(row) is not dict:
        return False
    kind = row.get("kind")
    if type(kind) is not str:
        return False
    fields = FIELDS.get(kind)
    if fields is None:
        return "step" not in row or is_count(row["step"])
    for name, fits, may_lack, _ in fields:  # a million rows on an older run's first reading: lean
        value = row.get(name, _ABSENT)
        if value is _ABSENT:
            if not may_lack:
                return False
        elif not fits(value):
            return False
    needs = getattr(KINDS[kind], "needs_one_of", ())
    return not needs or any(row.get(name) is not None for name in needs)


def event_of(row: object) -> Any:
    """The event a well-formed row holds, else None; a field it lacks is None or its default."""
    if not well_formed(row) or row["kind"] not in KINDS:
        return None
    kind = row["kind"]
    return KINDS[kind](**{f.name: row.get(f.name) for f in FIELDS[kind] if f.name in row or not f.has_default})


def read(line: bytes | str) -> dict[str, Any] | None:
    """A line of metrics.jsonl as a well-formed row, else None."""
    row = loads(line)
    return row if well_formed(row) else None

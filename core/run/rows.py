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
              P.Sampled, P.Ended, P.Failed, P.Note, P.Profiled, P.LayerStats)
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
    str one of `choices` where given, a list by its items', a dict by its keys' and values' types,
    a TypedDict by each of its keys; `X | None` also None."""
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

        def maybe(v: object) -> bool:
            return v is None or one(v)
        maybe.or_none = one  # for _compiled, which writes it out
        return maybe
    if origin is list:
        item = check_of(args[0])
        return lambda v: type(v) is list and all(item(x) for x in v)
    if origin is dict and args[0] is str:
        each = check_of(args[1])
        return lambda v: type(v) is dict and all(type(k) is str and each(x) for k, x in v.items())
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

# The tests of SIMPLE's checks written out, for _compiled: no call per field.
_INLINE = {is_count: "type(v) is int and 0 <= v < LIMIT",
           is_number: "type(v) is float or type(v) is int and -LIMIT < v < LIMIT",
           _is_text: "type(v) is str", _is_flag: "type(v) is bool"}
_ABSENT = object()


def _compiled(kind: str) -> Callable[[dict], bool]:
    """well_formed for rows of `kind`, written out from FIELDS as one function: an older run's first
    reading checks a million rows, and a loop calling a check per field takes twice as long."""
    env: dict[str, Any] = {"ABSENT": _ABSENT, "LIMIT": INT_LIMIT}
    body = []
    for i, f in enumerate(FIELDS[kind]):
        inner = getattr(f.fits, "or_none", None)
        if f.fits in _INLINE:
            test = _INLINE[f.fits]
        elif inner in _INLINE:
            test = f"v is None or {_INLINE[inner]}"
        else:
            env[f"fits{i}"] = f.fits
            test = f"fits{i}(v)"
        body += [f"    v = row.get({f.name!r}, ABSENT)",
                 "    if v is ABSENT:" if f.may_lack else "    if v is ABSENT: return False",
                 *(["        pass"] if f.may_lack else []),
                 f"    elif not ({test}): return False"]
    needs = getattr(KINDS[kind], "needs_one_of", ())
    body.append(f"    return {' or '.join(f'row.get({n!r}) is not None' for n in needs) or 'True'}")
    exec("def check(row):\n" + "\n".join(body), env)  # our own schema's text: no input reaches it
    return env["check"]


CHECKS: dict[str, Callable[[dict], bool]] = {kind: _compiled(kind) for kind in KINDS}


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


def well_formed(row: object) -> bool:
    """Whether `row` holds every field its kind's event has, each of its type (fields beyond
    those are let be: a newer lmcockpit's). A row of a kind no event has needs only a step, if
    it has one, that is a step."""
    if type(row) is not dict:
        return False
    kind = row.get("kind")
    if type(kind) is not str:
        return False
    check = CHECKS.get(kind)
    if check is None:
        return "step" not in row or is_count(row["step"])
    return check(row)


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

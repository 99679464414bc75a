"""What a config key may hold, said once, beside its field.

A section's field is declared with `setting`:

    max_steps: int = setting(400, "optimizer steps in the run", gt=0, on_resume="safe")

Its type is the annotation (a `Literal[...]` for a choice); `setting` adds a one-line help, its
bounds (gt/ge/lt/le, pydantic's names), a check of its own for a form no type says (a URL, a device
name), and whether `--resume --set` may change it. config.py validates each key from these,
resume.py takes the keys that may change from them, `--set`'s completion and
`lmcockpit help config` list them: a rule written here is the only copy of it.

Torch-free and independent of config.py, which imports it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

RULES = "lmcockpit"  # the metadata entry of a field declared by `setting`

# A key that may change on resume changes the steps to come, never the run the checkpoint belongs
# to (its model, data, or the sequences a step takes).
OnResume = Literal["safe", "fixed"]


@dataclass(frozen=True)
class Key:
    """One key's rules (beside its type, which is the field's annotation)."""
    help: str
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    unit: str = ""  # what a bound counts, said after it in a message: "(steps)"
    # A form no type says: the rest of the message about a value that does not have it
    # ("must be an http(s) URL or env:NAME"), or None for a value that does.
    check: Callable[[Any], str | None] | None = None
    each: bool = False  # `check` applies to each item of a list, named key[i]
    on_resume: OnResume = "fixed"

    def expected(self, hint: Any) -> str:
        """What a value out of bounds is told it must be: "a positive integer", "in [0, 1)"."""
        low, high = self.gt if self.gt is not None else self.ge, self.lt if self.lt is not None else self.le
        unit = f" ({self.unit})" if self.unit else ""
        if low is not None and high is not None:
            return f"in {'(' if self.gt is not None else '['}{low:g}, {high:g}{')' if self.lt is not None else ']'}"
        if self.gt == 0:
            return ("a positive integer" if hint is int else "positive") + unit
        if low is not None:
            return f"above {low:g}{unit}" if self.gt is not None else f"{low:g} or more{unit}"
        if high is not None:
            return f"{'below' if self.lt is not None else 'at most'} {high:g}{unit}"
        return ""

    def bounds(self) -> str:
        """The bounds as `lmcockpit help config` shows them beside the type: "> 0", "in [0, 1)"."""
        low, high = self.gt if self.gt is not None else self.ge, self.lt if self.lt is not None else self.le
        if low is not None and high is not None:
            return f"in {'(' if self.gt is not None else '['}{low:g}, {high:g}{')' if self.lt is not None else ']'}"
        if low is not None:
            return f"{'>' if self.gt is not None else '>='} {low:g}"
        if high is not None:
            return f"{'<' if self.lt is not None else '<='} {high:g}"
        return ""

    def within(self, value: float) -> bool:
        return ((self.gt is None or value > self.gt) and (self.ge is None or value >= self.ge)
                and (self.lt is None or value < self.lt) and (self.le is None or value <= self.le))


def setting(default: Any, help: str, *, gt: float | None = None, ge: float | None = None, lt: float | None = None,
            le: float | None = None, unit: str = "", check: Callable[[Any], str | None] | None = None,
            each: bool = False, on_resume: OnResume = "fixed") -> Any:
    """A dataclass field holding `default` (a list or table is copied for each instance) and its rules."""
    rules = {RULES: Key(help, gt, ge, lt, le, unit, check, each, on_resume)}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=rules)
    return dataclasses.field(default=default, metadata=rules)


def rules_of(f: dataclasses.Field) -> Key:
    """A field's rules; a field declared without `setting` has none (tests/test_config.py refuses one)."""
    return f.metadata.get(RULES) or Key(help="")


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def table_of(hint: Any) -> type | None:
    """The dataclass of a list of tables (`list[SourcePart]`), else None."""
    if typing.get_origin(hint) is list and dataclasses.is_dataclass(args := typing.get_args(hint)[0]):
        return args
    return None


def problems(obj: Any, prefix: str) -> Iterator[tuple[str, str]]:
    """(key, message) for each value in the dataclass `obj` (a section, or a table of a list of
    them, whose keys are named `prefix`.name) that breaks its own key's rules: a float that is not
    finite (TOML reads inf and nan, and every bound lets one of them through), a bound, a check.
    The types were checked as the file was read."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        key, value, rules = f"{prefix}.{f.name}", getattr(obj, f.name), rules_of(f)
        if table_of(hints[f.name]):
            for i, item in enumerate(value):
                yield from problems(item, f"{key}[{i}]")
            continue
        if isinstance(value, float) and not math.isfinite(value):
            yield key, f"{key} = {value} must be a finite number"
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and not rules.within(value):
            yield key, f"{key} = {value} must be {rules.expected(hints[f.name])}"
        elif rules.check is not None:
            named = [(f"{key}[{i}]", item) for i, item in enumerate(value)] if rules.each else [(key, value)]
            for name, item in named:
                if (wrong := rules.check(item)) is not None:  # "must be ...", or ": expected ..."
                    yield key, f"{name} = {shown(item)}{'' if wrong.startswith(':') else ' '}{wrong}"


def type_name(hint: Any) -> str:
    """A key's type as `help config` and completion show it: int, list[str], "warn" | "skip"."""
    if typing.get_origin(hint) is Literal:
        return " | ".join(f'"{c}"' for c in typing.get_args(hint))
    if (table := table_of(hint)) is not None:
        return f"[[tables]] of {', '.join(f.name for f in dataclasses.fields(table))}"
    if typing.get_origin(hint) is not None:
        return str(hint).replace("typing.", "")
    return hint.__name__


SHOWN_CHARS = 60  # of a value in a message: a pasted file or 5,000 digits is abbreviated


def shown(value: Any) -> str:
    """`value` as a message quotes it (repr), abbreviated past SHOWN_CHARS with its length said,
    so that an error stays one line."""
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    size = f"{len(str(abs(value))):,} digits" if isinstance(value, int) else f"{len(str(value)):,} characters"
    return f"{text[:SHOWN_CHARS // 2]}…{text[-SHOWN_CHARS // 4:]} ({size})"

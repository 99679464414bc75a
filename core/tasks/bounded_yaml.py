"""YAML read with what a document may hold bounded: nesting, aliases' values, integers' digits.

A CORE bundle's core.yaml and a harness task's file: each bound is refused in one line that names
the file and the line, where yaml.safe_load would recurse until a RecursionError, hand what reads
the document a billion values, or let int()'s ValueError out.
Torch: never.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from ..config import ConfigError
from .reading import digits_limit, read_text

MAX_YAML_DEPTH = 100  # the composer recurses a level per nesting: 20,000 deep was a RecursionError
MAX_YAML_VALUES = 100_000  # values a YAML document holds, each alias counted as all it names


class Refused(Exception):
    """What BoundedLoader will not compose, with the line it met it on."""

    def __init__(self, message: str, mark) -> None:
        super().__init__(f"line {mark.line + 1}: {message}" if mark is not None else message)


class BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader with what a document may hold bounded as it is composed: its nesting, and
    the values its aliases stand for. An alias is one node shared, cheap to load, but what reads
    the document afterwards walks every use: nine aliases of nine aliases, nine levels down, are
    387 million values from a kilobyte (billion laughs). Each alias counts as every value the node
    it names holds, an alias inside the value it names (a cycle) is refused, and so is an integer
    Python will not read (more than sys.get_int_max_str_digits() digits)."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._depth = 0
        self._values = 0
        self._sizes: dict[int, int] = {}  # id(node) → the values it holds, once it is composed whole

    def _count(self, n: int, mark) -> None:
        self._values += n
        if self._values > MAX_YAML_VALUES:
            raise Refused(f"more than {MAX_YAML_VALUES:,} values, counting each alias as all the values it names "
                          "(aliases that multiply, as in billion laughs?): expected a task's settings", mark)

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            node = super().compose_node(parent, index)
            if id(node) not in self._sizes:
                raise Refused("an alias inside the value it names: a document that never ends", mark)
            self._count(self._sizes[id(node)], mark)
            return node
        mark = self.peek_event().start_mark
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            raise Refused(f"nested more than {MAX_YAML_DEPTH} levels deep: expected a few levels", mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = node.value if isinstance(node, yaml.SequenceNode) else []
        self._sizes[id(node)] = 1 + sum(self._sizes.get(id(child), 0) for child in children)
        self._count(1, mark)
        return node

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # int()'s limit on digits: the resolver has already matched an int's form
            raise Refused(f"an integer of more than {digits_limit():,} digits: expected a small count",
                          node.start_mark) from None


BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)


def load_yaml(path: Path, loader: type[BoundedLoader] = BoundedLoader, text: str | None = None):
    """The YAML document in `path` (or its `text`, already read), composed by `loader`; a
    ConfigError naming the file and the line. FileNotFoundError as open's."""
    text = read_text(path) if text is None else text
    try:
        return yaml.load(text, Loader=loader)  # a SafeLoader's subclass: constructs no objects
    except Refused as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
        where = f"line {mark.line + 1}: {problem}" if mark is not None and problem else str(e).splitlines()[0]
        raise ConfigError(f"{path}: not readable as YAML ({where})") from None

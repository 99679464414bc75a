"""A Python file's documented functions, each with its source: what the built-in set and task read.

`stdlib_chat` makes a request of each one's docstring and answers with its source;
`tasks.python_functions` cuts each one's source into its def line and docstring, and its body.
One walk, so both read the same functions of a file (in `ast.walk`'s order) the same way.
Torch, numpy: never.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Function:
    """A function (or method) with a docstring, as it stands in its file."""
    node: ast.FunctionDef | ast.AsyncFunctionDef
    docstring: str  # ast.get_docstring's: cleaned; "" for an empty one
    source: str  # its lines from `def` (decorators not included) to its end, dedented to the `def`


def documented_functions(text: str) -> list[Function]:
    """Each function in `text` that has a docstring; none of a file that does not parse (the
    stdlib holds a few written for other Pythons, or as templates)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        docstring = ast.get_docstring(node)
        if docstring is not None:
            out.append(Function(node, docstring, textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno]))))
    return out

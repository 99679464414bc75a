"""The shape of the code, read from the source with `ast` (nothing is executed).

No import cycles in core/ or tui/, a front-end that never pulls torch, transformers or numpy in at
import time, package docstrings that say whether their modules import torch and tell the truth,
package docstrings that name each of their modules, and module docstrings that open with a
one-line summary."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"lmcockpit": REPO / "lmcockpit", "lmcockpit.core": REPO / "core", "lmcockpit.tui": REPO / "tui"}
HEAVY = {"torch", "transformers", "numpy", "tensorboard", "wandb", "matplotlib"}  # seconds to import: never in the front-end's start


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    anywhere: set[str] = field(default_factory=set)  # every import, in functions too
    at_import: set[str] = field(default_factory=set)  # what runs when the module is imported


def _modules(roots: dict[str, Path]) -> dict[str, Module]:
    found = {}
    for prefix, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join((prefix, *(parts[:-1] if is_package else parts)))
            found[name] = Module(name, path, is_package)
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, in_function: bool, out: list[tuple[ast.AST, bool]]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            out.append((child, in_function))
        elif isinstance(child, ast.If) and _is_type_checking(child):
            for inner in child.body:  # read by type checkers only: a cycle all the same, never run
                _imports(ast.Module(body=[inner], type_ignores=[]), True, out)
            for inner in child.orelse:
                _imports(ast.Module(body=[inner], type_ignores=[]), in_function, out)
        else:
            _imports(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)),
                     out)


def _targets(mod: Module, node: ast.AST, known: dict[str, Module]) -> set[str]:
    """The modules (ours by full name, others by their top name) an import statement loads."""
    if isinstance(node, ast.Import):
        names = {alias.name for alias in node.names}
        return {n if n in known else n.split(".")[0] for n in names}
    base = node.module or ""
    if node.level:
        package = mod.name if mod.is_package else mod.name.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
            package = package.rsplit(".", 1)[0]
        base = f"{package}.{base}" if base else package
    if base not in known and not base.startswith("lmcockpit"):
        return {base.split(".")[0]}
    out = {base}
    out |= {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known}
    return out


def import_graph(roots: dict[str, Path] = ROOTS) -> dict[str, Module]:
    modules = _modules(roots)
    for mod in modules.values():
        found: list[tuple[ast.AST, bool]] = []
        _imports(ast.parse(mod.path.read_text(), str(mod.path)), False, found)
        for node, in_function in found:
            targets = _targets(mod, node, modules) - {mod.name}
            mod.anywhere |= targets
            if not in_function:
                mod.at_import |= targets
    # Importing a.b.c runs a/__init__ and a/b/__init__ first.
    for mod in modules.values():
        for target in list(mod.at_import):
            parts = target.split(".")
            mod.at_import |= {".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in modules}
    return modules


def cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Each group of our modules that import one another in a loop (Tarjan's strongly connected
    components), counting every import, also those inside functions."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(modules[v].anywhere & modules.keys()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for name in sorted(modules):
        if name not in index:
            visit(name)
    return groups


def loaded_at_import(modules: dict[str, Module], start: str) -> dict[str, str]:
    """Every module importing `start` loads, each with the module that imported it first."""
    seen, todo = {start: ""}, [start]
    while todo:
        name = todo.pop()
        for target in sorted(modules[name].at_import) if name in modules else ():
            if target not in seen:
                seen[target] = name
                todo.append(target)
    return seen


def chain(seen: dict[str, str], name: str) -> str:
    path = [name]
    while seen[path[-1]]:
        path.append(seen[path[-1]])
    return " ← ".join(path)


def front_end(modules: dict[str, Module]) -> list[str]:
    """Every tui module, and every core module that one of them imports when it is imported. A
    command's main may import the engine's modules when it runs (`data prepare` tokenises): that
    is the work the user asked for, not the front-end's start."""
    tui = [n for n in modules if n.startswith("lmcockpit.tui")]
    reached = {t for n in tui for t in modules[n].at_import if t.startswith("lmcockpit.core")}
    return sorted({*tui, *reached})


def heavy_imports(modules: dict[str, Module], names: list[str], heavy: set[str]) -> list[str]:
    problems = []
    for name in names:
        seen = loaded_at_import(modules, name)
        problems += [f"{chain(seen, h)}" for h in sorted(heavy & seen.keys())]
    return problems


def docstring(mod: Module, clean: bool = True) -> str | None:
    return ast.get_docstring(ast.parse(mod.path.read_text(), str(mod.path)), clean=clean)


def torch_line(package: Module) -> str:
    doc = docstring(package) or ""
    lines = [line for line in doc.splitlines() if line.startswith("Torch:")]
    return lines[0] if lines else ""


def unnamed_modules(modules: dict[str, Module]) -> list[str]:
    """Each module (a .py file, not a subpackage) whose package's docstring does not name it, as
    `name` in backticks: a map of the package that has drifted from its folder."""
    problems = []
    for package in (m for m in modules.values() if m.is_package):
        doc = docstring(package) or ""
        for mod in modules.values():
            parent, _, bare = mod.name.rpartition(".")
            if parent == package.name and not mod.is_package and not re.search(f"`{re.escape(bare)}`", doc):
                problems.append(f"{package.path}: names no `{bare}` ({mod.path.name})")
    return sorted(problems)


def summaryless(modules: dict[str, Module]) -> list[str]:
    """Each module whose docstring does not open with a one-line summary (PEP 257): a first line,
    the one with the opening quotes, that is not empty, then a blank line or the docstring's end.
    No docstring counts as none."""
    problems = []
    for mod in modules.values():
        lines = (docstring(mod, clean=False) or "").splitlines()
        if not lines or not lines[0].strip() or (len(lines) > 1 and lines[1].strip()):
            problems.append(f"{mod.path}: {lines[0] if lines else '(no docstring)'}")
    return sorted(problems)


def summary_retold(modules: dict[str, Module]) -> list[str]:
    """Each module whose prose opens by saying its summary line again (the same first three
    words): the summary is read first, the prose goes on from it."""
    problems = []
    for mod in modules.values():
        paragraphs = (docstring(mod) or "").split("\n\n")
        if len(paragraphs) > 1 and paragraphs[0].split()[:3] == paragraphs[1].split()[:3]:
            problems.append(f"{mod.path}: {paragraphs[1].splitlines()[0]}")
    return sorted(problems)


# ------------------------------------------------------------------------------------ the tests
def test_no_module_imports_one_that_imports_it_back():
    found = cycles(import_graph())
    assert not found, "import cycles (move what both need to a module below them): " + "; ".join(
        " ↔ ".join(group) for group in found)


def test_the_front_end_never_imports_torch_transformers_or_numpy():
    modules = import_graph()
    names = front_end(modules)
    assert "lmcockpit.tui.cli" in names and "lmcockpit.core.process.runner" in names
    problems = heavy_imports(modules, names, HEAVY)
    assert not problems, "the front-end loads these at import time:\n" + "\n".join(problems)


def test_every_core_package_says_whether_it_imports_torch_and_means_it():
    modules = import_graph()
    packages = [m for n, m in modules.items() if m.is_package and n.startswith("lmcockpit.core.")]
    assert {p.name.rsplit(".", 1)[1] for p in packages} >= {"data", "model", "train", "process", "infer",
                                                              "hardware", "run"}
    for package in packages:
        line = torch_line(package)
        assert line, f"{package.path}: its docstring needs a 'Torch:' line (does it import torch?)"
        if line.startswith("Torch: never"):
            inside = [n for n in modules if n.startswith(package.name + ".")]
            problems = heavy_imports(modules, inside, {"torch"})
            assert not problems, f"{package.path} says '{line}', but:\n" + "\n".join(problems)


def test_every_package_docstring_names_each_of_its_modules():
    problems = unnamed_modules(import_graph())
    assert not problems, "package docstrings that miss a module (name it, in backticks):\n" + "\n".join(problems)


def test_every_module_docstring_opens_with_a_one_line_summary():
    problems = summaryless(import_graph())
    assert not problems, ("module docstrings with no one-line summary (a line of its own, then a blank "
                          "line):\n" + "\n".join(problems))


def test_no_module_docstring_tells_its_summary_twice():
    problems = summary_retold(import_graph())
    assert not problems, "module docstrings whose prose opens with their summary again:\n" + "\n".join(problems)


COMMANDS = "lmcockpit.tui.commands"
VIEWS = ("lmcockpit.tui.screens", "lmcockpit.tui.widgets")
TUI_TOP_MAX = 13  # tui/'s own modules: the bare command's front-ends, the app, and what they share


def views_importing_a_command(modules: dict[str, Module]) -> list[str]:
    """Each screen or widget that imports a command's module (the registry itself is no command):
    what a command prints and a screen shows lives in a module both import."""
    return sorted(f"{name} imports {target}" for name, mod in modules.items() if name.startswith(VIEWS)
                  for target in mod.anywhere if target.startswith(COMMANDS + "."))


def test_screens_and_widgets_never_import_a_command():
    found = views_importing_a_command(import_graph())
    assert not found, "move what both show to a module both import (tui/rows.py, tui/formatting.py):\n" + \
        "\n".join(found)


def test_tui_holds_its_commands_in_a_package_and_a_few_modules_of_its_own():
    """Every registered command's module is under tui/commands/, and tui/'s top stays small."""
    from lmcockpit.tui.commands import COMMANDS as REGISTRY

    assert all(c.module.startswith(COMMANDS + ".") for c in REGISTRY.values())
    top = sorted(p.stem for p in (REPO / "tui").glob("*.py") if p.stem != "__init__")
    assert len(top) <= TUI_TOP_MAX, top


def handlers_of_usage_errors(path: Path) -> list[str]:
    """Each `except` in `path` that catches UsageError or ConfigError and does anything but raise
    it again: the registry's dispatch (tui/commands/__init__.py) turns them into the error line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ExceptHandler) and node.type is not None:
            names = {n.id for n in ast.walk(node.type) if isinstance(n, ast.Name)}
            if names & {"UsageError", "ConfigError"} and not all(isinstance(b, ast.Raise) and b.exc is None
                                                                 for b in node.body):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_usage_and_config_errors_are_turned_into_the_error_line_by_the_registry_alone():
    """A command raises them; `Command.main` says them (one `error:` line, exit 2). A command may
    catch one to say it otherwise (chat's `--temperature` turns a ConfigError into a UsageError)."""
    found = [h for path in sorted((REPO / "tui" / "commands").rglob("*.py")) if path.name != "__init__.py"
             or path.parent.name != "commands" for h in handlers_of_usage_errors(path)]
    allowed = {"tui/commands/chat.py"}  # re-raised as a UsageError naming the flag, and in the REPL, said and asked again
    assert {h.rsplit(":", 1)[0] for h in found} <= allowed, found


def test_the_command_check_sees_a_screen_that_imports_one(tmp_path):
    tui = tmp_path / "tui"
    for folder in ("screens", "commands"):
        (tui / folder).mkdir(parents=True)
        (tui / folder / "__init__.py").write_text("")
    (tui / "__init__.py").write_text("")
    (tui / "commands" / "presets.py").write_text("ROWS = []\n")
    (tui / "screens" / "launch.py").write_text("def f():\n    from lmcockpit.tui.commands.presets import ROWS\n")
    (tui / "screens" / "help.py").write_text("from lmcockpit.tui.commands import COMMANDS\n")  # the registry: fine
    modules = import_graph({"lmcockpit.tui": tui})
    assert views_importing_a_command(modules) == [
        "lmcockpit.tui.screens.launch imports lmcockpit.tui.commands.presets"]


def test_the_checks_see_a_cycle_and_a_torch_import(tmp_path):
    """The three tests above, against a small tree that breaks each rule: they would go red."""
    pkg = tmp_path / "core"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text('"""Low.\n\nTorch: never."""\n')
    (pkg / "low" / "a.py").write_text("from . import b\n")
    (pkg / "low" / "b.py").write_text("def f():\n    from .a import x\n")  # a lazy import is a loop too
    (pkg / "low" / "c.py").write_text("from .d import y\n")
    (pkg / "low" / "d.py").write_text("import numpy\nimport torch.nn as nn\n")
    tui = tmp_path / "tui"
    tui.mkdir()
    (tui / "__init__.py").write_text("")
    (tui / "app.py").write_text("from lmcockpit.core.low import c\n\ndef main():\n    from lmcockpit.core.low import a\n")
    modules = import_graph({"lmcockpit.core": pkg, "lmcockpit.tui": tui})
    assert cycles(modules) == [["lmcockpit.core.low.a", "lmcockpit.core.low.b"]]
    # what tui/app.py loads when imported, not what its main imports when it runs
    assert front_end(modules) == ["lmcockpit.core", "lmcockpit.core.low", "lmcockpit.core.low.c", "lmcockpit.tui",
                                  "lmcockpit.tui.app"]
    assert heavy_imports(modules, ["lmcockpit.core.low.c"], HEAVY) == [
        "numpy ← lmcockpit.core.low.d ← lmcockpit.core.low.c", "torch ← lmcockpit.core.low.d ← lmcockpit.core.low.c"]
    assert torch_line(modules["lmcockpit.core.low"]) == "Torch: never."


def test_the_checks_see_an_unnamed_module_and_a_missing_summary(tmp_path):
    """The two docstring tests above, against a small tree that breaks each rule: they would go red."""
    pkg = tmp_path / "core"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""The core.\n\nIts floor: low/, named as a folder, not a module."""\n')
    (pkg / "low" / "__init__.py").write_text('"""Low: `a` and a plain b.\n\nTorch: never."""\n')
    (pkg / "low" / "a.py").write_text('"""A, summed up.\n\nThen prose."""\n')
    (pkg / "low" / "b.py").write_text('"""B, whose first sentence runs\non into a second line."""\n')
    (pkg / "low" / "c.py").write_text("x = 1\n")
    (pkg / "low" / "d.py").write_text('"""\nD, after an empty first line."""\n')
    (pkg / "low" / "e.py").write_text('"""E holds the e: once.\n\nE holds the e: twice."""\n')
    modules = import_graph({"lmcockpit.core": pkg})
    assert unnamed_modules(modules) == [f"{pkg / 'low' / '__init__.py'}: names no `{m}` ({m}.py)" for m in "bcde"]
    assert summaryless(modules) == [f"{pkg / 'low' / 'b.py'}: B, whose first sentence runs",
                                    f"{pkg / 'low' / 'c.py'}: (no docstring)", f"{pkg / 'low' / 'd.py'}: "]
    assert summary_retold(modules) == [f"{pkg / 'low' / 'e.py'}: E holds the e: twice."]


def test_no_test_file_imports_another_test_file():
    """What two test files share lives in tests/helpers.py (a fixture in tests/conftest.py), never
    in one of them: importing a test file runs all of it at import and ties its tests to another
    file's edits. Every import is read, in functions too, in each of its spellings (the first
    assertion: against a sample that uses each, so the check would go red)."""

    def test_file_imports(tree: ast.Module) -> list[ast.stmt]:
        found = []
        for node in ast.walk(tree):
            # each import as the tests/ module (or modules) it names, "tests." taken off
            if isinstance(node, ast.Import):
                named = [a.name.removeprefix("tests.") for a in node.names if a.name.startswith("tests.")]
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "tests"):
                module = (node.module or "").removeprefix("tests").removeprefix(".") if not node.level else node.module
                # `from .test_x import y` names the file in its module, `from . import test_x` in its names
                named = [module] if module else [a.name for a in node.names]
            else:
                continue
            if any(name.startswith("test_") for name in named):
                found.append(node)
        return found

    sample = ast.parse("from .test_a import x\nfrom tests.test_b import y\nimport tests.test_c\n"
                       "def f():\n    from . import test_d\n    from tests import test_e\n"
                       "from .helpers import z\nfrom tests.fake_hub import FakeHub\nfrom . import other_account\n")
    assert [n.lineno for n in test_file_imports(sample)] == [1, 2, 3, 5, 6]
    offending = [f"tests/{path.name}:{node.lineno}: {ast.unparse(node)}"
                 for path in sorted((REPO / "tests").glob("*.py"))
                 for node in test_file_imports(ast.parse(path.read_text(), str(path)))]
    assert not offending, ("a test file imports another; move what it imports to tests/helpers.py (a fixture: "
                           "tests/conftest.py):\n" + "\n".join(offending))

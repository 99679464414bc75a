"""The shape of the code, read from the source with `ast` (nothing is executed).

No import cycles in core/ or tui/, a front-end that never pulls torch, transformers or numpy in at
import time, package docstrings that say whether their modules import torch and tell the truth,
package docstrings that name each of their modules, and module docstrings that open with a
one-line summary."""

from __future__ import annotations

import ast
import functools
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


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A file's syntax tree, parsed once for every test of this file (each walks every module)."""
    return ast.parse(path.read_text(), str(path))


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


def _base(mod: Module, node: ast.ImportFrom) -> str:
    """The module a `from X import ...` names, a relative X resolved from `mod`'s package."""
    base = node.module or ""
    if node.level:
        package = mod.name if mod.is_package else mod.name.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
            package = package.rsplit(".", 1)[0]
        base = f"{package}.{base}" if base else package
    return base


def _targets(mod: Module, node: ast.AST, known: dict[str, Module]) -> set[str]:
    """The modules (ours by full name, others by their top name) an import statement loads."""
    if isinstance(node, ast.Import):
        names = {alias.name for alias in node.names}
        return {n if n in known else n.split(".")[0] for n in names}
    base = _base(mod, node)
    if base not in known and not base.startswith("lmcockpit"):
        return {base.split(".")[0]}
    out = {base}
    out |= {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known}
    return out


def import_graph(roots: dict[str, Path] = ROOTS) -> dict[str, Module]:
    modules = _modules(roots)
    for mod in modules.values():
        found: list[tuple[ast.AST, bool]] = []
        _imports(parsed(mod.path), False, found)
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
    return ast.get_docstring(parsed(mod.path), clean=clean)


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
    for node in ast.walk(parsed(path)):
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


# ------------------------------------------------------------------ imports a reader can follow
def absolute_self_imports(roots: dict[str, Path] = ROOTS) -> list[str]:
    """Each import of `lmcockpit...` by its absolute name inside the package, statement or
    `importlib.import_module("lmcockpit...")`: that name exists only through setup.py's folder
    mapping (tui/ is `lmcockpit.tui`), so an editor, a type checker or a drawing of the structure
    cannot follow it, where `from ..core.run import folder` leads to the folder beside. A
    command line (`python -m lmcockpit...`) is no import and stays absolute."""
    def ours(name: str | None) -> bool:
        return name is not None and (name == "lmcockpit" or name.startswith("lmcockpit."))

    found = []
    for mod in _modules(roots).values():
        for node in ast.walk(parsed(mod.path)):
            if isinstance(node, ast.ImportFrom):
                hit = node.level == 0 and ours(node.module)
            elif isinstance(node, ast.Import):
                hit = any(ours(alias.name) for alias in node.names)
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                hit = called in ("import_module", "__import__") and isinstance(node.args[0].value, str) \
                    and ours(node.args[0].value)
            else:
                continue
            if hit:
                found.append((mod.path, node.lineno, ast.unparse(node)))
    return [f"{_shown(path)}:{line}: {text}" for path, line, text in sorted(found)]


def _shown(path: Path) -> Path:
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def test_the_package_imports_its_own_modules_relatively():
    found = absolute_self_imports()
    assert not found, ("imports of the package's own modules by their absolute name (write them relative: "
                       "`from ..core.run.folder import ...`):\n" + "\n".join(found))


def unresolved_relative_imports(roots: dict[str, Path] = ROOTS) -> list[str]:
    """Relative imports (in functions too) whose module is none of ours: one dot too few or too
    many fails only when that line runs, in a command a test may never take."""
    modules, out = _modules(roots), []
    for mod in modules.values():
        found: list[tuple[ast.AST, bool]] = []
        _imports(parsed(mod.path), False, found)
        for node, _ in found:
            if isinstance(node, ast.ImportFrom) and node.level:
                if (base := _base(mod, node)) not in modules:
                    out.append(f"{mod.path.relative_to(REPO)}:{node.lineno}: {'.' * node.level}{node.module or ''} "
                               f"is {base}, no module of ours")
    return out


def test_every_relative_import_names_a_module_of_ours():
    found = unresolved_relative_imports()
    assert not found, "\n".join(found)


def test_the_relative_import_check_sees_each_absolute_form(tmp_path):
    tui = tmp_path / "tui"
    tui.mkdir()
    (tui / "__init__.py").write_text("from . import app\n")
    (tui / "app.py").write_text(
        "import importlib\nimport lmcockpitish\nfrom ..core import config\nfrom lmcockpit import __version__\n"
        "def main():\n    import lmcockpit.core.config\n    return importlib.import_module('lmcockpit.tui.app')\n"
        "ARGS = ['python', '-m', 'lmcockpit.core.process.host']\n")
    assert [line.split(": ", 1)[1] for line in absolute_self_imports({"lmcockpit.tui": tui})] == [
        "from lmcockpit import __version__", "import lmcockpit.core.config",
        "importlib.import_module('lmcockpit.tui.app')"]


# ------------------------------------------------------------------ sizes a reader can hold
CLASS_MAX, FUNCTION_MAX = 400, 80  # lines, from its `def`/`class` line to its last
# Today's offenders, each at its length when the rule came: none may grow, and none may join them.
# Shrink one below the limit and its entry goes; shrink it otherwise and lower its number.
OVERSIZED: dict[tuple[str, str], int] = {}


def definition_sizes(path: Path) -> list[tuple[str, int, int]]:
    """(qualified name, lines, limit) of every class and function in `path`, nested ones too."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                limit = CLASS_MAX if isinstance(child, ast.ClassDef) else FUNCTION_MAX
                found.append((name, child.end_lineno - child.lineno + 1, limit))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(parsed(path), "")
    return found


def oversized(folders: list[Path], ceilings: dict[tuple[str, str], int], base: Path = REPO) -> list[str]:
    """Each class or function over its limit and not an offender already, each offender grown past
    its ceiling, and each offender that is one no longer (its entry is to go)."""
    problems, seen = [], set()
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            where = path.relative_to(base).as_posix()
            for name, lines, limit in definition_sizes(path):
                ceiling = ceilings.get((where, name))
                if ceiling is not None:
                    seen.add((where, name))
                    if lines > ceiling:
                        problems.append(f"{where}: {name} is {lines} lines, grown past its {ceiling} (limit {limit}): "
                                        "split it rather than add to it")
                    elif lines <= limit:
                        problems.append(f"{where}: {name} is {lines} lines, within the limit of {limit}: remove its "
                                        "entry from OVERSIZED")
                elif lines > limit:
                    problems.append(f"{where}: {name} is {lines} lines, over the limit of {limit}")
    problems += [f"{where}: {name} is gone: remove its entry from OVERSIZED" for where, name in ceilings
                 if (where, name) not in seen]
    return problems


def test_no_class_or_function_grows_past_its_limit():
    problems = oversized([REPO / "core", REPO / "tui"], OVERSIZED)
    assert not problems, (f"classes over {CLASS_MAX} lines and functions over {FUNCTION_MAX} (OVERSIZED holds "
                          "today's, as ceilings that may only come down):\n" + "\n".join(problems))


def test_the_size_check_sees_a_new_offender_a_grown_one_and_a_stale_entry(tmp_path):
    core = tmp_path / "core"
    core.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(85))
    (core / "a.py").write_text(f"def long():\n{body}\ndef short():\n    pass\n\n"
                               f"class Holder:\n    def method(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n")
    (core / "b.py").write_text(f"def grown():\n{body}")
    ceilings = {("core/b.py", "grown"): 82, ("core/a.py", "short"): 90, ("core/gone.py", "old"): 500}
    assert oversized([core], ceilings, tmp_path) == [
        "core/a.py: long is 86 lines, over the limit of 80",
        "core/a.py: short is 2 lines, within the limit of 80: remove its entry from OVERSIZED",
        "core/a.py: Holder.method is 86 lines, over the limit of 80",
        "core/b.py: grown is 86 lines, grown past its 82 (limit 80): split it rather than add to it",
        "core/gone.py: old is gone: remove its entry from OVERSIZED"]


# ------------------------------------------------------------------ the floors of core/
def core_floors(core_init: Path = REPO / "core" / "__init__.py") -> list[str]:
    """core/'s packages from its docstring's list of floors (`    name/  what it holds`, top floor
    first), bottom floor first: the docstring is where they are written down, and this reads it."""
    doc = ast.get_docstring(parsed(core_init)) or ""
    return [m.group(1) for m in re.finditer(r"^    (\w+)/ ", doc, re.M)][::-1]


# Lazy imports that climb a floor today, by importing module and the floor it reaches, with why.
# Only inside a function; none may join them. Each is code that belongs a floor higher, or a
# parameter its caller (above) could pass down.
CLIMBS = {
    "lmcockpit.core.hardware.cpu_precision": {"model"},  # the probe times a one-block GPT
    "lmcockpit.core.run.checkpoint_folder": {"data"},  # a checkpoint's tokenizer, else a pretrained one's
}


def floor_climbs(modules: dict[str, Module], floors: list[str], allowed: dict[str, set[str]]) -> list[str]:
    """Each import in core/ that reaches a floor above its own, in a function or not (config and
    protocol, the contracts at core/'s top level, stand below every floor; tui/ above them all),
    but for the lazy ones `allowed`; and each `allowed` climb no longer made (its entry is to go)."""
    def level(name: str) -> int | None:
        parts = name.split(".")
        if parts[:2] == ["lmcockpit", "tui"]:
            return len(floors)
        if parts[:2] != ["lmcockpit", "core"] or len(parts) == 2:
            return None  # the root packages: a docstring and the version
        return floors.index(parts[2]) if parts[2] in floors else -1

    problems, used = [], set()
    for name, mod in sorted(modules.items()):
        own = level(name)
        if own is None or not name.startswith("lmcockpit.core"):
            continue
        for target in sorted(mod.anywhere):
            reached = level(target)
            if reached is None or reached <= own:
                continue
            floor = floors[reached] if reached < len(floors) else "tui"
            if target not in mod.at_import and floor in allowed.get(name, ()):
                used.add((name, floor))
                continue
            how = "when imported" if target in mod.at_import else "in a function"
            problems.append(f"{name} imports {target} {how}: {floor}/ is above {name.split('.')[2]}")
    problems += [f"{name} no longer climbs to {floor}/: remove it from CLIMBS" for name, floors_ in allowed.items()
                 for floor in sorted(floors_) if (name, floor) not in used]
    return problems


def test_core_docstring_lists_every_package_as_a_floor():
    packages = sorted(p.name for p in (REPO / "core").iterdir() if (p / "__init__.py").is_file())
    assert sorted(core_floors()) == packages, "core/__init__.py's list of floors and core/'s packages differ"


def test_no_import_climbs_a_floor_not_even_inside_a_function():
    problems = floor_climbs(import_graph(), core_floors(), CLIMBS)
    assert not problems, ("core/'s packages import only those below them (core/__init__.py); these climb "
                          "(move the code up a floor, or have the caller pass it down):\n" + "\n".join(problems))


def test_the_floor_check_sees_a_climb_at_import_and_in_a_function(tmp_path):
    core = tmp_path / "core"
    for package in ("low", "high"):
        (core / package).mkdir(parents=True)
        (core / package / "__init__.py").write_text("")
    (core / "__init__.py").write_text('"""The core.\n\nIts floors:\n\n    high/  on top\n    low/   below\n"""\n')
    (core / "config.py").write_text("def f():\n    from .low import a\n")
    (core / "low" / "a.py").write_text("from ..high import b\n")
    (core / "low" / "c.py").write_text("def f():\n    from ..high.b import x\n    from ...tui import app\n")
    (core / "low" / "d.py").write_text("def f():\n    from ..high import b\n")
    (core / "high" / "b.py").write_text("from ..low import a\nfrom .. import config\n")
    floors = core_floors(core / "__init__.py")
    assert floors == ["low", "high"]
    modules = import_graph({"lmcockpit.core": core})
    assert floor_climbs(modules, floors, {"lmcockpit.core.low.d": {"high"}, "lmcockpit.core.low.a": {"high"}}) == [
        "lmcockpit.core.config imports lmcockpit.core.low in a function: low/ is above config",
        "lmcockpit.core.config imports lmcockpit.core.low.a in a function: low/ is above config",
        "lmcockpit.core.low.a imports lmcockpit.core.high when imported: high/ is above low",
        "lmcockpit.core.low.a imports lmcockpit.core.high.b when imported: high/ is above low",
        "lmcockpit.core.low.c imports lmcockpit.core.high.b in a function: high/ is above low",
        "lmcockpit.core.low.c imports lmcockpit.tui in a function: tui/ is above low",
        "lmcockpit.core.low.a no longer climbs to high/: remove it from CLIMBS"]


def test_the_training_loop_stays_a_loop():
    """trainer.py holds the loop and the step; recovery, evaluation and checkpoints are parts with
    modules of their own (core/train/recovery.py, evaluation.py, checkpointing.py)."""
    lines = len((REPO / "core/train/trainer.py").read_text().splitlines())
    assert lines <= 450, f"core/train/trainer.py is {lines} lines: give what grew a part of its own"



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
                 for node in test_file_imports(parsed(path))]
    assert not offending, ("a test file imports another; move what it imports to tests/helpers.py (a fixture: "
                           "tests/conftest.py):\n" + "\n".join(offending))

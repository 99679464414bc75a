"""The documentation stays short where newcomers start and true to the code everywhere.

README.md is the first page (at most README_MAX lines); docs/ holds the rest, docs/architecture.md
the map of the code. Every repository path or module that README.md or a docs/ page names in
backticks exists, and every relative link leads to a file, so a module that moves takes its
mentions with it. No tracked file names the founders' notes outside the repository, which a
user's clone does not have."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX = 220
# The notes beside the checkout, spelt so that this file does not name them itself.
OUTSIDE = ("".join(("..", "/", "shared")), "".join(("shared", "/", "DESIGN.md")))
PAGES = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]

CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def tracked(root: Path) -> list[Path]:
    """The files git tracks under `root` (every file under it where it is no git checkout)."""
    try:
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True,
                                text=True).stdout.split("\0")
        return [root / name for name in listed if name]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in root.rglob("*") if p.is_file() and ".git" not in p.parts]


def tracked_text_files(root: Path) -> list[Path]:
    out = []
    for path in tracked(root):
        try:
            data = path.read_bytes()
        except OSError:  # listed but gone from the work tree
            continue
        if b"\0" not in data[:8192]:
            out.append(path)
    return out


def files_naming_outside_notes(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in tracked_text_files(root)
                  if any(name in p.read_text(encoding="utf-8", errors="replace") for name in OUTSIDE))


def named_paths(text: str) -> set[str]:
    """What a page names in backticks that is a place in this repository: a path whose first
    part is one of the repository's top folders (`core/run/folder.py`, `tests/`), a top-level file
    (`pyproject.toml`), or a module by its import name (`lmcockpit.core.process.host`, also as
    `python -m lmcockpit.core.hardware.doctor`)."""
    # Tracked, not merely present: a checkout's own runs/ or venv/ is no place the docs may name.
    tops = {p.relative_to(REPO).parts[0] for p in tracked(REPO)} | {"docs"}
    found = set()
    for span in CODE.findall(text):
        span = span.strip()
        if span.startswith("python -m lmcockpit"):  # a module run as a program
            span = span.split()[2]
        if not re.fullmatch(r"[\w.\-/:]+", span):
            continue  # a command line, a key with a value, prose
        if re.fullmatch(r"lmcockpit(\.\w+)+(:\w+)?", span):
            found.add(span.split(":")[0])
        elif span.split("/")[0] in tops and ("/" in span or (REPO / span).is_file()):
            found.add(span)
    return found


def missing(text: str, page: Path) -> list[str]:
    gone = []
    for name in sorted(named_paths(text)):
        if name.startswith("lmcockpit"):
            parts = name.split(".")
            folder = {"core": "core", "tui": "tui", "presets": "presets"}.get(parts[1] if len(parts) > 1 else "")
            base = REPO.joinpath(folder, *parts[2:]) if folder else REPO.joinpath(*parts)
            exists = base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()
        else:
            exists = (REPO / name).exists()
        if not exists:
            gone.append(name)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address, or a heading of the same page
        if not (page.parent / target.split("#")[0]).exists():
            gone.append(target)
    return gone


def test_the_readme_is_a_first_page_not_the_manual():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX, f"README.md has {len(lines)} lines: move a section into docs/ (at most {README_MAX})"


def test_the_architecture_page_exists_and_the_readme_leads_to_every_page():
    assert (REPO / "docs" / "architecture.md").is_file()
    readme = (REPO / "README.md").read_text()
    unlinked = [p.name for p in PAGES[:-1] if f"(docs/{p.name})" not in readme]
    assert not unlinked, f"README.md's 'Where to read on' links no {unlinked}"


def test_no_tracked_file_names_the_notes_outside_the_repository():
    found = files_naming_outside_notes(REPO)
    assert not found, f"a user's clone has no {' or '.join(OUTSIDE)}: point these at docs/ instead: {found}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_path_a_page_names_exists(page):
    gone = missing(page.read_text(), page)
    assert not gone, f"{page.relative_to(REPO)} names what the repository does not hold: {gone}"


def test_the_checks_see_a_moved_module_a_dead_link_and_a_long_readme(tmp_path):
    """The checks above, against text that breaks each rule: they would go red."""
    page = REPO / "docs" / "architecture.md"
    text = ("`core/run/folder.py` and `core/run/gone.py`, `lmcockpit.core.process.host` and "
            "`lmcockpit.core.process.gone`, `lmcockpit.tui.cli:main`, `python -m lmcockpit.core.hardware.gone`, `runs/cpu-1/` (a run's, not ours), "
            "`--set a=b`, [ok](cockpit.md#keys), [dead](nowhere.md), [web](https://example.com)")
    assert missing(text, page) == ["core/run/gone.py", "lmcockpit.core.hardware.gone", "lmcockpit.core.process.gone",
                                   "nowhere.md"]
    (tmp_path / "notes.py").write_text(f"# see {OUTSIDE[0]}/x\n")
    (tmp_path / "design.md").write_text(f"as {OUTSIDE[1]} says\n")
    (tmp_path / "fine.py").write_text("# see docs/architecture.md\n")
    assert files_naming_outside_notes(tmp_path) == ["design.md", "notes.py"]

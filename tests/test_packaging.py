"""A regular install, as pipx or a wheel gives it: the wheel holds every module, stylesheet and
preset of the tree, and, installed away from this checkout, the cockpit opens and the README's
commands run from it."""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import urllib.request
import zipfile
from pathlib import Path

import pytest

from lmcockpit.core.run.folder import read_metrics

from .helpers import TINY, as_flags, stop, wait_until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"core": ("*.py",), "tui": ("*.py", "*.tcss"), "presets": ("*.py", "*.toml"), "lmcockpit": ("*.py",)}


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> tuple[Path, str]:
    """Built from a copy of the source alone: setuptools would reuse a stale build/ in the checkout.
    (the wheel, what the build printed: pip's --quiet keeps the backend's warnings)"""
    source = tmp_path_factory.mktemp("source") / "lmcockpit"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "venv", ".ci", "build", "dist", "*.egg-info", "__pycache__", "runs", "tests"))
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(out),
                           str(source)], check=True, capture_output=True, text=True)
    [built] = out.glob("lmcockpit-*.whl")
    return built, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def wheel(build) -> Path:
    return build[0]


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The wheel installed into a folder of its own: (its `lmcockpit` script, the environment that
    puts it first on the path). The dependencies are this environment's."""
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    return site, env


def shipped_files() -> set[str]:
    root = {"core": "lmcockpit/core", "tui": "lmcockpit/tui", "presets": "lmcockpit/presets", "lmcockpit": "lmcockpit"}
    return {f"{root[folder]}/{path.relative_to(REPO / folder).as_posix()}"
            for folder, patterns in FOLDERS.items() for pattern in patterns
            for path in (REPO / folder).rglob(pattern) if "__pycache__" not in path.parts}


def test_the_wheel_holds_every_module_stylesheet_and_preset(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = shipped_files()
    assert {"lmcockpit/tui/cockpit.tcss", "lmcockpit/tui/screens/launch.py", "lmcockpit/presets/cpu.toml",
            "lmcockpit/core/model/gpt.py"} <= expected  # the walk itself sees the tree
    assert not expected - names, f"missing from the wheel: {sorted(expected - names)}"


def test_the_build_says_nothing_of_the_license_is_deprecated(build):
    """pyproject.toml's license is an SPDX expression (PEP 639): the table form, `{ text = "MIT" }`,
    makes setuptools warn that builds will stop working (2027-02-18)."""
    _, said = build
    deprecated = [line for line in said.splitlines() if "deprecat" in line.lower() and "licen" in line.lower()]
    assert not deprecated, deprecated


def test_a_regular_install_opens_the_cockpit_and_runs_the_readme_commands(installed, tmp_path):
    site, env = installed
    lmcockpit = str(site / "bin" / "lmcockpit")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, lmcockpit, *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)

    # The cockpit: the launch screen, styled by its .tcss, listing the shipped presets; q quits.
    opened = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import asyncio, lmcockpit
        assert lmcockpit.__file__.startswith({str(site)!r}), lmcockpit.__file__
        from lmcockpit.tui.app import CockpitApp
        from lmcockpit.tui.screens.launch import LaunchScreen

        async def main():
            app = CockpitApp(telemetry=False)
            async with app.run_test(size=(120, 40)) as pilot:
                assert isinstance(app.screen, LaunchScreen), app.screen
                assert app.stylesheet.source, "no stylesheet loaded"
                print("presets:", " ".join(r.value for r in app.screen.query_one("#presets").rows))
                await pilot.press("q")
            print("exit", app.return_code or 0)
        asyncio.run(main())
        """)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert opened.returncode == 0, opened.stderr
    assert "cpu" in opened.stdout.split("presets:")[1].split() and "exit 0" in opened.stdout

    version = run("--version")
    assert version.returncode == 0 and version.stdout.startswith("lmcockpit ")
    # Run from inside a clone (or any folder with a lmcockpit/ package in it): the processes the command
    # starts with `-m` (doctor's torch check, a run's host) must import the installed lmcockpit, never it.
    (tmp_path / "lmcockpit").mkdir()
    (tmp_path / "lmcockpit" / "__init__.py").write_text("raise SystemExit('the lmcockpit/ of the working folder ran')\n")
    doctor = run("doctor")
    assert doctor.returncode == 0 and "torch" in doctor.stdout, doctor.stderr
    presets = run("presets", "--memory", "24")
    assert presets.returncode == 0 and "3090" in presets.stdout, presets.stderr
    trained = run("--run", "debug", *as_flags([*TINY, "training.max_steps=4", "eval.every=4"]), "--out", "run")
    assert trained.returncode == 0, trained.stderr
    assert (tmp_path / "run" / "checkpoints" / "step_000004").is_dir()
    chat = run("chat", "run", "--prompt", "def ", "--max-new-tokens", "4")
    assert chat.returncode == 0 and chat.stdout.startswith("def "), chat.stderr
    exported = run("export", "run", "hf")
    assert exported.returncode == 0 and (tmp_path / "hf" / "config.json").is_file(), exported.stderr
    detached = run("debug", *as_flags([*TINY, "training.max_steps=2", "eval.every=0"]), "--detach",
                   "--out", "bg")
    assert detached.returncode == 0, detached.stdout + detached.stderr + (tmp_path / "bg" / "host.log").read_text()
    wait_until(lambda: read_metrics(tmp_path / "bg", "end"), what="the detached run's end")  # its host trained it
    stop(tmp_path / "bg")  # the host gone, if it is still winding down


def test_a_regular_install_serves_the_cockpit_page_with_textual_serves_front_end(installed, tmp_path):
    """`lmcockpit serve` from the wheel: the page and the script it loads come from the installed
    textual-serve (its static files ship in its own wheel; none of ours need package data)."""
    site, env = installed
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    served = subprocess.Popen([sys.executable, str(site / "bin" / "lmcockpit"), "serve", "--port", str(port)],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert select.select([served.stdout], [], [], 120)[0], "no banner in 120 s"
        banner = served.stdout.readline()
        found = re.search(rf"the cockpit on (http://127\.0\.0\.1:{port}/[0-9a-f]+/)\?token=([0-9a-f]+) ", banner)
        assert found, banner + served.stderr.read()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor())  # the cookie, across the 303
        with opener.open(f"{found[1]}?token={found[2]}", timeout=30) as page:
            assert 'data-session-websocket-url="ws://127.0.0.1:' in page.read().decode()
        with opener.open(f"{found[1]}static/js/textual.js", timeout=30) as script:
            assert script.status == 200 and len(script.read()) > 100_000  # xterm.js and textual-serve's client
    finally:
        served.send_signal(signal.SIGINT)
        try:
            served.wait(30)
        finally:
            served.kill()
            served.communicate()

"""The command line's one shape, read from the registry (tui/commands/__init__.py): `--help` and the README
name every command, `help X` prints what `X --help` prints, a mistyped command is named instead of
being taken for a preset, and tab completion answers the way a shell asks: argcomplete's
environment protocol (`_ARGCOMPLETE`, `COMP_LINE`, `COMP_POINT`) against the real process, the
completions read from the file argcomplete writes them to."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lmcockpit.core.config import SECTIONS, shipped_presets
from lmcockpit.tui.commands import COMMANDS, GROUPS

from .helpers import cli

REPO = Path(__file__).resolve().parents[1]


def lmcockpit(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """The real command, piped, at 80 columns (what argparse wraps to when piped), with `env` added."""
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "80", **env})


def complete(line: str, cwd: Path, shell: str = "bash") -> list[str]:
    """What Tab offers at the end of `line`, asked as argcomplete's shell scripts ask."""
    answer = cwd.parent / f"completions-{cwd.name}"
    proc = lmcockpit("-m", "lmcockpit.tui.cli", cwd=cwd, _ARGCOMPLETE="1", _ARGCOMPLETE_SHELL=shell, COMP_LINE=line,
                     COMP_POINT=str(len(line)), _ARGCOMPLETE_STDOUT_FILENAME=str(answer),
                     _ARGCOMPLETE_SUPPRESS_SPACE="0" if shell == "bash" else "1")  # as each shell's script sets it
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "", proc.stdout  # the terminal gets nothing: completions go to argcomplete's channel
    text = answer.read_text()
    return [c.rstrip() for c in text.split("\013")] if text else []


@pytest.fixture
def workdir(tmp_path) -> Path:
    """A folder to run from, with two run folders under runs/ and two folders that are not runs."""
    work = tmp_path / "work"
    for run in ("cpu-20261123-084716", "debug-20261124-101500"):
        (work / "runs" / run / "checkpoints" / "step_000012").mkdir(parents=True)
        (work / "runs" / run / "config.toml").write_text("")
    (work / "runs" / "half-made").mkdir()
    (work / "corpus").mkdir()
    (work / "mine.toml").write_text("")
    return work


# -------------------------------------------------------------------------------- the registry
def test_every_command_is_a_module_with_a_parser_and_a_main_that_fit_the_registry():
    assert {"chat", "export", "presets", "doctor", "help", "completion"} <= COMMANDS.keys()
    for name, command in COMMANDS.items():
        module = command.load()
        assert callable(module.main), name
        assert command.parser().prog == f"lmcockpit {name}"  # its usage errors name the right --help
        assert command.group in GROUPS and len(command.summary) <= 60, name
    # a command name would shadow the shipped preset of that name (commands are looked up first)
    assert not COMMANDS.keys() & shipped_presets().keys()


@pytest.mark.slow
def test_help_lists_every_command_under_its_group_then_the_training_flags_then_examples():
    proc = cli("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    lines = proc.stdout.splitlines()
    group_of, heading = {}, None
    for line in lines:
        if line.rstrip(":") in GROUPS:
            heading = line.rstrip(":")
        elif heading and (m := re.fullmatch(r"  (\S+(?: \S+)?)\s{2,}(.+)", line)):
            group_of[m[1]] = (heading, m[2])
        elif not line:
            heading = None
    for name, command in COMMANDS.items():
        assert group_of.get(name) == (command.group, command.summary), name
    assert group_of["[PRESET]"][0] == group_of["--run PRESET"][0] == "train"  # the bare command's two forms
    assert [g for g in GROUPS if f"{g}:" in lines] == list(GROUPS)
    out = proc.stdout
    order = ["\ntrain:", "\nmodels:", "\ntraining flags", "--set KEY=VALUE", "\nexamples:"]
    assert [out.index(part) for part in order] == sorted(out.index(part) for part in order)
    assert "lmcockpit --run cpu" in out.split("examples:")[1]


@pytest.mark.slow
def test_help_fits_an_80_column_terminal():
    out = lmcockpit("-m", "lmcockpit.tui.cli", "--help").stdout
    assert [line for line in out.splitlines() if len(line) > 80] == []


def test_the_readme_table_names_every_command_and_no_other():
    readme = (REPO / "README.md").read_text()
    table = readme.split("## Commands\n", 1)[1].split("\n## ", 1)[0]
    forms = re.findall(r"^\| `(lmcockpit[^`]*)` \|", table, flags=re.M)
    named = {words[1] for words in (form.split() for form in forms)
             if len(words) > 1 and not words[1].startswith("-") and not words[1].isupper()}
    assert named == set(COMMANDS), f"README lacks {set(COMMANDS) - named} or names non-commands {named - set(COMMANDS)}"
    assert {"lmcockpit", "lmcockpit --run"} <= {" ".join(form.split()[:2]) for form in forms}


@pytest.mark.slow
@pytest.mark.parametrize("name", [None, *COMMANDS])
def test_help_x_prints_exactly_what_x_help_prints(name):
    asked = cli("help", *([name] if name else []))
    direct = cli(*([name] if name else []), "--help")
    assert direct.returncode == 0 and direct.stdout.startswith("usage: lmcockpit")
    assert (asked.returncode, asked.stdout, asked.stderr) == (direct.returncode, direct.stdout, direct.stderr)


@pytest.mark.slow
def test_help_of_a_command_that_does_not_exist_names_the_nearest():
    proc = cli("help", "exprot")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "error: lmcockpit help exprot: no such command; did you mean export?\n"


# -------------------------------------------------------------------- a mistyped command
@pytest.mark.slow
@pytest.mark.parametrize("args, meant", [
    (["chta"], "chat"),
    (["chta", "runs/cpu-1", "--prompt", "def "], "chat"),  # named before its arguments are judged
    (["exprot", "runs/cpu-1", "out"], "export"),
    (["prests", "--memory", "24"], "presets"),
    (["docter"], "doctor"),
    (["--set", "training.max_steps=3", "hlep"], "help"),
])
def test_a_mistyped_command_exits_2_naming_the_nearest(tmp_path, args, meant):
    proc = cli(*args, cwd=tmp_path)
    word = next(a for a in args if not a.startswith("-") and "=" not in a)
    assert proc.returncode == 2
    assert proc.stderr == f"error: lmcockpit {word}: no such command; did you mean {meant}?\n"
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []  # no run folder, no cockpit


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["cpuu"], "preset 'cpuu' not found: no such file, and no shipped preset of that name"),  # nearer a preset
    (["nosuchpreset"], "preset 'nosuchpreset' not found"),  # shares a stem with `presets`, no more
    (["chta.toml"], "preset 'chta.toml' not found"),  # a .toml suffix: a path
    (["./chat"], "preset './chat' not found"),  # a separator: a path, even to a command's name
    (["chta"], "chta: TOML syntax error"),  # a file of that name here: it is read
    (["--out", "somewhere", "chat"], "chat is a command: it goes first, as in `lmcockpit chat --help`"),
])
def test_a_preset_path_stays_a_preset_and_a_command_out_of_place_is_named(tmp_path, args, message):
    (tmp_path / "chta").write_text("[training]\nmax_steps = = 3\n")  # a preset file with no suffix
    proc = cli(*args, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "no such command" not in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------- completion
@pytest.mark.slow
@pytest.mark.parametrize("shell, registers", [
    ("bash", r"\n\s*complete .*-F _python_argcomplete lmcockpit\n"),
    ("zsh", r"^#compdef lmcockpit\n(.*\n)*\s+compdef _python_argcomplete lmcockpit\n"),
    ("fish", r"\ncomplete --command lmcockpit .*'\(__fish_lmcockpit_complete\)'"),
])
def test_the_completion_script_is_printed_for_each_shell(shell, registers):
    proc = cli("completion", shell)
    assert proc.returncode == 0 and proc.stderr == ""
    assert re.search(registers, proc.stdout), proc.stdout
    assert "_ARGCOMPLETE" in proc.stdout  # it asks lmcockpit itself, by argcomplete's protocol
    if shell != "fish":  # bash parses zsh's too: argcomplete's script is one for both
        check = subprocess.run(["bash", "-n"], input=proc.stdout, capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stderr


@pytest.mark.slow
def test_completion_for_another_shell_is_a_usage_error():
    proc = cli("completion", "tcsh")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: argument SHELL: invalid choice: 'tcsh'")


@pytest.mark.slow
def test_the_first_word_completes_to_commands_and_presets(workdir):
    assert complete("lmcockpit ch", workdir) == ["chat", "chat-cpu"]  # a command and a preset
    assert complete("lmcockpit co", workdir) == ["compare", "completion"]
    assert complete("lmcockpit compl", workdir) == ["completion"]
    first = complete("lmcockpit ", workdir)
    assert set(first) == {*COMMANDS, *shipped_presets(), "mine.toml"}
    # zsh shows each command's summary beside it, from the registry
    assert complete("lmcockpit ex", workdir, shell="zsh") == [f"export:{COMMANDS['export'].summary}"]
    # after a flag, a command no longer fits there: presets only
    assert set(complete("lmcockpit --run ", workdir)) == {*shipped_presets(), "mine.toml"}


@pytest.mark.slow
def test_set_completes_to_the_config_keys_and_the_values_a_choice_takes(workdir):
    training = {f"training.{f.name}=" for f in dataclasses.fields(SECTIONS["training"])}
    assert set(complete("lmcockpit --run cpu --set train", workdir)) == training
    assert "training.max_steps=" in training and "training.precision=" in training
    every = {f"{s}.{f.name}=" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert set(complete("lmcockpit --set ", workdir)) == every
    assert complete("lmcockpit debug --set training.precision=", workdir) == [
        "training.precision=auto", "training.precision=bf16", "training.precision=fp16", "training.precision=fp32"]
    assert complete("lmcockpit --set training.compile=", workdir) == ["training.compile=true", "training.compile=false"]


@pytest.mark.slow
def test_resume_chat_and_export_complete_to_the_run_folders(workdir):
    runs = ["runs/cpu-20261123-084716", "runs/debug-20261124-101500"]  # not runs/half-made: no config.toml
    assert complete("lmcockpit --resume ", workdir) == runs
    assert complete("lmcockpit --run --resume runs/d", workdir) == runs[1:]
    assert complete("lmcockpit chat ", workdir) == runs
    assert complete("lmcockpit export ", workdir) == runs
    # below a run folder, its folders (a checkpoint); elsewhere, folders
    assert complete("lmcockpit chat runs/cpu-20261123-084716/", workdir) == ["runs/cpu-20261123-084716/checkpoints/"]
    assert complete("lmcockpit export runs/cpu-20261123-084716 c", workdir) == ["corpus/"]


@pytest.mark.slow
def test_each_command_completes_its_own_flags_and_choices(workdir):
    assert complete("lmcockpit chat --t", workdir) == ["--temperature", "--top-k", "--top-p"]
    assert complete("lmcockpit presets --", workdir) == ["--help", "--memory"]
    assert complete("lmcockpit completion ", workdir) == ["bash", "zsh", "fish"]
    assert complete("lmcockpit help ", workdir) == [*COMMANDS, "config"]  # and the config keys' listing
    assert complete("lmcockpit --res", workdir) == ["--resume"]


@pytest.mark.slow
def test_data_prepare_and_info_complete_to_presets_and_config_keys(workdir):
    for action in ("prepare", "info"):
        assert set(complete(f"lmcockpit data {action} ", workdir)) == {*shipped_presets(), "mine.toml"}, action
        assert complete(f"lmcockpit data {action} cpu --set training.max_s", workdir) == ["training.max_steps="]


@pytest.mark.slow
@pytest.mark.parametrize("line", ["lmcockpit ", *(f"lmcockpit {name} " for name in COMMANDS)])
def test_completion_imports_no_torch_transformers_or_numpy(workdir, line):
    """Every Tab starts the process: it must stay the front-end's quick start."""
    proc = lmcockpit("-X", "importtime", "-m", "lmcockpit.tui.cli", cwd=workdir, _ARGCOMPLETE="1",
                     COMP_LINE=line, COMP_POINT=str(len(line)), _ARGCOMPLETE_STDOUT_FILENAME=os.devnull)
    assert proc.returncode == 0
    imported = {row.rsplit("|", 1)[-1].strip() for row in proc.stderr.splitlines() if row.startswith("import time:")}
    assert len(imported) > 50  # -X importtime did report
    assert {name.split(".")[0] for name in imported} & {"torch", "transformers", "numpy"} == set()


@pytest.mark.slow
def test_the_bash_script_completes_through_the_installed_command(workdir):
    """The printed script and the installed `lmcockpit` agree: bash runs the script's completion
    function as it does on Tab, and gets the command's own answer."""
    installed = Path(sys.executable).parent / "lmcockpit"
    script = cli("completion", "bash").stdout
    probe = script + '\nCOMP_LINE="lmcockpit chat r"; COMP_POINT=16; COMP_WORDS=(lmcockpit chat r); COMP_CWORD=2\n' \
        '_python_argcomplete lmcockpit r chat\nprintf "%s\\n" "${COMPREPLY[@]}"\n'
    proc = subprocess.run(["bash", "-c", probe], cwd=workdir, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{installed.parent}{os.pathsep}{os.environ['PATH']}"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["runs/cpu-20261123-084716", "runs/debug-20261124-101500"]


# ------------------------------------------------------------------------------------ ps
@pytest.mark.slow
def test_ps_on_an_80_column_terminal_gives_each_run_one_line(tmp_path, terminal):
    """`lmcockpit ps` at 80 columns split a run's folder over four lines (every column folded):
    now each run is a line, its folder cut from the left (its name, at the end, whole); the
    target forecast and a dead run's resume command, too long for a column, follow whole."""
    import socket
    import time

    from lmcockpit.core.process import live

    deep = tmp_path / "a-project-folder-with-a-long-name" / "experiments" / "runs"
    running, dead = deep / "gpt2-fineweb-20261123-120000", deep / "cpu-20261123-131614"
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that has ended: its run is dead
    forecast = "val 3.10 at ~step 270 (240–1,600), in under a minute"
    for run, pid, state in ((running, os.getpid(), "running"), (dead, gone.pid, "running")):
        run.mkdir(parents=True)
        live.LiveRecord(str(run), pid, socket.gethostname(), str(run / live.SOCKET), preset=run.name.rsplit("-", 2)[0],
                        state=state, step=240, max_steps=18900, loss=3.0653, eta_s=131.0, viewers=2,
                        started=time.time(), target=forecast if run == running else "").write()
        live.register(run)
    try:
        code, out = terminal("ps", size=(80, 24)).end()
    finally:
        for run in (running, dead):
            live.forget(run)
    assert code == 0, out
    lines = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line).rstrip() for line in out.splitlines()]
    row = next(line for line in lines if running.name in line)
    assert re.fullmatch(rf"…(\S*/)?{running.name} +240/18900 +3\.065 +0:02:11 +2 +running", row), row
    row = next(line for line in lines if dead.name in line and "resume" not in line)
    assert re.fullmatch(rf"…\S*/{dead.name} +240/18900 +3\.065 +– +– +dead", row), row
    assert f"{running}: target {forecast}" in out
    assert f"dead: lmcockpit --run --resume {dead}" in out.replace("\r\n", "")
    assert all(len(line) <= 80 for line in lines[:4]), lines  # the header, its rule and the two runs

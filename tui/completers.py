"""What each argument of `lmcockpit` completes to on Tab: commands, presets, run folders, config keys.

Commands, shipped presets, run folders,
config keys. Each is an argcomplete completer (called with the word typed so far as `prefix`),
set on an argument as `parser.add_argument(...).completer = ...`; a mapping's values are the
descriptions zsh and fish show beside each completion.

Every shell Tab runs the `lmcockpit` process once, so all of this reads the disk and the config
dataclasses only, quickly, and imports nothing heavy.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..core.config import choices_of, key_help, read_toml, shipped_presets, toml_value
from ..core.run.folder import CONFIG
from .commands import COMMANDS

RUNS = "runs"  # where runs go by default (core.run.folder.default_run_dir), relative to the cwd


def paths(prefix: str, keep_file=lambda name: True) -> list[str]:
    """Folders (with a trailing `/`, so the shell lets one go on typing) and the files that
    `keep_file` accepts, under the folder `prefix` is in; hidden ones only once a `.` is typed."""
    folder, start = os.path.split(prefix)
    try:
        names = os.listdir(os.path.expanduser(folder) or ".")
    except OSError:
        return []
    found = []
    for name in sorted(names):
        if not name.startswith(start) or (name.startswith(".") and not start.startswith(".")):
            continue
        shown = os.path.join(folder, name)
        if os.path.isdir(os.path.expanduser(shown)):
            found.append(shown + "/")
        elif keep_file(name):
            found.append(shown)
    return found


def directories(prefix: str, **_) -> list[str]:
    return paths(prefix, keep_file=lambda name: False)


def presets(prefix: str, **_) -> dict[str, str]:
    """Shipped preset names, and preset TOML files (their folders too, once the word is a path)."""
    found = {name: preset_line(path) for name, path in sorted(shipped_presets().items())}
    tomls = paths(prefix, keep_file=lambda name: name.endswith(".toml"))
    if not ("/" in prefix or prefix.startswith((".", "~"))):  # a bare word: the TOML files here, not every folder
        tomls = [p for p in tomls if not p.endswith("/")]
    return found | dict.fromkeys(tomls, "")


def preset_line(path: Path) -> str:
    gpu = read_toml(path).get("hardware", {}).get("gpu_class", "cpu")
    return f"shipped preset, sized for {'the CPU' if gpu == 'cpu' else gpu}"


def commands_and_presets(prefix: str, parser, parsed_args, **_) -> dict[str, str]:
    """The bare command's positional: a preset to open the cockpit on, or, as the first word (no
    flag given yet: every value still its default), a command."""
    first = all(value == parser.get_default(key) for key, value in vars(parsed_args).items())
    return (command_names(prefix) if first else {}) | presets(prefix)


def command_names(prefix: str, **_) -> dict[str, str]:
    return {name: command.summary for name, command in COMMANDS.items()}


def run_folders(prefix: str, **_) -> list[str]:
    """The run folders under `runs/` while the word can still lead to one; below one (its
    checkpoints) or elsewhere, folders."""
    runs = Path(RUNS)
    if (f"{RUNS}/".startswith(prefix) or prefix.startswith(f"{RUNS}/")) and "/" not in prefix[len(RUNS) + 1:]:
        found = sorted(f"{RUNS}/{p.name}" for p in runs.iterdir() if (p / CONFIG).is_file()) if runs.is_dir() else []
        if found:
            return found
    return directories(prefix)


def config_keys(prefix: str, **_) -> dict[str, str]:
    """`--set` completes to `section.key=` for every key, each with its type, default and help
    (config.key_help, from the keys' declarations); after the `=`, the values a choice or a
    boolean can take."""
    key, eq, _ = prefix.partition("=")
    rows = {row.key: row for row in key_help() if "[]" not in row.key}  # a mixture part's keys are no --set's
    if not eq:
        return {f"{name}=": f"{row.type}, default {row.default}: {row.help}" for name, row in rows.items()}
    if key not in rows:
        return {}
    row = rows[key]
    values = (True, False) if row.type == "bool" else choices_of(key)
    return {f"{key}={str(v).lower() if isinstance(v, bool) else v}": "the default" if toml_value(v) == row.default
            else "" for v in values}

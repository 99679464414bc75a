"""What each argument of `lmcockpit` completes to on Tab: commands, presets, run folders, config keys.

Commands, shipped presets, run folders,
config keys. Each is an argcomplete completer (called with the word typed so far as `prefix`),
set on an argument as `parser.add_argument(...).completer = ...`; a mapping's values are the
descriptions zsh and fish show beside each completion.

Every shell Tab runs the `lmcockpit` process once, so all of this reads the disk and the config
dataclasses only, quickly, and imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from pathlib import Path

from ..core.config import SECTIONS, read_toml, shipped_presets
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
    """`--set` completes to `section.key=` for every field of the config dataclasses, each with its
    type and default; after the `=`, the values a choice or a boolean can take."""
    key, eq, _ = prefix.partition("=")
    fields = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            fields[f"{section}.{f.name}"] = (hints[f.name], default_of(f))
    if not eq:
        return {f"{name}=": f"{describe(hint)}, default {json.dumps(default)}"
                for name, (hint, default) in fields.items()}
    if key not in fields:
        return {}
    hint, default = fields[key]
    if hint is bool:
        values = ["true", "false"]
    elif typing.get_origin(hint) is typing.Literal:
        values = list(typing.get_args(hint))
    else:
        return {}
    return {f"{key}={value}": "the default" if value in (default, str(default).lower()) else "" for value in values}


def default_of(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def describe(hint) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return " | ".join(map(str, typing.get_args(hint)))
    return getattr(hint, "__name__", str(hint))

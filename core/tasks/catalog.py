"""What a name in `eval.tasks` (or `lmcockpit eval --tasks`) stands for, read into tasks.

A name is a built-in task (`python-functions`, `python-functions-chat`), a task on the Hugging Face Hub (`hellaswag`,
`arc_easy`, ...: hub_tasks.py), `core:PATH` (the CORE tasks of a local bundle, core_bundle.py),
or the path of a task file (files.py): a name with a path separator or a `.json`/`.jsonl`
suffix, or one that names a file. Anything else is refused with the nearest
names, before any run folder is made: `check` runs on the front-end.
Torch: never.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path

from ..config import Config, ConfigError
from . import core_bundle, hub_tasks, python_functions, python_functions_chat
from .files import read_task
from .items import Task

# name → (what makes it, what checks it can be made for a run without making it)
BUILT_IN: dict[str, tuple[Callable[[Config], Task], Callable[[Config], None]]] = {
    python_functions.NAME: (python_functions.task, python_functions.check),
    python_functions_chat.NAME: (python_functions_chat.task, python_functions_chat.check)}
FILE_SUFFIXES = (".jsonl", ".json")


def is_file_name(name: str) -> bool:
    return "/" in name or name.endswith(FILE_SUFFIXES) or name.startswith(("~", ".")) or Path(name).is_file()


def load_task(name: str, cfg: Config) -> Task:
    if name in BUILT_IN:
        task = BUILT_IN[name][0](cfg)
    elif name in hub_tasks.HUB:
        task = hub_tasks.read_task(name)
    elif is_file_name(name):
        task = read_task(Path(name).expanduser())
    else:
        near = difflib.get_close_matches(name, [*BUILT_IN, *hub_tasks.HUB], n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(near)}?" if near else ""
        raise ConfigError(f"eval.tasks: no task named {name!r}{hint} (built in: {', '.join(BUILT_IN)}; from the "
                          f"Hub: {', '.join(hub_tasks.HUB)}; core:PATH for a CORE bundle; or a .jsonl task file)")
    if not task.items:
        raise ConfigError(f"eval.tasks: {name} has no items to score")
    return task


def load_tasks(names: list[str], cfg: Config) -> list[Task]:
    named = [(name, task) for name in names for task in
             (core_bundle.read_bundle(Path(name[len(core_bundle.PREFIX):]).expanduser())
              if name.startswith(core_bundle.PREFIX) else [load_task(name, cfg)])]
    tasks = [task for _, task in named]
    seen: dict[str, str] = {}
    for name, task in named:
        if task.name in seen:
            raise ConfigError(f"eval.tasks: {seen[task.name]} and {name} are both named {task.name!r}; "
                              "rename one file")
        seen[task.name] = name
    return tasks


def check(cfg: Config) -> None:
    """Every task of the run's config checked, so a mistake ends the run before it starts: a file
    read whole, a built-in one asked whether it can be made, training.target_task one of them."""
    files = [name for name in cfg.eval.tasks if name not in BUILT_IN]
    for name in cfg.eval.tasks:
        if name in BUILT_IN:
            BUILT_IN[name][1](cfg)
    named = load_tasks(files, cfg)
    aimed = cfg.training.target_task
    names = [name for name in cfg.eval.tasks if name in BUILT_IN] + [task.name for task in named]
    if aimed and aimed not in names:
        raise ConfigError(f"training.target_task = {aimed!r}: not a task of eval.tasks (its tasks: "
                          f"{', '.join(names) or 'none'})")
    if len(set(cfg.eval.tasks)) < len(cfg.eval.tasks):
        raise ConfigError(f"eval.tasks: {cfg.eval.tasks}: a task is listed twice")

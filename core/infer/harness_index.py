"""Where each of lm-eval's own tasks is defined, kept between calls: naming one skips its index.

lm-eval finds a task by name by reading all of its own task files (14,683 in 0.4.13: 4.6 CPU-s
on 2 Xeon cores, about 12 on slower ones), and every `eval --harness hellaswag` paid that before
its first item. The first call that indexes them writes each name's kind and folder here, as
JSON, under the token caches' folder; a later call indexes only the folders of the tasks it
names, and judges a name against the names kept (a typo is refused at once, with the near ones).
A group or a tag, whose tasks may be defined in other folders, still takes the whole index.

What is kept is lm-eval's, found again only inside lm-eval's own tasks folder, and only while
that folder is as it was (its version, and the number and newest change of its files: a task
added or edited by hand, or another install, indexes it all again). The file is read only as the
user's own (safe_files.read_own: no link, nobody else's, nobody else may write it).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..run.safe_files import cache_home, read_own, write_whole

CACHE_FILE = "lm-eval-tasks.json"
TASK = "task"  # the kind of a name defined by one task file (the others: group, tag, python task)


def cache_path() -> Path:
    """In the folder the token caches default to ($XDG_CACHE_HOME/lmcockpit)."""
    return cache_home() / CACHE_FILE


def tasks_root() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent.resolve()


def fingerprint(root: Path) -> str:
    """lm-eval's version, its tasks folder, and the number and newest change of the files in it:
    a walk of stat calls (about 0.1 s), against the seconds of reading every file."""
    from importlib.metadata import version

    count, newest = 0, 0
    stack = [str(root)]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                else:
                    count += 1
                    newest = max(newest, entry.stat(follow_symlinks=False).st_mtime_ns)
    return f"lm-eval {version('lm_eval')} | {root} | {count} files | newest {newest}"


@dataclass(frozen=True)
class TaskIndex:
    kinds: dict[str, str]  # every name lm-eval knows: its kind
    folders: dict[str, Path]  # a task's folder, for the names of kind TASK

    def folder(self, name: str) -> Path | None:
        """The folder that defines task `name`, where indexing it alone finds all of it; None for a
        group or tag (their tasks may be anywhere) or a name this index does not hold."""
        return self.folders.get(name) if self.kinds.get(name) == TASK else None


def load(root: Path, print_: str) -> TaskIndex | None:
    """The kept index of the tasks folder `root` as `print_` (its fingerprint) finds it now;
    None when there is none, it is another's or of another install, or it is damaged."""
    try:
        kept = json.loads(read_own(cache_path()))
        if kept["fingerprint"] != print_:
            return None
        kinds, folders = {}, {}
        for name, (kind, folder) in kept["tasks"].items():
            kinds[str(name)] = str(kind)
            if kind == TASK:
                path = (root / folder).resolve()
                if not path.is_relative_to(root):  # only lm-eval's own folders are ever indexed
                    return None
                folders[str(name)] = path
        return TaskIndex(kinds, folders)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save(manager, root: Path, print_: str) -> None:
    """Keep what `manager` (a TaskManager over lm-eval's own tasks) indexed. A cache folder that
    cannot be written costs the next call the index, nothing more."""
    tasks = {}
    for name, entry in manager.task_index.items():
        path = Path(entry.yaml_path).resolve() if entry.yaml_path else None
        if path is None or not path.is_relative_to(root):
            continue  # the user's own, from a path given beside lm-eval's: theirs to name each time
        kind = entry.kind.name.lower()
        tasks[name] = [kind, str(path.parent.relative_to(root)) if kind == TASK else ""]
    try:
        cache_path().parent.mkdir(parents=True, exist_ok=True)
        write_whole(cache_path(), json.dumps({"fingerprint": print_, "tasks": tasks}) + "\n")
    except OSError:
        pass

"""The CORE tasks from a local copy of the bundle nanochat scores (`core:PATH` in `eval.tasks`).

The bundle's layout, as DCLM ships it and nanochat reads it:
* `core.yaml`: `icl_tasks`, each with a `label`, a `dataset_uri` under `eval_data/`, an
  `icl_task_type` (multiple_choice, schema or language_modeling), `num_fewshot` (a list; its first
  count is used) and a `continuation_delimiter` (default " ");
* `eval_meta_data.csv`: each task's `Random baseline`, in percent, under `Eval Task`;
* `eval_data/…jsonl`: multiple choice `{"query", "choices", "gold"}`, schema `{"context_options",
  "continuation", "gold"}`, language modelling `{"context", "continuation"}`.

Each task keeps its label as its name and its random baseline as its chance; CORE is the mean of
their centred accuracies (items.core_score). A language-modelling context is stripped of
surrounding whitespace, as nanochat does: the data holds trailing spaces that would otherwise
merge into the continuation's first token. `core.yaml` is read by bounded_yaml.BoundedLoader (a
safe loader, its aliases counted, its nesting bounded); a `dataset_uri` must name a file under
`eval_data/`, its links followed.
Torch: never.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

from ..config import ConfigError, shown
from . import reading
from .files import item_from_row, json_rows
from .items import CORE_GROUP, KINDS, LANGUAGE_MODELING, MULTIPLE_CHOICE, SCHEMA, Task

PREFIX = "core:"
FIELDS = {MULTIPLE_CHOICE: {"query", "choices", "gold"}, SCHEMA: {"context_options", "continuation", "gold"},
          LANGUAGE_MODELING: {"context", "continuation"}}
RENAMED = {MULTIPLE_CHOICE: {"query": "context"}, SCHEMA: {"context_options": "contexts"}, LANGUAGE_MODELING: {}}  # to files.py's


def read_bundle(folder: Path) -> list[Task]:
    config = _config(folder / "core.yaml")
    baselines = _baselines(folder / "eval_meta_data.csv")
    tasks = []
    for number, entry in enumerate(config, 1):
        where = f"{folder / 'core.yaml'}: icl_tasks[{number}]"
        if not isinstance(entry, dict) or not {"label", "dataset_uri", "icl_task_type"} <= entry.keys():
            raise ConfigError(f"{where}: expected label, dataset_uri and icl_task_type")
        label, kind = str(entry["label"]), entry["icl_task_type"]
        if kind not in KINDS:
            raise ConfigError(f"{where}: icl_task_type {kind!r}: expected one of {', '.join(KINDS)}")
        if label not in baselines:
            raise ConfigError(f"{folder / 'eval_meta_data.csv'}: no random baseline for {label!r}")
        shots = entry.get("num_fewshot", [0])
        shots = shots[0] if isinstance(shots, list) and shots else shots
        if not isinstance(shots, int) or shots < 0:
            raise ConfigError(f"{where}: num_fewshot {entry.get('num_fewshot')!r}: expected a list of counts")
        items = tuple(_items(_data_file(folder, entry["dataset_uri"], where), kind))
        tasks.append(Task(label, kind, items, fewshot=shots, delimiter=str(entry.get("continuation_delimiter", " ")),
                          chance=baselines[label] / 100, group=CORE_GROUP))
    if not tasks:
        raise ConfigError(f"{folder / 'core.yaml'}: lists no icl_tasks")
    return tasks


def _data_file(folder: Path, uri, where: str) -> Path:
    """The file under eval_data/ that `dataset_uri` names, its links followed, refused if it is
    anywhere else: a bundle is a download, and `../../../../dev/zero` is a name it can hold."""
    data = folder / "eval_data"
    path = Path(os.path.realpath(data / uri)) if isinstance(uri, str) and uri else None
    if path is None or not path.is_relative_to(os.path.realpath(data)):
        raise ConfigError(f"{where}: dataset_uri {shown(uri)}: expected the path of a file under {data}")
    return path


def _config(path: Path) -> list:
    from .bounded_yaml import load_yaml

    try:
        config = load_yaml(path)
    except FileNotFoundError:
        raise ConfigError(f"eval.tasks: {path}: no such file; core:PATH names a CORE bundle's folder "
                          "(core.yaml, eval_meta_data.csv, eval_data/)") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None
    if not isinstance(config, dict) or not isinstance(config.get("icl_tasks"), list):
        raise ConfigError(f"{path}: expected a mapping with an icl_tasks list")
    return config["icl_tasks"]


def _baselines(path: Path) -> dict[str, float]:
    try:
        rows = list(csv.DictReader(io.StringIO(reading.read_text(path), newline="")))
    except FileNotFoundError:
        raise ConfigError(f"eval.tasks: {path}: no such file (each CORE task's random baseline)") from None
    except (OSError, csv.Error) as e:
        raise ConfigError(f"{path}: not readable as CSV ({e})") from None
    out = {}
    for number, row in enumerate(rows, 2):
        try:
            out[row["Eval Task"]] = float(row["Random baseline"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{path}:{number}: expected an 'Eval Task' and a numeric 'Random baseline'") from None
    return out


def _items(path: Path, kind: str):
    for where, row in json_rows(path, "no such task file (named by core.yaml)"):
        if not FIELDS[kind] <= row.keys():
            raise ConfigError(f"{where}: a {kind.replace('_', ' ')} item of CORE's needs "
                              f"{', '.join(sorted(FIELDS[kind]))}")
        row = {RENAMED[kind].get(key, key): value for key, value in row.items() if key in FIELDS[kind]}
        if kind == LANGUAGE_MODELING and isinstance(row.get("context"), str):
            row["context"] = row["context"].strip()
        yield item_from_row(row, kind, where)

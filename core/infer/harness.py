"""A checkpoint scored by EleutherAI's lm-evaluation-harness: `lmcockpit eval --harness TASK,...`.

The field's standard numbers from the field's standard tool, not a copy of it: the checkpoint is
exported as the Qwen3ForCausalLM folder `lmcockpit export` writes (export.py), into a private
temporary folder removed afterwards, and the harness loads it with its own `hf` model, as it
would any model on the Hub. Its tasks are its own (`hellaswag`, `arc_easy`, a group such as
`mmlu`) or a task YAML file of the user's, whose folder joins the harness's include path (a local
`dataset_path: json` with `data_files` runs offline).

Everything the user typed is checked before the model is exported: lm-eval installed (an optional
extra), every name known to the harness (nearest names offered), every task's dataset loaded
(offline with nothing cached: the task named and how to fetch it). Torch: through lm-eval, when
`score` runs.
"""

from __future__ import annotations

import difflib
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError

INSTALL = "pip install 'lmcockpit[harness]'"
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class HarnessTasks:
    names: list[str]  # as the harness knows them: a YAML file's `task:` in place of its path
    include: list[str]  # folders of the user's task files
    manager: object  # lm_eval.tasks.TaskManager over the harness's tasks and `include`


def _task_name(path: Path) -> str:
    """A task YAML file's `task:`. The harness's files carry tags of its own (`!function`), which
    safe_load refuses: those are read as plain strings, nothing of the file is run here."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        doc = yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)  # a SafeLoader: constructs no objects
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"--harness {path}: not a readable task YAML file ({type(e).__name__}: {e})") from None
    name = doc.get("task") if isinstance(doc, dict) else None
    if not isinstance(name, str) or not name:
        raise ConfigError(f"--harness {path}: has no `task: NAME` line, which names an lm-eval task")
    return name


def resolve(specs: list[str], log: Callable[[str], None] = print) -> HarnessTasks:
    """The harness's tasks for `specs` (names or YAML files), each dataset loaded once so that a
    missing one is refused now, not after the export."""
    try:
        import lm_eval  # noqa: F401 - imported for the check; the harness is an optional extra
        from lm_eval.tasks import TaskManager, get_task_dict
    except ImportError:
        raise ConfigError(f"--harness: EleutherAI's lm-evaluation-harness is not installed; {INSTALL}") from None
    names, include = [], []
    for spec in specs:
        path = Path(spec).expanduser()
        if spec.endswith((".yaml", ".yml")) or path.is_file():
            if not path.is_file():
                raise ConfigError(f"--harness {spec}: no such task file")
            names.append(_task_name(path))
            if str(path.absolute().parent) not in include:
                include.append(str(path.absolute().parent))
        else:
            names.append(spec)
    log("eval: indexing lm-eval's tasks…")
    manager = TaskManager(include_path=include or None)
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.7)
            hint = f"; did you mean {', '.join(near)}?" if near else "; `lm-eval ls tasks` lists them"
            raise ConfigError(f"--harness {name}: not a task lm-eval knows{hint}")
    for name in names:
        log(f"eval: loading {name}'s dataset…")
        try:
            get_task_dict([name], manager)
        except Exception as e:  # noqa: BLE001 - datasets, the Hub and the user's YAML each raise their own
            first = (str(e).strip().splitlines() or [""])[0]
            raise ConfigError(f"--harness {name}: its dataset could not be loaded ({type(e).__name__}: {first}); "
                              f"offline it must be in the datasets cache already: run this once on a machine with "
                              f"a network, then copy its HF_HOME here") from None
    return HarnessTasks(names, include, manager)


def _metrics(row: dict) -> dict[str, float]:
    """{"acc": 0.31, "acc_stderr": 0.01, ...} from the harness's {"acc,none": ..., "alias": ...}."""
    out = {}
    for key, value in row.items():
        metric, _, filt = key.partition(",")
        if filt and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[metric if filt == "none" else f"{metric},{filt}"] = float(value)
    return out


def score(ckpt: Path, tasks: HarnessTasks, at_most: int = 0, device: str = "auto", precision: str = "fp32",
          batch_size: int = 16, log: Callable[[str], None] = print) -> dict[str, dict[str, float]]:
    """{task: {metric: value, ..., "items": N}} as the harness scores the export of `ckpt`;
    `at_most`: the harness's `limit`, its first N items of each task."""
    import torch
    from lm_eval import simple_evaluate

    from .export import export

    if precision not in DTYPES:
        raise ConfigError(f"--precision {precision}: expected one of {', '.join(DTYPES)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    scratch = Path(tempfile.mkdtemp(prefix="lmcockpit-harness-"))  # 0700: the export is the user's alone
    try:
        exported = export(str(ckpt), str(scratch / "model"), log=log)
        log(f"eval: lm-eval {', '.join(tasks.names)} on step {exported.step}, {device}, {precision}")
        out = simple_evaluate(model="hf", model_args={"pretrained": str(exported.out), "dtype": DTYPES[precision]},
                              tasks=tasks.names, task_manager=tasks.manager, device=device, batch_size=batch_size,
                              limit=at_most or None, log_samples=False)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    counts = out.get("n-samples", {})
    results = {}
    for name, row in out["results"].items():
        results[name] = _metrics(row)
        if name in counts:
            results[name]["items"] = counts[name]["effective"]
    return results

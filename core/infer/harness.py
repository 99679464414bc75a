"""A checkpoint scored by EleutherAI's lm-evaluation-harness: `lmcockpit eval --harness TASK,...`.

The field's standard numbers from the field's standard tool, not a copy of it: the checkpoint is
exported as the Qwen3ForCausalLM folder `lmcockpit export` writes (export.py), into a private
temporary folder removed afterwards, and the harness loads it with its own `hf` model, as it
would any model on the Hub. Its tasks are its own (`hellaswag`, `arc_easy`, a group such as
`mmlu`) or a task YAML file of the user's (a local `dataset_path: json` with `data_files` runs
offline). Only the files the user named are read: each YAML, merged with what it `include:`s, and
the Python file beside it that a `!function` names, copied into a private folder that is the
harness's only include path (given the folder instead, the harness would load every YAML in it, and
import the Python any of them names). A `!function` runs that Python as the user: a file another
account could change is refused.

Everything the user typed is checked before the model is exported: lm-eval installed (an optional
extra), every name known to the harness (nearest names offered), every task's dataset loaded
(offline with nothing cached: the task named and how to fetch it). Torch: through lm-eval, when
`score` runs.
"""

from __future__ import annotations

import difflib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..config import ConfigError, shown
from ..tasks import bounded_yaml, reading
from . import harness_index

INSTALL = "pip install 'lmcockpit[harness]'"
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
MAX_TASK_FILES = 100  # a named YAML and all it includes


@dataclass(frozen=True)
class HarnessTasks:
    names: list[str]  # as the harness knows them: a YAML file's `task:` in place of its path
    include: list[str]  # the private folder of the user's task files, copied: the harness's include path
    manager: object  # lm_eval.tasks.TaskManager over the harness's tasks and `include`

    def close(self) -> None:
        """The private copies removed, once the harness has scored (it reads them again to score)."""
        for folder in self.include:
            shutil.rmtree(folder, ignore_errors=True)


@dataclass(frozen=True)
class Function:
    """A `!function MODULE.NAME` of a task YAML, kept as text with the folder it is named from:
    the harness imports MODULE.py from that folder (else MODULE from Python's path)."""
    name: str
    folder: Path


class _TaskLoader(bounded_yaml.BoundedLoader):
    folder = Path()  # set per file: the folder its `!function`s are looked for in


def _function(loader: _TaskLoader, node) -> Function:
    if not isinstance(node, yaml.ScalarNode):
        raise bounded_yaml.Refused("!function names a MODULE.FUNCTION, not a list or mapping", node.start_mark)
    return Function(loader.construct_scalar(node), loader.folder)


def _other_tag(loader: _TaskLoader, suffix: str, node) -> None:
    raise bounded_yaml.Refused(f"the tag !{suffix}: the harness reads !function alone", node.start_mark)


_TaskLoader.add_constructor("!function", _function)
_TaskLoader.add_multi_constructor("!", _other_tag)


class _TaskDumper(yaml.SafeDumper):
    pass


_TaskDumper.add_representer(Function, lambda dumper, f: dumper.represent_scalar("!function", f.name))


class _Copier:
    """The user's task files copied into `folder`, a private one the harness reads them from: each
    named YAML with what it includes merged in, as the harness merges it, into one file, and each
    Python file a `!function` names beside it copied under a name of its own. Only these: the
    harness reads every YAML in its include path, and a `!function` in any of them imports the
    Python file beside it, as the user; a folder another account can write would have it run what
    that account planted. Every file read is refused if another account could change it."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.modules: dict[str, str] = {}  # real path of a Python file → its copy's module name
        self.files = 0

    def task(self, spec: str, path: Path, number: int) -> str:
        """The `task:` of the named YAML `path`, written into the folder."""
        cfg = self._merged(spec, path, (), "")
        name = cfg.get("task")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"--harness {spec}: has no `task: NAME` line, which names an lm-eval task")
        text = yaml.dump(self._copied(spec, cfg), Dumper=_TaskDumper, sort_keys=False, allow_unicode=True)
        (self.folder / f"{number}-{Path(path).stem}.yaml").write_text(text, encoding="utf-8")
        return name

    def _read(self, spec: str, path: Path, why: str) -> bytes:
        self.files += 1
        if self.files > MAX_TASK_FILES:
            raise ConfigError(f"--harness {spec}: includes more than {MAX_TASK_FILES} files")
        try:
            fd = reading.open_regular(path)
        except FileNotFoundError:
            raise ConfigError(f"--harness {spec}: {path}{why}: no such file") from None
        except ConfigError as e:
            raise ConfigError(f"--harness {spec}: {e}{why}") from None
        with os.fdopen(fd, "rb") as fh:
            reason = reading.others_can_change(path, os.fstat(fh.fileno()))
            if reason:
                raise ConfigError(f"--harness {spec}: {path}{why}: {reason}; lm-eval runs the Python a task's "
                                  "!function names, so its files must be ones no other account can change: copy "
                                  "them into a folder of your own")
            data = fh.read(reading.MAX_SMALL_BYTES + 1)
        if len(data) > reading.MAX_SMALL_BYTES:
            raise ConfigError(f"--harness {spec}: {path}{why}: larger than "
                              f"{reading.size_text(reading.MAX_SMALL_BYTES)}, more than a task's file")
        return data

    def _merged(self, spec: str, path: Path, seen: tuple[str, ...], why: str) -> dict:
        """The YAML at `path` with its `include:`s merged in, each relative to its folder (links
        followed), as lm_eval.tasks._yaml_loader.load_yaml merges them: in order, the file's own
        keys last, an included file's `task_list` dropped."""
        real = os.path.realpath(path)
        if real in seen:
            raise ConfigError(f"--harness {spec}: {path} includes itself, through {' → '.join(seen)}")
        data = self._read(spec, path, why)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"--harness {spec}: {path}{why}: not UTF-8 text") from None
        loader = type("Loader", (_TaskLoader,), {"folder": Path(real).parent})
        try:
            cfg = bounded_yaml.load_yaml(path, loader, text)
        except ConfigError as e:
            raise ConfigError(f"--harness {spec}: {e}{why}") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"--harness {spec}: {path}{why}: expected a mapping of a task's settings")
        if "include" not in cfg:
            return cfg
        includes = cfg.pop("include")
        merged: dict = {}
        for inc in includes if isinstance(includes, list) else [includes]:
            if not isinstance(inc, str) or not inc:
                raise ConfigError(f"--harness {spec}: {path}: include {shown(inc)}: expected a file's path")
            inc_cfg = self._merged(spec, Path(real).parent / inc, (*seen, real), f" (included by {path})")
            inc_cfg.pop("task_list", None)
            merged.update(inc_cfg)
        merged.update(cfg)
        return merged

    def _copied(self, spec: str, value):
        """`value` with each `!function` naming a Python file beside its YAML renamed to that file's
        copy in the folder; one naming no such file is left to the harness, which imports it from
        Python's path (a module of lm-eval's own, say)."""
        if isinstance(value, dict):
            return {k: self._copied(spec, v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._copied(spec, v) for v in value]
        if not isinstance(value, Function):
            return value
        module, _, fn = value.name.rpartition(".")
        source = value.folder / f"{module.replace('.', '/')}.py"
        if not module or not os.path.lexists(source):
            return value
        real = os.path.realpath(source)
        if real not in self.modules:
            data = self._read(spec, source, f" (named by !function {value.name})")
            self.modules[real] = f"_lmcockpit_{len(self.modules) + 1}_{Path(real).stem}"
            (self.folder / f"{self.modules[real]}.py").write_bytes(data)
        return Function(f"{self.modules[real]}.{fn}", self.folder)


def _is_file_spec(spec: str) -> bool:
    path = Path(spec).expanduser()
    return spec.endswith((".yaml", ".yml")) or (os.path.lexists(path) and not path.is_dir())


def resolve(specs: list[str], log: Callable[[str], None] = print) -> HarnessTasks:
    """The harness's tasks for `specs` (names or YAML files), each dataset loaded once so that a
    missing one is refused now, not after the export. The YAML files are copied into a private
    folder, the harness's only include path (see _Copier); HarnessTasks.close removes it."""
    for spec in specs:  # before lm_eval's import, which takes seconds
        if _is_file_spec(spec) and not os.path.lexists(Path(spec).expanduser().absolute()):
            raise ConfigError(f"--harness {spec}: no such task file")
    try:
        import lm_eval  # noqa: F401 - imported for the check; the harness is an optional extra
        from lm_eval.tasks import get_task_dict
    except ImportError:
        raise ConfigError(f"--harness: EleutherAI's lm-evaluation-harness is not installed; {INSTALL}") from None
    names, include, named, copier = [], [], {}, None
    try:
        for spec in specs:
            if not _is_file_spec(spec):
                names.append(spec)
                continue
            path = Path(spec).expanduser().absolute()
            if copier is None:
                include.append(tempfile.mkdtemp(prefix="lmcockpit-harness-tasks-"))  # 0700: the user's alone
                copier = _Copier(Path(include[0]))
            name = copier.task(spec, path, len(named) + 1)
            if name in named:
                raise ConfigError(f"--harness {spec}: its task {name!r} is {named[name]}'s too; rename one")
            named[name] = spec
            names.append(name)
        manager = task_manager([n for n in names if n not in named], include, log)
        known = set(manager.all_tasks)
        for name in names:
            if name not in known:
                raise ConfigError(f"--harness {name}: not a task lm-eval knows{_near(name, known)}")
        for name in names:
            log(f"eval: loading {name}'s dataset…")
            try:
                get_task_dict([name], manager)
            except Exception as e:  # noqa: BLE001 - datasets, the Hub and the user's YAML each raise their own
                first = (str(e).strip().splitlines() or [""])[0]
                raise ConfigError(f"--harness {name}: its dataset could not be loaded ({type(e).__name__}: {first}); "
                                  f"offline it must be in the datasets cache already: run this once on a machine "
                                  f"with a network, then copy its HF_HOME here") from None
    except BaseException:
        HarnessTasks(names, include, None).close()
        raise
    return HarnessTasks(names, include, manager)


def task_manager(builtin: list[str], include: list[str], log: Callable[[str], None]):
    """A TaskManager over the user's task files (`include`) and lm-eval's tasks named in `builtin`.
    lm-eval's own 14,683 task files take seconds of CPU to index (harness_index): the user's files
    alone need none of them (a file is one task, whose `include:`s are merged into its copy), and
    a named task, once they were indexed, needs only its folder's."""
    from lm_eval.tasks import TaskManager

    if not builtin:
        return TaskManager(include_path=include or None, include_defaults=False)
    root = harness_index.tasks_root()
    print_ = harness_index.fingerprint(root)
    kept = harness_index.load(root, print_)
    if kept is not None:
        for name in builtin:
            if name not in kept.kinds:
                raise ConfigError(f"--harness {name}: not a task lm-eval knows{_near(name, set(kept.kinds))}")
        folders = [kept.folder(name) for name in builtin]
        if None not in folders:
            return TaskManager(include_path=[*map(str, dict.fromkeys(folders)), *include], include_defaults=False)
    log("eval: indexing lm-eval's tasks…")
    manager = TaskManager(include_path=include or None, include_defaults=True)
    harness_index.save(manager, root, print_)
    return manager


def _near(name: str, known: set[str]) -> str:
    near = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.7)
    return f"; did you mean {', '.join(near)}?" if near else "; `lm-eval ls tasks` lists them"


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

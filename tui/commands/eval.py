"""`lmcockpit eval RUN_OR_CHECKPOINT`: a checkpoint's accuracy on downstream tasks.

The tasks are those `eval.tasks` names (core/tasks/catalog.py): the built-in `python-functions`, a
JSON-lines task file, a CORE bundle, a named Hub task. `--harness` hands the checkpoint's export to
EleutherAI's lm-evaluation-harness instead (core/infer/harness.py), or as well when `--tasks` is
given too. Everything the user typed is checked before the model loads (torch is imported only
then); the log goes to stderr, the tables (or with `--json` only the JSON) to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.table import Table

from . import command_parser
from ..completers import run_folders
from ..usage import UsageError, new_console

FORMAT = """\
a task file holds one JSON object a line, its kind read from its fields:
  multiple choice    {"context": TEXT, "choices": [TEXT, ...], "gold": INDEX}
                     (with "neutral": TEXT, each choice is scored by how much the context lowers
                     its summed loss below its loss after the neutral text)
  schema             {"contexts": [TEXT, ...], "continuation": TEXT, "gold": INDEX}
  language modelling {"context": TEXT, "continuation": TEXT}
A continuation's tokens are those context + continuation adds to context's. A first line without
these fields may set {"fewshot": K, "delimiter": TEXT, "chance": P} (default: zero-shot)."""


def build_parser() -> argparse.ArgumentParser:
    p = command_parser(__name__, description="Score a checkpoint on downstream tasks (the built-in python-functions, "
                       "Hub tasks, a CORE bundle, JSON-lines task files), each item's choice made by the model's "
                       "losses; or by EleutherAI's lm-evaluation-harness.", epilog=FORMAT,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", metavar="RUN_OR_CHECKPOINT", help="a run folder (its latest checkpoint) or a checkpoint folder"
                   ).completer = run_folders
    p.add_argument("--tasks", metavar="TASK,...", default="",
                   help="task names or .jsonl files, comma-separated (default: the run's eval.tasks, else python-functions)")
    p.add_argument("--harness", metavar="TASK,...", default="",
                   help="score with EleutherAI's lm-evaluation-harness (pip install 'lmcockpit[harness]') through the "
                   "Hugging Face export: its task names, or task YAML files; only these unless --tasks is given too")
    p.add_argument("--max-per-task", metavar="N", type=int, default=0,
                   help="score at most N items of each task, a fixed spread of them; with --harness, its first N "
                   "(default: all)")
    p.add_argument("--json", action="store_true",
                   help='print only {"tasks": {NAME: {accuracy, centered, items, indices, predictions, gold}}}: item '
                   'indices[k] of the task (0-based, in its file\'s order) got the choice predictions[k] (-1: none), '
                   'the right one being gold[k]; with --harness, "harness": {TASK: {METRIC: VALUE, ..., items}}')
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"), help="default fp32")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.max_per_task < 0:
        raise UsageError(f"--max-per-task {args.max_per_task}: expected 0 (all) or more")
    from ...core.infer import harness
    from ...core.infer.task_eval import checkpoint_of, resolve, score_checkpoint

    names, harness_specs = (split_list(args.tasks), split_list(args.harness))
    log = new_console(stderr=True, markup=False)
    if harness_specs and not names:
        ckpt, tasks = checkpoint_of(args.path), []
    else:
        ckpt, tasks = resolve(args.path, names)
    harness_tasks = harness.resolve(harness_specs, log=log.print) if harness_specs else None
    try:
        results = score_checkpoint(ckpt, tasks, args.max_per_task, args.device, args.precision,
                                   log=log.print) if tasks else {}
        harness_results = harness.score(ckpt, harness_tasks, args.max_per_task, args.device, args.precision,
                                        log=log.print) if harness_tasks else {}
    finally:
        if harness_tasks:
            harness_tasks.close()
    if args.json:
        out = {"tasks": {task.name: item_by_item(task, results[task.name], args.max_per_task) for task in tasks}}
        print(json.dumps({**out, "harness": harness_results} if harness_tasks else out))
        return 0
    if tasks:
        print_tasks(tasks, results)
    if harness_tasks:
        print_harness(harness_results)
    sys.stdout.flush()
    return 0


def item_by_item(task, result, at_most: int) -> dict:
    """A task's scores, and for each item scored, which it was, the model's choice and the right
    one, side by side: an accuracy can then be checked, and a wrong answer found, item by item."""
    from ...core.tasks.items import subset

    scored = subset(len(task.items), at_most)  # the items score_task scored, in its order
    return {**result.row(), "indices": scored, "predictions": result.predictions,
            "gold": [task.items[i].gold for i in scored]}


def split_list(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def print_tasks(tasks, results) -> None:
    table = Table("task", "kind", "items", "accuracy", "chance", "centered", box=None, header_style="bold")
    for task in tasks:
        r = results[task.name]
        table.add_row(task.name, task.kind.replace("_", " "), str(r.items), f"{r.accuracy:.4f}",
                      f"{task.chance_level():.4f}", f"{r.centered:+.4f}")
    from ...core.tasks.items import core_score

    core = core_score(results, tasks)
    if core is not None:
        table.add_row("CORE", "mean centred", "", "", "", f"{core:+.4f}")
    new_console(markup=False).print(table)


def print_harness(results: dict[str, dict[str, float]]) -> None:
    """A row per task and metric, as lm-eval's own table has them, its standard error beside."""
    table = Table("lm-eval task", "items", "metric", "value", "stderr", box=None, header_style="bold")
    for name, metrics in results.items():
        items = str(int(metrics["items"])) if "items" in metrics else ""
        for metric, value in metrics.items():
            if metric == "items" or metric.split(",")[0].endswith("_stderr"):
                continue
            stderr = metrics.get(metric.replace(",", "_stderr,", 1) if "," in metric else f"{metric}_stderr")
            table.add_row(name, items, metric, f"{value:.4f}", f"±{stderr:.4f}" if stderr is not None else "")
            name = items = ""
    new_console(markup=False).print(table)

"""`lmcockpit eval RUN_OR_CHECKPOINT`: a checkpoint's accuracy on downstream tasks.

The tasks are those `eval.tasks` names (core/tasks/catalog.py): the built-in `python-functions` or
a JSON-lines task file. Everything the user typed is checked before the model loads (torch is
imported only then, by core/infer/task_eval.py); the log goes to stderr, the table (or with
`--json` only the JSON) to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.table import Table

from lmcockpit.tui.commands import command_parser
from lmcockpit.tui.completers import run_folders
from lmcockpit.tui.usage import UsageError, new_console

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
    p = command_parser(__name__, description="Score a checkpoint on downstream tasks: the built-in python-functions "
                       "or JSON-lines task files, each item's choice made by the model's losses.", epilog=FORMAT,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", metavar="RUN_OR_CHECKPOINT", help="a run folder (its latest checkpoint) or a checkpoint folder"
                   ).completer = run_folders
    p.add_argument("--tasks", metavar="TASK,...", default="",
                   help="task names or .jsonl files, comma-separated (default: the run's eval.tasks, else python-functions)")
    p.add_argument("--max-per-task", metavar="N", type=int, default=0,
                   help="score at most N items of each task, a fixed spread of them (default: all)")
    p.add_argument("--json", action="store_true",
                   help='print only {"tasks": {NAME: {accuracy, centered, items, predictions}}}')
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"), help="default fp32")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.max_per_task < 0:
        raise UsageError(f"--max-per-task {args.max_per_task}: expected 0 (all) or more")
    from lmcockpit.core.infer.task_eval import resolve, score_checkpoint

    names = [n.strip() for n in args.tasks.split(",") if n.strip()]
    ckpt, tasks = resolve(args.path, names)
    log = new_console(stderr=True, markup=False)
    results = score_checkpoint(ckpt, tasks, args.max_per_task, args.device, args.precision, log=log.print)
    if args.json:
        print(json.dumps({"tasks": {name: {**r.row(), "predictions": r.predictions} for name, r in results.items()}}))
        return 0
    table = Table("task", "kind", "items", "accuracy", "chance", "centered", box=None, header_style="bold")
    for task in tasks:
        r = results[task.name]
        table.add_row(task.name, task.kind.replace("_", " "), str(r.items), f"{r.accuracy:.4f}",
                      f"{task.chance_level():.4f}", f"{r.centered:+.4f}")
    from lmcockpit.core.tasks.items import core_score

    core = core_score(results, tasks)
    if core is not None:
        table.add_row("CORE", "mean centred", "", "", "", f"{core:+.4f}")
    new_console(markup=False).print(table)
    sys.stdout.flush()
    return 0

"""A checkpoint scored on tasks outside any run: what `lmcockpit eval` does.

It reads only the checkpoint's `model.safetensors`, config and tokenizer (load.py), scores in fp32
unless told otherwise, and every item of a task unless `at_most` says otherwise. The tasks are
resolved (and refused, one line each) before torch is imported.
Torch: when `score_checkpoint` loads the model.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from ..config import ConfigError
from ..run.checkpoint_folder import checkpoint_config, find_checkpoint
from ..tasks import catalog, python_functions
from ..tasks.items import Result, Task

PRECISIONS = ("fp32", "bf16", "fp16")


def checkpoint_of(spec: str) -> Path:
    """find_checkpoint, with a file (a task file put where the run goes, most likely) called a file:
    "no such run folder" would send the user looking for one that is there."""
    path = Path(spec).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{spec}: a file, not a folder: eval takes a run folder or a checkpoint folder"
                          + (f"; a task file is named with --tasks {spec}" if path.suffix == ".jsonl" else ""))
    return find_checkpoint(spec)


def resolve(spec: str, names: list[str]) -> tuple[Path, list[Task]]:
    """The checkpoint `spec` names, and the tasks: `names`, else its run's eval.tasks, else the
    built-in one."""
    ckpt = checkpoint_of(spec)
    cfg = checkpoint_config(ckpt)
    try:
        return ckpt, catalog.load_tasks(names or cfg.eval.tasks or [python_functions.NAME], cfg)
    except ConfigError as e:
        # The catalog names the config key; here the user typed the names after --tasks.
        if names and str(e).startswith("eval.tasks:"):
            raise ConfigError("--tasks:" + str(e).removeprefix("eval.tasks:")) from None
        raise


def score_checkpoint(ckpt: Path, tasks: list[Task], at_most: int = 0, device: str = "auto", precision: str = "fp32",
                     log: Callable[[str], None] = print) -> dict[str, Result]:
    import torch

    from ..tasks import scoring
    from .load import load

    if precision not in PRECISIONS:
        raise ConfigError(f"--precision {precision}: expected one of {', '.join(PRECISIONS)}")
    loaded = load(ckpt, device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is not None and loaded.device.type == "cpu" and dtype == torch.float16:
        raise ConfigError("--precision fp16: not on a CPU; use fp32 or bf16")

    def autocast():
        return torch.autocast(loaded.device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in loaded.tokenizer.encode_batch(texts, add_special_tokens=False)]

    t = loaded.cfg.training
    log(f"eval: step {loaded.step} of {ckpt}, on {loaded.device} in {precision}")
    results = {}
    for task in tasks:
        t0 = time.perf_counter()
        count = min(len(task.items), at_most) if at_most else len(task.items)
        log(f"eval: {task.name}: scoring {items(count)} ({task.kind.replace('_', ' ')}, {task.fewshot}-shot)…")
        results[task.name] = r = scoring.score_task(task, loaded.model, encode, loaded.eos_id, t.seq_len,
                                                    t.micro_batch_size, loaded.device, autocast, at_most=at_most)
        log(f"eval: {task.name}: accuracy {r.accuracy:.4f} of {items(r.items)} in {time.perf_counter() - t0:.1f} s")
    return results


def items(n: int) -> str:
    return f"{n} item" if n == 1 else f"{n} items"

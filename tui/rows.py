"""The rows a command prints and a screen shows alike: the presets' table and a comparison's.

`lmcockpit presets` and the launch screen list the presets from `preset_rows`; `lmcockpit compare`
and the cockpit's compare view show runs side by side from `setting_rows` and `result_rows`. Here,
not in a command's module, because a screen never imports a command.
"""

from __future__ import annotations

from ..core.config import load_config, shipped_presets, toml_value
from ..core.hardware import memory_estimate
from ..core.run import lineage
from ..core.run.anatomy import LABELS, pct
from ..core.run.curves import RunCurves, differing_settings
from .formatting import DASH, fmt_duration

VERDICT_STYLE = {"fits": "green", "tight": "yellow", "does not fit": "red"}


def preset_rows(card: int | None) -> list[tuple[str, str, str, str, str, str]]:
    """(name, GPU class, parameters, tokens/step, estimated peak, verdict) of every shipped preset,
    smallest card first, a class's fine-tuning presets after its pretraining ones; judged against
    `card` bytes, or each preset's own class when None."""
    configs = [(name, load_config(name)[0]) for name in shipped_presets()]
    rows = []
    # a fine-tuning preset after the pretraining ones of its class: it starts from one of their runs
    for name, cfg in sorted(configs, key=lambda nc: (nc[1].hardware.vram_gb, nc[1].data.format == "chat",
                                                     memory_estimate.param_counts(nc[1]).total, nc[0])):
        estimate, verdict = memory_estimate.judge(cfg, card)
        on_gpu = card is not None or cfg.hardware.vram_gb > 0
        rows.append((name, cfg.hardware.gpu_class, f"{memory_estimate.param_counts(cfg).total / 1e6:.1f}M",
                     f"{cfg.tokens_per_step:,}", f"{estimate.total / memory_estimate.GiB:.1f} GiB" + ("" if on_gpu else " RAM"),
                     verdict))
    return rows


def labels(runs: list[RunCurves]) -> list[str]:
    """Each run by its folder's name; by its path where two share a name (runs/a/x and runs/b/x)."""
    names = [r.name for r in runs]
    return [r.name if names.count(r.name) == 1 else str(r.path) for r in runs]


def fmt_loss(value: float | None) -> str:
    return f"{value:.4f}" if value is not None else DASH


def fmt_time(seconds: float) -> str:
    """Training time; under a minute in seconds, where h:mm:ss would say 0:00:00 for short runs."""
    return f"{seconds:.1f}s" if seconds < 60 else fmt_duration(seconds)


Row = tuple[str, list[str]]  # what, then a cell per run


def setting_rows(runs: list[RunCurves]) -> list[Row]:
    """A row per setting the runs differ in (a dash where a run's config lacks it). The CLI and
    the cockpit's compare view show the same rows."""
    return [(key, [toml_value(r.config[key]) if key in r.config else DASH for r in runs])
            for key in differing_settings(runs)]


def result_rows(runs: list[RunCurves]) -> list[Row]:
    return [
        *lineage_rows(runs),
        ("final loss (ema)", [fmt_loss(r.final_loss_ema) for r in runs]),
        ("final loss", [fmt_loss(r.final_loss) for r in runs]),
        ("best val loss", [f"{b[0]:.4f} @ {b[1]}" if (b := r.best_val) else DASH for r in runs]),
        *task_rows(runs),
        ("tokens/s", [f"{t:,.0f}" if (t := r.median_tokens_per_s) is not None else DASH for r in runs]),
        ("time", [fmt_time(r.train_time) if r.has_steps else DASH for r in runs]),
        *anatomy_rows(runs),
        ("steps", [str(r.last_step) if r.has_steps else "0" for r in runs]),
        ("state", [r.status for r in runs]),
    ]


def anatomy_rows(runs: list[RunCurves]) -> list[Row]:
    """Where each run's time went (run/anatomy.py): a row per part of a step and per kind of work
    between steps that any run recorded, as its share of that run's time; a dash where a run has
    none (one from before steps said them)."""
    shares = [dict(r.history.anatomy.shares()) for r in runs]
    names = dict.fromkeys(name for s in shares for name in s)
    return [(f"  {LABELS.get(name, name)}", [pct(s[name]) if name in s else DASH for s in shares]) for name in names]


def lineage_rows(runs: list[RunCurves]) -> list[Row]:
    """"fine-tuned from": a fine-tuning run's base run and step, when any run is one."""
    bases = [lineage.of_config(r.config).removeprefix("fine-tuned from ") for r in runs]
    return [("fine-tuned from", [b or DASH for b in bases])] if any(bases) else []


def task_rows(runs: list[RunCurves]) -> list[Row]:
    """Each task's last accuracy, then CORE: a row for each that any of the runs scored (none
    where none did), a dash where a run did not. A fine-tuning run scored at step 0 shows that
    score, its base's weights', then its last and the gain; its base run, compared beside it and
    not scored on that task itself, shows the step-0 score as its own (the same weights, the same
    items), so `compare BASE FINETUNED` puts both on one line."""
    names = dict.fromkeys(name for r in runs for name in r.last_tasks)
    rows = [(f"{name} accuracy", [task_cell(runs, r, name) for r in runs]) for name in names]
    if any(r.core for r in runs):
        rows.append(("CORE", [fmt_score(r.last_core) for r in runs]))
    return rows


def task_cell(runs: list[RunCurves], run: RunCurves, name: str) -> str:
    if (pair := lineage.task_gains(run.tasks).get(name)) is not None:
        return lineage.fmt_gain(*pair)
    if name in run.last_tasks:
        return fmt_score(run.last_tasks[name])
    for tuned in runs:  # its weights scored at the step 0 of a run fine-tuned from it
        base = tuned.config.get("training.from_checkpoint", "")
        if base and lineage.base_run(base).resolve() == run.path.resolve() and name in lineage.task_gains(tuned.tasks):
            return f"{fmt_score(lineage.task_gains(tuned.tasks)[name][0])} (step 0 of {tuned.name})"
    return DASH


def fmt_score(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else DASH

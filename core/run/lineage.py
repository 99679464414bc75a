"""What a fine-tuning run says of where it came from and what it gained, in the words every view uses.

A fine-tuning run (training.from_checkpoint, set by --from) records its base checkpoint's path and
step; its first evaluation (the eval row at step 0) scores the base's weights on its tasks, so each
task's gain is that row's accuracy against the last. The headless run's last line, `compare` and
the dashboard's title say them alike from here: "fine-tuned from cpu-1 at step 300" and
"python-functions-chat 0.739 → 0.850 (+0.111)".
Torch: never.
"""

from __future__ import annotations

from pathlib import Path

from .folder import CHECKPOINTS


def base_run(from_checkpoint: str) -> Path:
    """The base's run folder: the checkpoint's run where --from named one of a run's checkpoints
    (RUN/checkpoints/step_N), else the checkpoint folder itself."""
    ckpt = Path(from_checkpoint)
    return ckpt.parent.parent if ckpt.parent.name == CHECKPOINTS else ckpt


def fine_tuned_from(from_checkpoint: str, from_step: int) -> str:
    """"fine-tuned from NAME at step N"; "" for a run that starts from nothing (no --from)."""
    if not from_checkpoint:
        return ""
    return f"fine-tuned from {base_run(from_checkpoint).name} at step {from_step}"


def of_config(config) -> str:
    """fine_tuned_from of a run's config: a Config, or the flattened dict compare reads."""
    if isinstance(config, dict):
        return fine_tuned_from(config.get("training.from_checkpoint", ""), config.get("training.from_step", 0))
    if config is None:
        return ""
    return fine_tuned_from(config.training.from_checkpoint, config.training.from_step)


def task_gains(tasks: dict[str, list[tuple[int, float]]]) -> dict[str, tuple[float, float]]:
    """(accuracy at step 0, the last) of each task a run scored at step 0 and later: what a
    fine-tuning run's step-0 row (its base's weights) is for. A run not scored at step 0 has none."""
    return {name: (points[0][1], points[-1][1]) for name, points in tasks.items()
            if len(points) > 1 and points[0][0] == 0}


def fmt_gain(first: float, last: float) -> str:
    return f"{first:.3f} → {last:.3f} ({last - first:+.3f})"


def gains_text(tasks: dict[str, list[tuple[int, float]]]) -> str:
    """"NAME first → last (+gain)" of each task with a step-0 score, joined by ", "; "" for none."""
    return ", ".join(f"{name} {fmt_gain(*pair)}" for name, pair in task_gains(tasks).items())

"""`--resume PATH`: what to continue from, into which folder, with which config.

A run folder continues in place from its latest complete checkpoint (metrics.jsonl loses the
lines past that checkpoint's step, so no step appears twice); a checkpoint folder continues into
a new run folder. The checkpoint's own config is used: `--set` may change the step budget, the
eval/checkpoint/log/sample cadence, where metrics are logged ([logging]), what gets a run past
a loss spike (learning rates, clipping, what to do on a non-finite loss), and what gets it past
an out-of-memory error (micro-batch, accumulation, auto_micro_batch, activation checkpointing);
it refuses the rest (model, data, the sequences a step takes) by name. The number of processes
may change too (2 → 1, 1 → 2, DDP ↔ FSDP). Whatever the split, micro-batch × accumulation ×
processes must stay what it was: accumulation follows the other two unless given. The trainer
draws every step's sequences in the checkpoint's own batches (batches.DataUnit), so each step
still takes the same sequences, which is what makes the continued run the same run. A run
folder that an engine is training in is not resumed meanwhile (runfolder.hold_run_dir).
Torch-free: the front-end plans the resume before the engine starts.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import (SECTIONS, Config, ConfigError, apply_overrides, config_from_dict, parse_override, read_toml,
                      safe_on_resume)
from .checkpoint_folder import check_checkpoint, is_run_dir
from .extras import require_logger_packages
from .folder import (CHECKPOINTS, CONFIG, METRICS, check_not_training, create_run_dir, latest_checkpoint,
                     remove_later_checkpoints, write_config)
from .safe_files import write_whole

def changeable_on_resume() -> str:
    """The keys `--set` may change when resuming (config.safe_on_resume, each key's declaration),
    a section whose every key may change as `section.*`."""
    safe = safe_on_resume()
    whole = {s for s in SECTIONS if {f"{s}.{f.name}" for f in dataclasses.fields(SECTIONS[s])} <= safe}
    return ", ".join(sorted({k for k in safe if k.split(".")[0] not in whole} | {f"{s}.*" for s in whole}))


@dataclass(frozen=True)
class ResumePlan:
    cfg: Config
    run_dir: Path
    checkpoint: Path
    step: int
    in_place: bool


def plan_resume(path_arg: str, overrides: list[str], out: str | None,
                check: Callable[[Config], None] | None = None) -> ResumePlan:
    path = Path(path_arg).expanduser()
    if is_run_dir(path):
        if out:
            raise ConfigError(f"--resume {path} continues that run folder in place; --out applies only when "
                              "resuming from a checkpoint folder")
        check_not_training(path)
        ckpt = latest_checkpoint(path)
        if ckpt is None:
            raise ConfigError(f"--resume {path}: the run has no complete checkpoint to continue from (it stopped "
                              "before its first one); start it again instead")
        in_place = True
    elif (path / "state.json").is_file() or (path / "model.safetensors").is_file():
        ckpt, in_place = path, False
    else:
        raise ConfigError(f"--resume {path}: neither a run folder (config.toml) nor a checkpoint folder "
                          "(state.json, model.safetensors)")
    step = check_checkpoint(ckpt)
    saved = read_toml(ckpt / CONFIG)
    raw = apply_overrides(saved, overrides)
    # First whether each key exists and each value fits (a misspelt key is a misspelling), then
    # whether it may change.
    given = [".".join(parse_override(o)[:2]) for o in overrides]
    cfg = config_from_dict(raw, source=str(ckpt / CONFIG), from_set=set(given))
    if fixed := [key for key in given if key not in safe_on_resume()]:
        raise ConfigError("cannot change when resuming (it would change the run the checkpoint belongs to); "
                          f"these can: {changeable_on_resume()}", f"--set {fixed[0]}", keys=tuple(fixed))
    saved_cfg = config_from_dict(saved, source=str(ckpt / CONFIG))
    cfg = same_sequences_per_step(saved_cfg, cfg, accum_given="training.grad_accum_steps" in given)
    if cfg.training.max_steps <= step:
        raise ConfigError(f"--resume {path}: the checkpoint is at step {step} and training.max_steps is "
                          f"{cfg.training.max_steps}; raise it with --set training.max_steps=N")
    if in_place:
        require_logger_packages(cfg)  # before the run folder is rewritten (create_run_dir checks a new one)
        if check is not None:
            check(cfg)
        run_dir = path
        write_config(cfg, run_dir / CONFIG)
        truncate_metrics(run_dir / METRICS, step)
        # Checkpoints past the one we continue from belong to a future that is being redone.
        remove_later_checkpoints(path / CHECKPOINTS, step)
    else:
        run_dir = create_run_dir(cfg, ckpt.parent.parent.name or "resumed", out, check)
    return ResumePlan(cfg, run_dir, ckpt, step, in_place)


def same_sequences_per_step(saved: Config, cfg: Config, accum_given: bool = False) -> Config:
    """`cfg` with micro-batch × accumulation × processes (the sequences of a step, which the
    trainer draws as the checkpoint did) as saved: accumulation follows the micro-batch and the
    process count unless `accum_given`; refused, saying what must stay equal, where they cannot."""
    t, new = saved.training, cfg.training
    rows = t.micro_batch_size * t.grad_accum_steps * saved.world
    took = (f"--resume: each of the checkpoint's steps takes {rows} sequences (micro-batch {t.micro_batch_size} × "
            f"{t.grad_accum_steps} accumulation steps × {saved.world} process(es))")
    if rows % cfg.world:
        raise ConfigError(f"{took}; {cfg.world} process(es) cannot share them evenly: use a process count that "
                          f"divides {rows}")
    accum = new.grad_accum_steps
    if not accum_given:
        share = rows // cfg.world
        if share % new.micro_batch_size:
            raise ConfigError(f"{took}; {cfg.world} process(es) take {share} each, which training.micro_batch_size = "
                              f"{new.micro_batch_size} does not divide: micro_batch_size × grad_accum_steps × "
                              f"processes must stay {rows}")
        accum = share // new.micro_batch_size
    if new.micro_batch_size * accum * cfg.world != rows:
        raise ConfigError(f"{took}; training.micro_batch_size × training.grad_accum_steps × processes must stay "
                          f"{rows} (it is {new.micro_batch_size} × {accum} × {cfg.world} = "
                          f"{new.micro_batch_size * accum * cfg.world}); leave grad_accum_steps out to have it follow")
    return dataclasses.replace(cfg, training=dataclasses.replace(new, grad_accum_steps=accum))


KEPT_ROWS = {"spike", "rollback"}


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the lines past `step`, atomically: a crash here leaves the old file whole. The new file
    goes through a fresh name (safe_files.write_whole), never one another account could have
    planted a link at. Streamed a line at a time: a long run's file holds hundreds of megabytes."""
    if not path.is_file():
        return
    with open(path, "rb") as fh:
        write_whole(path, (line if line.endswith(b"\n") else line + b"\n" for line in fh if _kept(line, step)))


def _kept(line: bytes, step: int) -> bool:
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return False  # a line cut short by a kill, or nested past reading (never one of ours)
    # Spikes and rollbacks stay: what happened to the run, which a resume does not undo.
    return isinstance(row, dict) and (_at_or_before(row.get("step", 0), step) or row.get("kind") in KEPT_ROWS)


def _at_or_before(row_step: object, step: int) -> bool:
    """A row's step that is not a number (not a row lmcockpit wrote) cannot be placed: dropped."""
    return isinstance(row_step, (int, float)) and not isinstance(row_step, bool) and row_step <= step

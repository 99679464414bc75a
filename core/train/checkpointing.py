"""The trainer's checkpoints: a resume's load, periodic and final saves, and a full disk waited out.

What a checkpoint holds beyond the weights and optimizer state comes from the trainer's parts
(recovery's spike state, evaluation's target), so a resume draws and judges the next steps as the
run would have. Short of disk space a periodic checkpoint is a warning and training goes on; the
last one waits for room, answering commands, until it is written or an abort gives it up.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from .. import protocol as P
from ..config import ConfigError
from ..data.batches import DataUnit
from ..hardware import cpu_precision
from ..run.checkpoint_folder import STATE, checkpoint_config
from ..run.folder import CHECKPOINTS, list_checkpoints
from . import checkpoint_io
from .optim import lr_multiplier, set_peak_lrs

SPACE_RETRY_S = 30  # how often a last checkpoint that found the disk full tries again


class Checkpoints:
    def __init__(self, trainer):
        self.trainer = trainer  # the Trainer whose part this is (its module imports this one)
        self.saved_step: int | None = None  # the newest checkpoint on disk

    @property
    def last_written(self) -> str:
        return "none" if self.saved_step is None else f"step {self.saved_step}"

    # ------------------------------------------------------------------------------ resume
    def load(self, path: Path) -> None:
        tr = self.trainer
        try:
            state = checkpoint_io.load(path, tr.model, tr.optimizers)
        except ConfigError:  # refused by checkpoint_io.load's allow-list: its one line, no hint of another
            raise
        except Exception as e:  # noqa: BLE001 - safetensors, torch and pickle each raise their own
            raise ConfigError(f"--resume {path}: the checkpoint does not fit this model or is damaged "
                              f"({str(e).splitlines()[0]}){earlier_checkpoint_hint(Path(path))}") from None
        set_peak_lrs(tr.optimizers, tr.cfg.optimizer)
        tr.step, tr.tokens_seen = state["step"], state["tokens_seen"]
        if Path(path).resolve().parent == (tr.run_dir / CHECKPOINTS).resolve():
            self.saved_step = tr.step  # in place; from another run's checkpoint, this run has none yet
        tr.recovery.restore(state)
        tr.evaluation.restore(state)
        rng_note = checkpoint_io.restore_rng_state(state["rng"], tr.group.rank, tr.group.world, tr.device)
        if rng_note:
            tr.log(f"resume: {rng_note}")
        if tr.scaler and state.get("grad_scaler"):
            tr.scaler.load_state_dict(state["grad_scaler"])
        saved_world, t, saved = state.get("world", 1), tr.cfg.training, checkpoint_config(Path(path)).training
        # Checkpoints from before "data_unit" drew theirs in the micro-batches they trained in.
        unit = state.get("data_unit") or (saved.micro_batch_size, saved.grad_accum_steps * saved_world)
        tr.data_unit = DataUnit(*unit)
        moved = ""
        if saved_world != tr.group.world:
            moved = f"; saved by {saved_world} process(es), continuing on {tr.group.world}"
        if moved or (saved.micro_batch_size, saved.grad_accum_steps) != (t.micro_batch_size, t.grad_accum_steps):
            moved += (f"{'' if moved else '; continuing'} with {t.grad_accum_steps} accumulation step(s) of "
                      f"{t.micro_batch_size} sequences (saved: {saved.grad_accum_steps} of {saved.micro_batch_size}), "
                      "the same batches")
        tr.log(f"resumed from {path} at step {tr.step} ({tr.tokens_seen:,} tokens seen{moved})")
        self.note_schedule_change(saved.max_steps)

    def note_schedule_change(self, saved_max_steps: int) -> None:
        """A new step budget stretches (or shrinks) the schedule from here on: say so, with the rates."""
        tr = self.trainer
        t, o = tr.cfg.training, tr.cfg.optimizer
        before, after = lr_multiplier(tr.step, saved_max_steps, o), lr_multiplier(tr.step, t.max_steps, o)
        if not math.isclose(before, after):
            tr.log(f"schedule: the run now ends at step {t.max_steps}, not {saved_max_steps}, and the "
                   f"{o.schedule} schedule stretches with it: step {tr.step + 1} trains at {after:.3g}× the "
                   f"peak learning rate, not {before:.3g}×")

    def agreed_data_unit(self) -> DataUnit:
        """A new run draws its batches in the micro-batches it trains in; a resumed run keeps its
        checkpoint's, which must add up to the sequences a step takes now."""
        tr = self.trainer
        t, world = tr.cfg.training, tr.group.world
        if tr.data_unit is None:
            return DataUnit(t.micro_batch_size, t.grad_accum_steps * world)
        rows, unit = t.micro_batch_size * t.grad_accum_steps * world, tr.data_unit
        if unit.rows * unit.per_step != rows:
            raise ConfigError(f"--resume {tr.resume_from}: the checkpoint's steps take {unit.rows * unit.per_step} "
                              "sequences each, and training.micro_batch_size × training.grad_accum_steps × "
                              f"processes is {t.micro_batch_size} × {t.grad_accum_steps} × {world} = {rows}: it must "
                              "stay equal")
        return unit

    def resumed_cpu_verdict(self) -> cpu_precision.Verdict | None:
        """A run resumed on a CPU keeps the precision its checkpoint's steps were taken in (so a
        verdict measured again, or another CPU, does not change a run half way); None for a new
        run, or a checkpoint that does not say (written on a GPU, or before the key existed)."""
        tr = self.trainer
        if not tr.resume_from:
            return None
        try:
            kept = json.loads((Path(tr.resume_from) / STATE).read_text()).get("cpu_precision")
        except (OSError, ValueError, AttributeError):
            return None  # load says what is wrong with it
        return cpu_precision.Verdict(kept, why="kept from the checkpoint") if kept in ("fp32", "bf16") else None

    # ------------------------------------------------------------------------------ saving
    def save_last_good(self) -> None:
        """After a non-finite step: the weights in memory are still the last good step's."""
        if self.trainer.step > 0:
            self.save_final()

    def save_final(self) -> None:
        """The run's last checkpoint, which no later one will replace: without room on the disk it
        waits for some, trying again every SPACE_RETRY_S (at once on a checkpoint command), until
        it is written or an abort without a checkpoint gives it up."""
        tr = self.trainer
        tries = 0
        while not self.save(last=True):
            tr.emit(P.StateChanged(P.CHECKPOINTING))
            if not tries:  # each try's failure is its own warning; how to end the wait, said once
                tr.log(f"checkpoint: waiting for disk space, trying again every {SPACE_RETRY_S} s (checkpoint "
                       "now: at once; abort without saving: end the run without it)")
            tries += 1
            if not self.wait_for_space():
                tr.log(f"checkpoint: step {tr.step} given up, not written; the last written is {self.last_written}")
                return

    def wait_for_space(self) -> bool:
        """SPACE_RETRY_S, answering commands; False on an abort without a checkpoint, which is then
        the run's stop. Rank 0's clock ends the wait, as a checkpoint command of its own that every
        rank agrees on with the rest."""
        tr = self.trainer
        due = time.monotonic() + SPACE_RETRY_S
        while True:
            mine = [cmd for cmd in [tr.next_command(True)] if cmd is not None]
            if tr.group.is_main and time.monotonic() >= due:
                mine.append(P.CheckpointNow())
            for cmd in tr.group.agree(mine):
                if isinstance(cmd, P.Abort) and not cmd.save:
                    tr.stop = cmd
                    return False
                if isinstance(cmd, P.CheckpointNow):
                    return True
                if isinstance(cmd, P.Sample):
                    tr.evaluation.answer_sample(cmd)

    def save(self, last: bool = False) -> bool:
        """Whether this step is on disk now. Short of disk space the run goes on, said as a warning
        (the next checkpoint tries again): ending it would lose every step since the last one."""
        tr = self.trainer
        if tr.step == self.saved_step:
            # Saved already (a periodic checkpoint, then an abort; or the step it resumed from):
            # writing it again would only double the time a stop takes.
            tr.emit(P.CheckpointWritten(tr.step, str(tr.run_dir / CHECKPOINTS / checkpoint_io.step_dir_name(tr.step))))
            return True
        tr.emit(P.StateChanged(P.CHECKPOINTING))
        state = {"tokens_seen": tr.tokens_seen, "world": tr.group.world, **tr.recovery.state(),
                 **tr.evaluation.state(),
                 "data_unit": list(tr.data_unit),
                 "config_hash": tr.cfg.hash(),
                 # what precision "auto" chose on a CPU: a resume keeps it (resumed_cpu_verdict)
                 "cpu_precision": tr.precision if tr.device.type == "cpu" else None,
                 # fp16's loss scale: a resumed run that restarted at 65536 would skip steps
                 "grad_scaler": tr.scaler.state_dict() if tr.scaler else None}
        try:
            with tr.between.timing("checkpoints"):
                path = checkpoint_io.save(tr.run_dir / CHECKPOINTS, tr.step, tr.model, tr.optimizers, state,
                                          tr.cfg.to_toml(), tr.cfg.checkpoint.keep, tr.group, tr.cfg.file_mode())
        except checkpoint_io.NoSpace as e:
            tr.log(f"warning: checkpoint of step {tr.step} not written: {e}; the last written is "
                   f"{self.last_written}" + ("" if last else "; training goes on"))
            tr.emit(P.StateChanged(P.PAUSED if tr.paused else P.RUNNING))
            return False
        self.saved_step = tr.step
        tr.record(P.CheckpointWritten(tr.step, str(path)))
        tr.log(f"checkpoint: step {tr.step} written to {path}")
        tr.emit(P.StateChanged(P.PAUSED if tr.paused else P.RUNNING))
        return True


def earlier_checkpoint_hint(path: Path) -> str:
    """For a damaged checkpoint in a run folder: the whole one before it, and how to use it."""
    found = list_checkpoints(path.parent)
    earlier = found[:found.index(path)] if path in found else []
    if not earlier:
        return ""
    return (f"; the one before it, {earlier[-1].name}, is whole: move {path.name} out of {path.parent} and "
            "resume again to continue from there")

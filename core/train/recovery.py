"""What the trainer does when a step goes wrong, and the state that carries across steps for it.

A loss spike (spikes.py judges it) is met as training.on_spike says: warned of, its update skipped,
rolled back to the last checkpoint past the batches since with the learning rate cut for a while,
or the run stopped with the weights that spiked set aside and the command that resumes it. A
non-finite loss or gradient is skipped (up to max_nan_skips) or stops the run, with a report in
nan_debug/. The state (the spike window, rollbacks, batches stepped past, the rate cut, skips) goes
into every checkpoint, so a resume judges and draws the next steps as this run would have.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from .. import protocol as P
from ..config import toml_value
from ..run.checkpoint_folder import checkpoint_config
from ..run.curves import flatten
from ..run.folder import CHECKPOINTS, CONFIG, list_checkpoints, step_dirs
from . import checkpoint_io, nan_debug
from .optim import set_peak_lrs
from .spikes import Spike, SpikeWatch


class NonFiniteLoss(P.RunFailure):
    pass


class SpikeStop(P.RunFailure):
    """A loss spike the run's policy ends it for (on_spike "stop", or rollbacks used up)."""


class Recovery:
    def __init__(self, trainer):
        self.trainer = trainer  # the Trainer whose part this is (its module imports this one)
        t = trainer.cfg.training
        self.spikes = SpikeWatch(t.spike_window, t.spike_zscore, t.spike_grad_zscore)
        self.spiking = False  # inside a stretch of spikes: said once, at its start
        self.rollbacks = 0
        self.batch_offset = 0  # batches stepped past by rollbacks: step s trains on batch s + this
        self.lr_cut_until = 0  # steps before this one train at lr_cut × the schedule
        self.lr_cut = 1.0  # spike_lr_factor, once per rollback in the stretch the cut lasts
        self.rolled_back = False  # this iteration's step was undone: nothing more happens at it
        self.nan_skips = 0

    # ------------------------------------------------------------------ state in a checkpoint
    def state(self) -> dict:
        return {"nan_skips": self.nan_skips,
                # what a resume needs to judge and draw the next steps as this run would
                "spikes": {"window": self.spikes.state(), "rollbacks": self.rollbacks,
                           "batch_offset": self.batch_offset, "lr_cut_until": self.lr_cut_until,
                           "lr_cut": self.lr_cut}}

    def restore(self, state: dict) -> None:
        self.nan_skips = state.get("nan_skips", 0)
        spikes = state.get("spikes") or {}
        self.spikes.restore(spikes.get("window"))
        self.rollbacks, self.batch_offset = spikes.get("rollbacks", 0), spikes.get("batch_offset", 0)
        self.lr_cut_until = spikes.get("lr_cut_until", 0)
        # checkpoints from before the cut compounded held only spike_lr_factor's
        self.lr_cut = spikes.get("lr_cut") or (self.trainer.cfg.training.spike_lr_factor if self.lr_cut_until else 1.0)

    def lr_factor(self, step: int) -> float:
        """What the schedule's learning rate is multiplied by at the step after `step`."""
        return self.lr_cut if step < self.lr_cut_until else 1.0

    # --------------------------------------------------------------------------- spikes
    def judge(self, loss: float, grad_norm: float) -> bool:
        """Whether this step's update was dropped for a spike (skip, rollback); raises SpikeStop."""
        spike = self.spikes.check(loss, grad_norm)
        if spike is not None and self.on_spike(spike):
            return True
        self.spiking = spike is not None
        self.spikes.add(loss, grad_norm)
        return False

    def on_spike(self, spike: Spike) -> bool:
        """What training.on_spike does with a spike at the next step, said in a metrics row and the
        log; whether the update was dropped (skip, rollback) rather than taken (warn)."""
        tr = self.trainer
        t, step = tr.cfg.training, tr.step + 1
        action = t.on_spike
        if action == "rollback" and self.rollbacks >= t.max_rollbacks:
            action = "stop"
        tr.record(P.SpikeSeen(step, spike.loss, action, spike.mean_loss, min(spike.z_loss, 1e9), spike.grad_norm,
                              spike.z_grad if math.isfinite(spike.z_grad) else None))
        if action == "warn":
            if not self.spiking:  # a stretch of spikes is one warning; each is a metrics row
                tr.log(f"warning: loss spike at step {step}: {spike.describe()}; training goes on "
                       "(training.on_spike = \"warn\")")
            return False
        tr.clear_grads()
        if action == "skip":
            tr.log(f"warning: loss spike at step {step}: {spike.describe()}; update skipped")
            tr.step = step
            tr.tokens_seen += tr.plan.schedules.step_tokens(step - 1)
            return True
        if action == "rollback" and self.roll_back(step, spike):
            return True
        why = (f"after {self.rollbacks} rollback(s), training.max_rollbacks = {t.max_rollbacks}"
               if t.on_spike == "rollback" else "training.on_spike = \"stop\"")
        raise SpikeStop(f"loss spike at step {step}: {spike.describe()}; stopped ({why}). "
                        + self.give_up_on_spike())

    def give_up_on_spike(self) -> str:
        """The run ends on a spike: the weights in memory are those whose loss spiked (step N's
        update shows in step N+1's loss), so they are not saved, and a checkpoint of them already
        written is set aside: the latest is the last one before. What to run next, in words."""
        tr = self.trainer
        root = tr.run_dir / CHECKPOINTS
        if tr.group.is_main:
            for name in checkpoint_io.set_aside_from(root, tr.step):
                tr.log(f"checkpoint: {name} holds the weights that spiked: set aside as {checkpoint_io.SPIKED}{name}")
        tr.group.barrier()
        kept = list_checkpoints(root)
        if not kept:
            lower = " ".join(f"--set optimizer.{key}={value:g}" for key, value in self.safer_rates(kept).items())
            return (f"No checkpoint was written before it: start again with lower learning rates "
                    f"(lmcockpit --run {shlex.quote(str(tr.run_dir / CONFIG))} {lower}).")
        return (f"The weights that spiked were not saved; the latest checkpoint is {kept[-1].name}. "
                f"Resume from it with lower learning rates: lmcockpit --run --resume "
                f"{shlex.quote(str(tr.run_dir))} {self.resume_settings(kept)}")

    def resume_settings(self, kept: list[Path]) -> str:
        """The --set items that resume from the last checkpoint as this run trained, rates lowered:
        a resume starts from the checkpoint's own config, and this run's (a resume's --set values,
        max_steps among them) would be lost. [notify] is left out: its URLs hold secrets."""
        now, then = flatten(self.trainer.cfg.to_dict()), flatten(checkpoint_config(kept[-1]).to_dict())
        sets = {key: value for key, value in now.items()
                if key in then and then[key] != value and not key.startswith("notify.")}
        sets.update({f"optimizer.{key}": value for key, value in self.safer_rates(kept).items()})
        return " ".join(f"--set {shlex.quote(f'{key}={toml_value(value)}')}" for key, value in sets.items())

    def safer_rates(self, kept: list[Path]) -> dict[str, float]:
        """Learning rates to resume with: those the last checkpoint was trained at, where they were
        lower (a surge set by a resume), else half of the rates that spiked."""
        o = self.trainer.cfg.optimizer
        now = {"lr": o.lr, **({"muon_lr": o.muon_lr} if o.kind == "muon" else {})}
        before = checkpoint_config(kept[-1]).optimizer if kept else None
        return {key: getattr(before, key) if before is not None and getattr(before, key) < value else value / 2
                for key, value in now.items()}

    def roll_back(self, spike_step: int, spike: Spike) -> bool:
        """Back to the last checkpoint, past the batches since (those of the spike's step too), with
        the learning rate cut for a while if asked; False with no checkpoint to go back to."""
        tr = self.trainer
        t = tr.cfg.training
        found = [p for step, p in step_dirs(tr.run_dir / CHECKPOINTS)
                 if step < spike_step and (p / "state.json").is_file()]
        if not found:
            tr.log(f"warning: loss spike at step {spike_step}: {spike.describe()}; no checkpoint to roll back to")
            return False
        state = checkpoint_io.load(found[-1], tr.model, tr.optimizers)
        set_peak_lrs(tr.optimizers, tr.cfg.optimizer)
        back = state["step"]
        tr.step, tr.tokens_seen, tr.checkpoints.saved_step = back, state["tokens_seen"], back
        # The window as it was at that step: the steps rolled back are no longer the run's.
        self.spikes.restore(state.get("spikes", {}).get("window"))
        self.spiking = False
        self.batch_offset += spike_step - back
        # Each rollback in the stretch a cut lasts cuts the rate again: one that came back at the
        # rate that spiked would meet the spike again.
        self.lr_cut = (self.lr_cut if back < self.lr_cut_until else 1.0) * t.spike_lr_factor
        self.lr_cut_until = back + t.spike_lr_steps
        self.rollbacks += 1
        self.rolled_back = True
        tr.record(P.RolledBack(spike_step, back, spike_step - back, self.rollbacks, self.lr_cut, t.spike_lr_steps))
        cut = (f", learning rate × {self.lr_cut:g} for {t.spike_lr_steps} steps"
               if t.spike_lr_steps and self.lr_cut < 1 else "")
        tr.log(f"warning: loss spike at step {spike_step}: {spike.describe()}; rolled back to step {back}, "
               f"past {spike_step - back} step(s) of batches{cut} (rollback {self.rollbacks}/{t.max_rollbacks})")
        return True

    # ----------------------------------------------------------------------- non-finite
    def on_non_finite(self, loss: float, grad_norm: float, step_batches) -> None:
        tr = self.trainer
        t = tr.cfg.training
        lr = tr.optimizers[0].param_groups[0]["lr"]
        folder = tr.run_dir / nan_debug.NAN_DEBUG
        if tr.group.is_main:  # its own shards and batches: enough to see what went wrong
            folder, report = nan_debug.dump(tr.run_dir, tr.step + 1, tr.model, step_batches, loss, grad_norm, lr)
            tr.log(report)
        tr.clear_grads()
        what = f"loss {loss}, grad norm {grad_norm}; report in {folder}"
        skip = t.on_nan == "skip" and self.nan_skips < t.max_nan_skips
        tr.emit(P.NonFinite(tr.step + 1, "skip" if skip else "stop"))
        if skip:
            self.nan_skips += 1
            tr.log(f"warning: non-finite values at step {tr.step + 1} ({what}); update skipped "
                   f"({self.nan_skips}/{t.max_nan_skips})")
            tr.step += 1
            return
        o = tr.cfg.optimizer
        lower = f"--set optimizer.lr={o.lr / 2:g}" + (f" --set optimizer.muon_lr={o.muon_lr / 2:g}" if o.kind == "muon" else "")
        raise NonFiniteLoss(f"non-finite values at step {tr.step + 1} ({what}); the weights of step "
                            f"{tr.step} were kept. Resume with lower learning rates (lmcockpit --run --resume "
                            f"{tr.run_dir} {lower}) "
                            f"or past bad batches (--set training.on_nan='\"skip\"').")

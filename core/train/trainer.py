"""The training loop: data, model, optimizers, evaluation, checkpoints and commands between steps.

The Trainer knows nothing of processes or terminals: it reports through `emit` (protocol events)
and `log` (text lines), and asks `next_command` for front-end commands between optimizer steps.
Steps are numbered from 1 in everything it reports; step N's batches use the 0-based index N-1.
Under several processes the same loop runs on every rank against a `group` (core/train/group.py):
rank 0 reports and writes the run folder, and every decision (stop, pause, skip a non-finite
step) is taken on values all ranks share, so the ranks never part ways.
"""

from __future__ import annotations

import gc
import json
import math
import shlex
import shutil
import time
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch

from .. import protocol as P
from ..config import Config, ConfigError, toml_value
from ..data import batches, budget as data_budget
from ..data.cache import TokenData
from ..data.prepare import prepare
from ..hardware import cpu_precision, memory_estimate
from ..hardware.device import autocast_dtype, device_uuids, memory_stats, peak_flops, resolve_device, resolve_precision
from ..hardware.device import attention_header, expands_kv
from ..model import sampling
from ..model.gpt import GPT, shape_from_config
from ..run.checkpoint_folder import STATE, checkpoint_config, tokenizer_file
from ..run.curves import flatten
from ..run.history_file import Summarised
from ..run.target import run_time
from ..run.folder import CHECKPOINTS, CONFIG, METRICS, MetricsLog, TOKENIZER, list_checkpoints, step_dirs
from ..tasks import catalog as tasks_catalog, items as task_items
from . import checkpoint_io, memory_probe, nan_debug
from .group import Group
from .loggers import Metrics, start_loggers
from .memory_probe import OutOfMemory, oom_in
from .spikes import Spike, SpikeWatch, watching
from .optim import (build_optimizers, clip_grad_norm, describe, lr_multiplier, schedule_warning, set_lr, set_peak_lrs,
                    step_optimizers)

Emit = Callable[[object], None]


SPACE_RETRY_S = 30  # how often a last checkpoint that found the disk full tries again


class StoppedInSetup(Exception):
    """An Abort heard while the run was still being set up: it ends there, with no step to save."""


class NonFiniteLoss(P.RunFailure):
    pass


class SpikeStop(P.RunFailure):
    """A loss spike the run's policy ends it for (on_spike "stop", or rollbacks used up)."""


class DataUnit(NamedTuple):
    """How a run draws its sequences: each step takes `per_step` batches of `rows` sequences,
    batch g = step × per_step + j (batches.global_index's numbering over the step's micro-batches).
    Fixed when the run starts and kept in its checkpoints: a resume that splits the step otherwise
    (other processes, another micro-batch) still trains on the same sequences in the same order."""
    rows: int
    per_step: int


def step_rows(draw: Callable[[int], tuple[np.ndarray, np.ndarray]], unit: DataUnit, step: int, first: int,
              count: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequences `first` to `first + count` of step `step`'s (0-based), as (inputs, targets);
    `draw(g)` is batch g. A micro-batch of the run's own size is one whole batch, drawn as always."""
    xs, ys = [], []
    for j in range(first // unit.rows, (first + count - 1) // unit.rows + 1):
        x, y = draw(step * unit.per_step + j)
        lo, hi = max(first - j * unit.rows, 0), min(first + count - j * unit.rows, unit.rows)
        xs.append(x[lo:hi])
        ys.append(y[lo:hi])
    return (xs[0], ys[0]) if len(xs) == 1 else (np.concatenate(xs), np.concatenate(ys))


class NoMetrics:
    """Ranks other than 0 write no metrics.jsonl: rank 0's figures already stand for the run."""

    def write(self, event) -> None:
        pass

    def close(self, failed: bool = False) -> None:
        pass


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, emit: Emit, log: Callable[[str], None],
                 next_command: Callable[[bool], object | None], group: Group = Group(),
                 resume_from: Path | None = None):
        self.cfg, self.run_dir, self.emit, self.log = cfg, Path(run_dir), emit, log
        self.resume_from = Path(resume_from) if resume_from else None
        self.next_command = next_command
        self.group = group
        # The main rank's rows, and the history a viewer reads instead of all of them (history_file).
        self.summary = Summarised(self.run_dir) if group.is_main else None
        self.metrics = (Metrics(MetricsLog(self.run_dir / METRICS, self.summary.written), log)
                        if self.summary is not None else NoMetrics())
        self.stop: P.Abort | None = None
        self.paused = False
        self.step = 0  # optimizer steps completed
        self.tokens_seen = 0
        self.nan_skips = 0
        t = cfg.training
        self.spikes = SpikeWatch(t.spike_window, t.spike_zscore, t.spike_grad_zscore)
        self.spiking = False  # inside a stretch of spikes: said once, at its start
        self.rollbacks = 0
        self.batch_offset = 0  # batches stepped past by rollbacks: step s trains on batch s + this
        self.lr_cut_until = 0  # steps before this one train at lr_cut × the schedule
        self.lr_cut = 1.0  # spike_lr_factor, once per rollback in the stretch the cut lasts
        self.rolled_back = False  # this iteration's step was undone: nothing more happens at it
        self.target_reached: int | None = None  # the step whose evaluation first met target_val_loss
        self.saved_step: int | None = None  # the newest checkpoint on disk
        self.compiling = False  # until the first step this process trains has compiled the model
        self.data_unit: DataUnit | None = None  # a resumed run's, from its checkpoint
        self.drawn: tuple[int, tuple[np.ndarray, np.ndarray]] | None = None  # the last batch drawn
        self.deferred: list = []  # commands heard during set-up, for the first step
        self.polled_at = 0.0

    def record(self, event) -> None:
        """An event that is also a metrics row (protocol's with a `kind`): written, then sent."""
        self.metrics.write(event)
        self.emit(event)

    # ------------------------------------------------------------------------------- set-up
    def setup(self) -> None:
        cfg = self.cfg
        self.emit(P.StateChanged(P.PREPARING))
        self.device = resolve_device(self.group.device_spec(cfg.hardware.device))
        self.group.connect(self.device)
        self.cpu_verdict = (self.resumed_cpu_verdict() or self.agreed_cpu_verdict()
                            if self.device.type == "cpu" and cfg.training.precision == "auto" else None)
        self.precision = resolve_precision(cfg.training.precision, self.device, self.cpu_verdict)
        self.amp_dtype = autocast_dtype(self.precision)
        if self.device.type == "cpu":
            # Compiled CPU training otherwise differs from run to run (inductor scatters the
            # embedding gradient with atomic adds): same seed, same losses, exact resume.
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.stop_if_told(every=0)
        self.data = self.prepare_data()
        self.stop_if_told(every=0)
        if self.group.is_main:
            for line in data_budget.header(cfg, self.data.train):
                self.log(line)
        from tokenizers import Tokenizer
        self.tokenizer = Tokenizer.from_file(str(self.data.tokenizer_dir / "tokenizer.json"))
        self.tasks = self.agreed_tasks()

        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        torch.manual_seed(cfg.training.seed)
        m = cfg.model
        # Initialised on CPU and then moved, so a seed gives the same weights on any device (and rank).
        self.model = GPT(shape_from_config(cfg)).to(self.device)
        self.model.activation_checkpointing = cfg.training.activation_checkpointing
        self.model.expand_kv = expands_kv(cfg, self.device, self.precision)
        # DDP or FSDP around the model (itself for one process); sharding comes before the
        # optimizers, which must hold the sharded parameters.
        self.wrapped = self.group.wrap(self.model)
        self.optimizers = build_optimizers(self.model, cfg.optimizer, self.device, self.precision)
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None
        if self.resume_from:
            self.load_checkpoint(self.resume_from)
        self.train_model = self.compiled_model()
        self.keep_grads = memory_estimate.keeps_grads(cfg)
        # Resumed too, where --set asks for it: the data is drawn in the checkpoint's own batches.
        if cfg.training.auto_micro_batch:
            memory_probe.fit_micro_batch(self, memory_probe.device_memory(self))  # logs the trials' peak
            cfg = self.cfg
        self.data_unit = self.agreed_data_unit()
        self.allocate_grads()
        self.flops_per_token = self.model.flops_per_token(cfg.training.seq_len)
        self.peak = peak_flops(self.device, self.log)  # says so where the GPU has no known peak
        self.n_params = self.model.num_params()
        g = self.group
        procs = f"; {g.world} processes ({g.strategy})" if g.distributed else ""
        self.log(f"model: {self.n_params:,} parameters, {m.n_layer} layers, d_model {m.d_model}, "
                 f"{m.n_head} heads / {m.n_kv_head} kv heads; device {self.device}, precision {self.precision}"
                 f"{f' ({self.cpu_verdict.note()})' if self.cpu_verdict else ''}, "
                 f"compile {'on' if cfg.training.compile else 'off'}, {cfg.tokens_per_step:,} tokens/step{procs}")
        self.log(attention_header(cfg, self.device, self.precision))
        self.log(describe(self.optimizers, cfg.optimizer))
        self.log(watching(cfg.training))
        if warning := schedule_warning(cfg.optimizer, cfg.training.max_steps):
            self.log(warning)
        if g.is_main:  # after a resume's checkpoint (its step) and the micro-batch search (the config)
            self.metrics.start(start_loggers(cfg, self.run_dir, self.step))
        devices = g.local_devices(self.device)
        self.emit(P.RunStarted(str(self.run_dir), cfg.to_dict(), self.n_params, str(self.device),
                               self.precision, self.step, cfg.training.max_steps, cfg.tokens_per_step,
                               g.world, devices, device_uuids(devices)))

    def agreed_data_unit(self) -> DataUnit:
        """A new run draws its batches in the micro-batches it trains in; a resumed run keeps its
        checkpoint's, which must add up to the sequences a step takes now."""
        t, world = self.cfg.training, self.group.world
        if self.data_unit is None:
            return DataUnit(t.micro_batch_size, t.grad_accum_steps * world)
        rows, unit = t.micro_batch_size * t.grad_accum_steps * world, self.data_unit
        if unit.rows * unit.per_step != rows:
            raise ConfigError(f"--resume {self.resume_from}: the checkpoint's steps take {unit.rows * unit.per_step} "
                              "sequences each, and training.micro_batch_size × training.grad_accum_steps × "
                              f"processes is {t.micro_batch_size} × {t.grad_accum_steps} × {world} = {rows}: it must "
                              "stay equal")
        return unit

    def resumed_cpu_verdict(self) -> cpu_precision.Verdict | None:
        """A run resumed on a CPU keeps the precision its checkpoint's steps were taken in (so a
        verdict measured again, or another CPU, does not change a run half way); None for a new
        run, or a checkpoint that does not say (written on a GPU, or before the key existed)."""
        if not self.resume_from:
            return None
        try:
            kept = json.loads((Path(self.resume_from) / STATE).read_text()).get("cpu_precision")
        except (OSError, ValueError, AttributeError):
            return None  # load_checkpoint says what is wrong with it
        return cpu_precision.Verdict(kept, why="kept from the checkpoint") if kept in ("fp32", "bf16") else None

    def agreed_cpu_verdict(self) -> cpu_precision.Verdict:
        """What "auto" means on this CPU (cpu_precision), the same for every process: each machine's
        first process probes if need be while the others wait, then they read its verdict; bf16
        only if every machine's verdict is bf16."""
        g = self.group
        verdict = cpu_precision.choose(self.cfg, self.log) if g.local_rank == 0 else None
        g.barrier()
        verdict = verdict or cpu_precision.known() or cpu_precision.Verdict(
            "fp32", why="this machine's first process left no verdict to read")
        verdicts = g.gather(verdict)
        if verdicts[0].precision == "fp32" or all(v.precision == "bf16" for v in verdicts):
            return verdicts[0]
        return cpu_precision.Verdict("fp32", why="bf16 measured faster on some of the run's machines, not all")

    def agreed_tasks(self) -> list:
        """eval.tasks read on every rank, and the same everywhere (task_items.agree): the ranks
        score every world-th item and sum the choices. A rank that cannot read them stops them all."""
        try:
            tasks, local = tasks_catalog.load_tasks(self.cfg.eval.tasks, self.cfg), None
        except ConfigError as e:
            tasks, local = [], e
        answers = self.group.gather(str(local) if local is not None else task_items.Digest(task_items.digest(tasks)))
        if local is not None:
            raise local
        task_items.agree(answers)
        return tasks

    def prepare_data(self) -> TokenData:
        """The token cache, tokenised once: the first process of each machine builds it while the
        others wait, then they all map the same files."""
        def progress(*a) -> None:
            self.emit(P.Progress(*a))
            self.stop_if_told()

        own = self.own_tokenizer()
        data = prepare(self.cfg, self.log, progress, own) if self.group.local_rank == 0 else None
        self.group.barrier()
        if data is None:
            data = prepare(self.cfg, self.log, progress, own)
        tok_dst = self.run_dir / TOKENIZER
        if self.group.is_main and not tok_dst.exists():
            shutil.copytree(data.tokenizer_dir, tok_dst)
        return data

    def stop_if_told(self, every: float = 0.2) -> None:
        """During set-up, at the data's progress ticks and between its stages: an Abort (Ctrl-C,
        SIGTERM, the cockpit's stop, a front-end gone) ends the run here rather than after a
        preparation of minutes or hours; what the build finished is kept for the next run. Other
        commands wait for the first step. One process only: ranks agree on commands between steps,
        and one rank leaving set-up alone would leave the others waiting at its barrier."""
        if self.group.world > 1 or time.monotonic() - self.polled_at < every:  # ticks come many a second
            return
        self.polled_at = time.monotonic()
        while (cmd := self.next_command(False)) is not None:
            if isinstance(cmd, P.Abort):
                self.stop = cmd
                raise StoppedInSetup
            self.deferred.append(cmd)

    def own_tokenizer(self) -> Path | None:
        """A resumed run's tokenizer.json (its run folder's): the one its weights were trained on."""
        if not self.resume_from:
            return None
        try:
            return tokenizer_file(Path(self.resume_from), self.cfg)
        except ConfigError:  # a checkpoint copied away from its run folder: the data decides
            self.log(f"warning: no tokenizer beside {self.resume_from}; the data's own is used, which matches "
                     "the checkpoint only if the data is unchanged")
            return None

    def compiled_model(self):
        """The module the training step calls. Static shapes (dynamic=False): a run's shapes never
        change, and the micro-batch search must not turn its trial sizes into a dynamic graph."""
        t = self.cfg.training
        return torch.compile(self.wrapped, mode=t.compile_mode, dynamic=False) if t.compile else self.wrapped

    def allocate_grads(self) -> None:
        """Every gradient, zeroed, before the first backward, when the run keeps them (memory_estimate.keeps_grads)."""
        if self.keep_grads:
            for p in self.model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)

    def clear_grads(self) -> None:
        in_place = self.keep_grads or self.group.bucketed  # memory_estimate.grads_between_steps, for this group
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=not in_place)

    def load_checkpoint(self, path: Path) -> None:
        try:
            state = checkpoint_io.load(path, self.model, self.optimizers)
        except ConfigError:  # refused by checkpoint_io.load's allow-list: its one line, no hint of another
            raise
        except Exception as e:  # noqa: BLE001 - safetensors, torch and pickle each raise their own
            raise ConfigError(f"--resume {path}: the checkpoint does not fit this model or is damaged "
                              f"({str(e).splitlines()[0]}){earlier_checkpoint_hint(Path(path))}") from None
        set_peak_lrs(self.optimizers, self.cfg.optimizer)
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        if Path(path).resolve().parent == (self.run_dir / CHECKPOINTS).resolve():
            self.saved_step = self.step  # in place; from another run's checkpoint, this run has none yet
        self.nan_skips = state.get("nan_skips", 0)
        spikes = state.get("spikes") or {}
        self.spikes.restore(spikes.get("window"))
        self.rollbacks, self.batch_offset = spikes.get("rollbacks", 0), spikes.get("batch_offset", 0)
        self.lr_cut_until = spikes.get("lr_cut_until", 0)
        # checkpoints from before the cut compounded held only spike_lr_factor's
        self.lr_cut = spikes.get("lr_cut") or (self.cfg.training.spike_lr_factor if self.lr_cut_until else 1.0)
        target = state.get("target") or {}  # reached already, unless the resume aims elsewhere
        if target.get("aim") == self.target_aim:
            self.target_reached = target.get("reached_at")
        rng_note = checkpoint_io.restore_rng_state(state["rng"], self.group.rank, self.group.world, self.device)
        if rng_note:
            self.log(f"resume: {rng_note}")
        if self.scaler and state.get("grad_scaler"):
            self.scaler.load_state_dict(state["grad_scaler"])
        saved_world, t, saved = state.get("world", 1), self.cfg.training, checkpoint_config(Path(path)).training
        # Checkpoints from before "data_unit" drew theirs in the micro-batches they trained in.
        unit = state.get("data_unit") or (saved.micro_batch_size, saved.grad_accum_steps * saved_world)
        self.data_unit = DataUnit(*unit)
        moved = ""
        if saved_world != self.group.world:
            moved = f"; saved by {saved_world} process(es), continuing on {self.group.world}"
        if moved or (saved.micro_batch_size, saved.grad_accum_steps) != (t.micro_batch_size, t.grad_accum_steps):
            moved += (f"{'' if moved else '; continuing'} with {t.grad_accum_steps} accumulation step(s) of "
                      f"{t.micro_batch_size} sequences (saved: {saved.grad_accum_steps} of {saved.micro_batch_size}), "
                      "the same batches")
        self.log(f"resumed from {path} at step {self.step} ({self.tokens_seen:,} tokens seen{moved})")
        self.note_schedule_change(saved.max_steps)

    def note_schedule_change(self, saved_max_steps: int) -> None:
        """A new step budget stretches (or shrinks) the schedule from here on: say so, with the rates."""
        t, o = self.cfg.training, self.cfg.optimizer
        before, after = lr_multiplier(self.step, saved_max_steps, o), lr_multiplier(self.step, t.max_steps, o)
        if not math.isclose(before, after):
            self.log(f"schedule: the run now ends at step {t.max_steps}, not {saved_max_steps}, and the "
                     f"{o.schedule} schedule stretches with it: step {self.step + 1} trains at {after:.3g}× the "
                     f"peak learning rate, not {before:.3g}×")

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                              enabled=self.amp_dtype is not None)

    # -------------------------------------------------------------------------------- loop
    def run(self) -> str:
        """Train to max_steps or until told to stop; returns the final state."""
        try:
            self.setup()
        except StoppedInSetup:
            self.log("stopped while setting up, before the first step: nothing to save")
            return P.INTERRUPTED if self.stop.interrupted else P.ABORTED
        t = self.cfg.training
        self.compiling = t.compile
        self.emit(P.StateChanged(P.COMPILING if t.compile else P.RUNNING))
        while self.step < t.max_steps and not self.at_target:
            self.handle_commands()
            if self.stop:
                break
            try:
                self.within_memory("training", self.train_step)
            except NonFiniteLoss:
                self.save_last_good()
                raise
            if self.rolled_back:  # back at a checkpoint's step: evaluated, saved and sampled there already
                self.rolled_back = False
                continue
            validation, tasks = self.evaluations_due()
            if (validation or tasks) and self.step < t.max_steps:
                self.within_memory("evaluation", lambda: self.evaluate(validation, tasks))
            every = self.cfg.checkpoint.every
            if every and self.step % every == 0 and self.step < t.max_steps:
                self.save_checkpoint()
            every = self.cfg.sample.every
            if every and self.step % every == 0 and self.step < t.max_steps:  # the last step samples below
                self.periodic_samples()
        if self.stop is None:
            if not self.at_target:  # evaluated at that step already
                self.within_memory("evaluation", lambda: self.evaluate(True, bool(self.tasks)))
            self.save_final()
            if self.stop is None:  # not given up by an abort
                self.periodic_samples()
                return P.FINISHED
        elif self.stop.save and self.step > 0:
            self.save_final()
        return P.INTERRUPTED if self.stop.interrupted else P.ABORTED

    def train_step(self) -> None:
        cfg, t = self.cfg, self.cfg.training
        t0 = time.perf_counter()
        cut = self.lr_cut if self.step < self.lr_cut_until else 1.0
        set_lr(self.optimizers, lr_multiplier(self.step, t.max_steps, cfg.optimizer) * cut)
        loss_sum = torch.zeros((), device=self.device)
        step_batches = []
        for micro in range(t.grad_accum_steps):
            first = (self.group.rank * t.grad_accum_steps + micro) * t.micro_batch_size
            x, y = (torch.from_numpy(a).to(self.device, non_blocking=True)
                    for a in step_rows(self.draw, self.data_unit, self.step + self.batch_offset, first,
                                       t.micro_batch_size))
            step_batches.append((x, y))
            if t.compile:
                # Each micro-batch is a whole forward and backward: nothing the graphs' pool holds
                # outlives it (the loss is divided, a new tensor, and gradients add into their own).
                torch.compiler.cudagraph_mark_step_begin()
            with self.group.accumulating(self.wrapped, last=micro == t.grad_accum_steps - 1), self.autocast():
                loss = self.train_model(x, y) / t.grad_accum_steps
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_sum += loss.detach()
        # Every rank's loss, averaged: what one process accumulating all the micro-batches reports.
        loss_sum = self.group.mean(loss_sum)
        if self.scaler:
            for opt in self.optimizers:
                self.scaler.unscale_(opt)
        grad_norm = clip_grad_norm(self.model.parameters(), t.grad_clip, self.group)
        # One sync per step: the loss is needed on the host anyway, and a non-finite value must
        # be caught before any optimizer touches the weights.
        loss_val, norm_val = (float(v) for v in torch.stack([loss_sum, grad_norm.float()]).tolist())
        self.compiled()
        # Overflowing gradients are the loss scaler's to skip (and its scale to lower); a
        # non-finite loss is not: the scale only multiplies the backward, and skipping would go on
        # halving it to the end of the run.
        if not math.isfinite(loss_val) or not (self.scaler or math.isfinite(norm_val)):
            self.on_non_finite(loss_val, norm_val, step_batches)
            if self.scaler:  # it refuses the next step's unscale_ until an update ends this one
                self.scaler.update()
            return
        spike = self.spikes.check(loss_val, norm_val)
        if spike is not None and self.on_spike(spike):
            return
        self.spiking = spike is not None
        self.spikes.add(loss_val, norm_val)
        step_optimizers(self.optimizers, self.scaler, norm_val)
        self.clear_grads()
        self.step += 1
        self.tokens_seen += cfg.tokens_per_step
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        tps = cfg.tokens_per_step / dt  # every rank's tokens
        mfu = self.flops_per_token * tps / (self.peak * self.group.world) if self.peak else None
        lr = self.optimizers[0].param_groups[0]["lr"]
        mem = memory_stats(self.device)
        self.record(P.StepMetrics(self.step, loss_val, lr, norm_val, tps, mfu, dt, self.tokens_seen, mem))

    def draw(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch g of the run's data; kept, since micro-batches smaller than it take it in parts."""
        if self.drawn is None or self.drawn[0] != g:
            t = self.cfg.training
            self.drawn = g, batches.get_batch(self.data.train, t.seed, g, self.data_unit.rows, t.seq_len)
        return self.drawn[1]

    def compiled(self) -> None:
        """RUNNING once the first step this process trains has compiled the model: a resumed run's
        first is not step 1, and until then the front-ends show compiling, not the steps."""
        if self.compiling:
            self.compiling = False
            self.emit(P.StateChanged(P.RUNNING))

    def within_memory(self, doing: str, work: Callable[[], object]) -> object:
        """`work`, with an out-of-memory error in it made a RunFailure that says where, how much and
        what to change. Evaluation runs between steps, on the weights of a whole step: one process
        saves them first (several cannot: the other ranks may be inside a collective)."""
        result, error = self.unless_out_of_memory(work)
        if error is None:
            return result
        if doing != "training" and not self.group.distributed and self.step > 0:
            self.save_final()
        raise OutOfMemory(memory_probe.out_of_memory_message(self, error, doing))

    def unless_out_of_memory(self, work: Callable[[], object]) -> tuple[object, str | None]:
        """(work(), None), or (None, the out-of-memory error's text) with the memory it held
        given back; any other error goes through."""
        try:
            return work(), None
        except Exception as e:  # the compiler wraps what it hits: oom_in looks behind, and re-raises the rest
            oom = oom_in(e)
            if oom is None:
                raise
            error = str(oom)
        gc.collect()  # outside the handler: the error's frames no longer hold its tensors
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return None, error

    def on_spike(self, spike: Spike) -> bool:
        """What training.on_spike does with a spike at step self.step + 1, said in a metrics row and
        the log; whether the update was dropped (skip, rollback) rather than taken (warn)."""
        t, step = self.cfg.training, self.step + 1
        action = t.on_spike
        if action == "rollback" and self.rollbacks >= t.max_rollbacks:
            action = "stop"
        self.record(P.SpikeSeen(step, spike.loss, action, spike.mean_loss, min(spike.z_loss, 1e9), spike.grad_norm,
                                spike.z_grad if math.isfinite(spike.z_grad) else None))
        if action == "warn":
            if not self.spiking:  # a stretch of spikes is one warning; each is a metrics row
                self.log(f"warning: loss spike at step {step}: {spike.describe()}; training goes on "
                         "(training.on_spike = \"warn\")")
            return False
        self.clear_grads()
        if action == "skip":
            self.log(f"warning: loss spike at step {step}: {spike.describe()}; update skipped")
            self.step = step
            self.tokens_seen += self.cfg.tokens_per_step
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
        root = self.run_dir / CHECKPOINTS
        if self.group.is_main:
            for name in checkpoint_io.set_aside_from(root, self.step):
                self.log(f"checkpoint: {name} holds the weights that spiked: set aside as {checkpoint_io.SPIKED}{name}")
        self.group.barrier()
        kept = list_checkpoints(root)
        if not kept:
            lower = " ".join(f"--set optimizer.{key}={value:g}" for key, value in self.safer_rates(kept).items())
            return (f"No checkpoint was written before it: start again with lower learning rates "
                    f"(lmcockpit --run {shlex.quote(str(self.run_dir / CONFIG))} {lower}).")
        return (f"The weights that spiked were not saved; the latest checkpoint is {kept[-1].name}. "
                f"Resume from it with lower learning rates: lmcockpit --run --resume "
                f"{shlex.quote(str(self.run_dir))} {self.resume_settings(kept)}")

    def resume_settings(self, kept: list[Path]) -> str:
        """The --set items that resume from the last checkpoint as this run trained, rates lowered:
        a resume starts from the checkpoint's own config, and this run's (a resume's --set values,
        max_steps among them) would be lost. [notify] is left out: its URLs hold secrets."""
        now, then = flatten(self.cfg.to_dict()), flatten(checkpoint_config(kept[-1]).to_dict())
        sets = {key: value for key, value in now.items()
                if key in then and then[key] != value and not key.startswith("notify.")}
        sets.update({f"optimizer.{key}": value for key, value in self.safer_rates(kept).items()})
        return " ".join(f"--set {shlex.quote(f'{key}={toml_value(value)}')}" for key, value in sets.items())

    def safer_rates(self, kept: list[Path]) -> dict[str, float]:
        """Learning rates to resume with: those the last checkpoint was trained at, where they were
        lower (a surge set by a resume), else half of the rates that spiked."""
        o = self.cfg.optimizer
        now = {"lr": o.lr, **({"muon_lr": o.muon_lr} if o.kind == "muon" else {})}
        before = checkpoint_config(kept[-1]).optimizer if kept else None
        return {key: getattr(before, key) if before is not None and getattr(before, key) < value else value / 2
                for key, value in now.items()}

    def roll_back(self, spike_step: int, spike: Spike) -> bool:
        """Back to the last checkpoint, past the batches since (those of the spike's step too), with
        the learning rate cut for a while if asked; False with no checkpoint to go back to."""
        t = self.cfg.training
        found = [p for step, p in step_dirs(self.run_dir / CHECKPOINTS)
                 if step < spike_step and (p / "state.json").is_file()]
        if not found:
            self.log(f"warning: loss spike at step {spike_step}: {spike.describe()}; no checkpoint to roll back to")
            return False
        state = checkpoint_io.load(found[-1], self.model, self.optimizers)
        set_peak_lrs(self.optimizers, self.cfg.optimizer)
        back = state["step"]
        self.step, self.tokens_seen, self.saved_step = back, state["tokens_seen"], back
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
        self.record(P.RolledBack(spike_step, back, spike_step - back, self.rollbacks, self.lr_cut, t.spike_lr_steps))
        cut = (f", learning rate × {self.lr_cut:g} for {t.spike_lr_steps} steps"
               if t.spike_lr_steps and self.lr_cut < 1 else "")
        self.log(f"warning: loss spike at step {spike_step}: {spike.describe()}; rolled back to step {back}, "
                 f"past {spike_step - back} step(s) of batches{cut} (rollback {self.rollbacks}/{t.max_rollbacks})")
        return True

    def on_non_finite(self, loss: float, grad_norm: float, step_batches) -> None:
        lr = self.optimizers[0].param_groups[0]["lr"]
        folder = self.run_dir / nan_debug.NAN_DEBUG
        if self.group.is_main:  # its own shards and batches: enough to see what went wrong
            folder, report = nan_debug.dump(self.run_dir, self.step + 1, self.model, step_batches, loss, grad_norm, lr)
            self.log(report)
        self.clear_grads()
        what = f"loss {loss}, grad norm {grad_norm}; report in {folder}"
        skip = self.cfg.training.on_nan == "skip" and self.nan_skips < self.cfg.training.max_nan_skips
        self.emit(P.NonFinite(self.step + 1, "skip" if skip else "stop"))
        if skip:
            self.nan_skips += 1
            self.log(f"warning: non-finite values at step {self.step + 1} ({what}); update skipped "
                     f"({self.nan_skips}/{self.cfg.training.max_nan_skips})")
            self.step += 1
            return
        o = self.cfg.optimizer
        lower = f"--set optimizer.lr={o.lr / 2:g}" + (f" --set optimizer.muon_lr={o.muon_lr / 2:g}" if o.kind == "muon" else "")
        raise NonFiniteLoss(f"non-finite values at step {self.step + 1} ({what}); the weights of step "
                            f"{self.step} were kept. Resume with lower learning rates (lmcockpit --run --resume "
                            f"{self.run_dir} {lower}) "
                            f"or past bad batches (--set training.on_nan='\"skip\"').")

    # ----------------------------------------------------------------------------- commands
    def handle_commands(self) -> None:
        """Everything queued now, agreed between ranks; while paused, wait for more without spinning."""
        while True:
            for cmd in self.group.agree(self.pending_commands()):
                self.apply(cmd)
                if self.stop:
                    return
            if not self.paused:
                return

    def pending_commands(self) -> list:
        cmds, block = self.deferred, self.paused  # paused: wait a moment for the first, then take what is queued
        self.deferred = []
        while (cmd := self.next_command(block)) is not None:
            cmds.append(cmd)
            block = False
        return cmds

    def apply(self, cmd: object) -> None:
        if isinstance(cmd, P.Pause) and not self.paused:
            self.paused = True
            if self.group.is_main:  # in train.log, and in every front-end's log, as any line the engine says
                self.log(f"training paused at step {self.step}")
            self.emit(P.StateChanged(P.PAUSED))
        elif isinstance(cmd, P.Resume) and self.paused:
            self.paused = False
            if self.group.is_main:
                self.log(f"training resumed at step {self.step}")
            self.emit(P.StateChanged(P.RUNNING))
        elif isinstance(cmd, P.CheckpointNow):
            if self.step > 0:
                self.save_checkpoint()
        elif isinstance(cmd, P.Sample):
            self.answer_sample(cmd)
        elif isinstance(cmd, P.Abort):
            self.stop, self.paused = cmd, False

    # ---------------------------------------------------------------------- eval and saving
    def evaluations_due(self) -> tuple[bool, bool]:
        """Whether this step ends with the validation loss, and with the task scores: each has
        its cadence, the tasks' eval.tasks_every (0: eval.every's)."""
        e = self.cfg.eval
        tasks_every = e.tasks_every or e.every
        return (bool(e.every) and self.step % e.every == 0,
                bool(self.tasks) and bool(tasks_every) and self.step % tasks_every == 0)

    def evaluate(self, validation: bool = True, tasks: bool = False) -> None:
        """One `eval` row (and EvalMetrics) with the validation loss, the task scores, or both."""
        self.emit(P.StateChanged(P.EVALUATING))
        fields = self.validation_loss() if validation else {}
        scores: dict[str, dict] = {}
        core = None
        if tasks:
            from ..tasks.items import core_score

            t0 = time.perf_counter()
            results = self.score_tasks()
            scores = fields["tasks"] = {name: r.row() for name, r in results.items()}
            core = core_score(results, self.tasks)
            if core is not None:
                fields["core"] = core
            if self.group.is_main:  # what a task costs the run, beside what it says
                self.log(f"tasks: step {self.step} scored in {time.perf_counter() - t0:.1f} s: " + ", ".join(
                    f"{name} {s['accuracy']:.3f} of {s['items']}" for name, s in scores.items())
                         + ("" if core is None else f"; CORE {core:.4f}"))
        self.record(P.EvalMetrics(self.step, fields.get("val_loss"), fields.get("val_bpb"), scores, core))
        self.check_target(fields)
        self.emit(P.StateChanged(P.PAUSED if self.paused else P.RUNNING))

    def check_target(self, fields: dict) -> None:
        """The first evaluation to reach the run's target (a validation loss at or under
        target_val_loss, or target_task's accuracy at or above target_accuracy): a `target` row
        and a log line, and with stop_at_target the last step."""
        t = self.cfg.training
        if self.target_reached is not None:
            return
        if t.target_val_loss and fields.get("val_loss") is not None and fields["val_loss"] <= t.target_val_loss:
            what, value, target, key = "val_loss", fields["val_loss"], t.target_val_loss, "training.target_val_loss"
        elif t.target_task and (fields.get("tasks") or {}).get(t.target_task, {}).get("accuracy", -1) >= t.target_accuracy:
            what, value, target = t.target_task, fields["tasks"][t.target_task]["accuracy"], t.target_accuracy
            key = f"training.target_accuracy of {t.target_task}"
        else:
            return
        self.target_reached = self.step
        # the run's training time so far, resumes included and steps rolled back left out
        seconds = self.summary.history.time if self.summary is not None else None
        self.record(P.TargetReached(self.step, what, value, target, seconds))
        after = f", after {run_time(seconds)} of training" if seconds is not None else ""
        self.log(f"target: {what} {value:.4f} reached {key} = {target:g} at step {self.step}{after}"
                 + ("; the run ends here (training.stop_at_target)" if t.stop_at_target else ""))

    @property
    def target_aim(self) -> list:
        """What the run aims at, as a checkpoint records it: a resume aiming elsewhere starts afresh."""
        t = self.cfg.training
        return [t.target_task, t.target_accuracy] if t.target_task else ["val_loss", t.target_val_loss]

    @property
    def at_target(self) -> bool:
        return self.cfg.training.stop_at_target and self.target_reached is not None

    def score_tasks(self) -> dict:
        from ..tasks import scoring

        def encode(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

        t = self.cfg.training
        return scoring.score_tasks(self.tasks, self.model, encode, self.data.eos_id, t.seq_len, t.micro_batch_size,
                                   self.device, self.autocast, self.group, self.cfg.eval.max_per_task)

    @torch.no_grad()
    def validation_loss(self) -> dict[str, float]:
        cfg, t = self.cfg, self.cfg.training
        # The windows in the run's own batches (the same at every evaluation, whatever a resume
        # changed of the micro-batch), evaluated a micro-batch at a time.
        windows = batches.eval_windows(len(self.data.val), cfg.eval.batches, self.data_unit.rows, t.seq_len).ravel()
        starts = [windows[i:i + t.micro_batch_size] for i in range(0, len(windows), t.micro_batch_size)]
        nats, n_bytes, n_tokens, loss_sum = 0.0, 0, 0, 0.0
        token_bytes = torch.from_numpy(self.data.token_bytes).to(self.device)
        g = self.group
        # Rank r takes batches r, r + world, ...; under FSDP every rank must run as many forward
        # passes as the others (each gathers shards with them), so a rank short of one repeats
        # batch 0 and counts nothing from it.
        rounds = -(-len(starts) // g.world) if g.sharded else len(range(g.rank, len(starts), g.world))
        for i in range(g.rank, g.rank + rounds * g.world, g.world):
            counts = i < len(starts)
            rows = batches.rows_at(self.data.val, starts[i if counts else 0], t.seq_len)
            x, y = (torch.from_numpy(a).to(self.device) for a in rows)
            with self.autocast():
                losses = self.model.token_losses(x, y)
            if not counts:
                continue
            b = token_bytes[y]
            nats += float((losses * (b > 0)).sum())
            n_bytes += int(b.sum())
            loss_sum += float(losses.sum())
            n_tokens += losses.numel()
        totals = g.sum(torch.tensor([nats, n_bytes, n_tokens, loss_sum], dtype=torch.float64, device=self.device))
        nats, n_bytes, n_tokens, loss_sum = totals.tolist()
        val_loss = loss_sum / n_tokens
        val_bpb = nats / (math.log(2) * max(1, n_bytes))
        return {"val_loss": val_loss, "val_bpb": val_bpb}

    def save_last_good(self) -> None:
        """After a non-finite step: the weights in memory are still the last good step's."""
        if self.step > 0:
            self.save_final()

    def save_final(self) -> None:
        """The run's last checkpoint, which no later one will replace: without room on the disk it
        waits for some, trying again every SPACE_RETRY_S (at once on a checkpoint command), until
        it is written or an abort without a checkpoint gives it up."""
        tries = 0
        while not self.save_checkpoint(last=True):
            self.emit(P.StateChanged(P.CHECKPOINTING))
            if not tries:  # each try's failure is its own warning; how to end the wait, said once
                self.log(f"checkpoint: waiting for disk space, trying again every {SPACE_RETRY_S} s (checkpoint "
                         "now: at once; abort without saving: end the run without it)")
            tries += 1
            if not self.wait_for_space():
                self.log(f"checkpoint: step {self.step} given up, not written; the last written is "
                         f"{self.last_written}")
                return

    def wait_for_space(self) -> bool:
        """SPACE_RETRY_S, answering commands; False on an abort without a checkpoint, which is then
        the run's stop. Rank 0's clock ends the wait, as a checkpoint command of its own that every
        rank agrees on with the rest."""
        due = time.monotonic() + SPACE_RETRY_S
        while True:
            mine = [cmd for cmd in [self.next_command(True)] if cmd is not None]
            if self.group.is_main and time.monotonic() >= due:
                mine.append(P.CheckpointNow())
            for cmd in self.group.agree(mine):
                if isinstance(cmd, P.Abort) and not cmd.save:
                    self.stop = cmd
                    return False
                if isinstance(cmd, P.CheckpointNow):
                    return True
                if isinstance(cmd, P.Sample):
                    self.answer_sample(cmd)

    @property
    def last_written(self) -> str:
        return "none" if self.saved_step is None else f"step {self.saved_step}"

    def save_checkpoint(self, last: bool = False) -> bool:
        """Whether this step is on disk now. Short of disk space the run goes on, said as a warning
        (the next checkpoint tries again): ending it would lose every step since the last one."""
        if self.step == self.saved_step:
            # Saved already (a periodic checkpoint, then an abort; or the step it resumed from):
            # writing it again would only double the time a stop takes.
            self.emit(P.CheckpointWritten(self.step, str(self.run_dir / CHECKPOINTS / checkpoint_io.step_dir_name(self.step))))
            return True
        self.emit(P.StateChanged(P.CHECKPOINTING))
        state = {"tokens_seen": self.tokens_seen, "nan_skips": self.nan_skips, "world": self.group.world,
                 # what a resume needs to judge and draw the next steps as this run would
                 "spikes": {"window": self.spikes.state(), "rollbacks": self.rollbacks,
                            "batch_offset": self.batch_offset, "lr_cut_until": self.lr_cut_until,
                            "lr_cut": self.lr_cut},
                 "target": {"aim": self.target_aim, "reached_at": self.target_reached},
                 "data_unit": list(self.data_unit),
                 "config_hash": self.cfg.hash(),
                 # what precision "auto" chose on a CPU: a resume keeps it (resumed_cpu_verdict)
                 "cpu_precision": self.precision if self.device.type == "cpu" else None,
                 # fp16's loss scale: a resumed run that restarted at 65536 would skip steps
                 "grad_scaler": self.scaler.state_dict() if self.scaler else None}
        try:
            path = checkpoint_io.save(self.run_dir / CHECKPOINTS, self.step, self.model, self.optimizers, state,
                                   self.cfg.to_toml(), self.cfg.checkpoint.keep, self.group, self.cfg.file_mode())
        except checkpoint_io.NoSpace as e:
            self.log(f"warning: checkpoint of step {self.step} not written: {e}; the last written is "
                     f"{self.last_written}" + ("" if last else "; training goes on"))
            self.emit(P.StateChanged(P.PAUSED if self.paused else P.RUNNING))
            return False
        self.saved_step = self.step
        self.record(P.CheckpointWritten(self.step, str(path)))
        self.log(f"checkpoint: step {self.step} written to {path}")
        self.emit(P.StateChanged(P.PAUSED if self.paused else P.RUNNING))
        return True

    # ------------------------------------------------------------------------------ samples
    def sample_text(self, request: P.Sample) -> list[str] | None:
        """From the live weights, between optimizer steps; touches no state that training reads.
        Rank 0 answers; under FSDP the other ranks run the same generation beside it, silently.
        A request that runs out of memory (many rows, a long context) is dropped and training goes
        on; under FSDP every rank decodes in step with the others, so there it ends the run."""
        if not (self.group.is_main or self.group.sharded):
            return None
        answer = lambda: sampling.answer(  # noqa: E731 - a one-line function, defined where it is used
            self.model, self.tokenizer, self.data.eos_id, request, self.step, self.emit, self.log, self.autocast(),
            self.group.broadcast if self.group.sharded else None)
        if self.group.sharded:
            return self.within_memory("sampling", answer)
        texts, error = self.unless_out_of_memory(answer)
        if error is None:
            return texts
        error = error.strip().splitlines()[0]
        self.log(f"warning: sample request {request.request_id!r} ran out of memory ({error}): "
                 f"{request.num_samples} row(s) × {request.max_new_tokens} new tokens was dropped; training goes on")
        self.emit(P.SampleText(request.request_id, self.step, request.prompt, "", done=True))
        return None

    def answer_sample(self, request: P.Sample) -> None:
        for text in self.sample_text(request) or []:
            self.metrics.write(P.Sampled(self.step, request.prompt, text))

    def periodic_samples(self) -> None:
        s = self.cfg.sample
        for i, prompt in enumerate(s.prompts):
            req = P.Sample(f"periodic-{self.step}-{i}", prompt, s.max_new_tokens, s.temperature, s.top_k,
                           seed=self.cfg.training.seed + i, top_p=s.top_p)
            for text in self.sample_text(req) or []:
                self.metrics.write(P.Sampled(self.step, prompt, text))
                self.log(f"sample at step {self.step}: {prompt + text!r}")

    def close(self, failed: bool = False) -> None:
        self.metrics.close(failed)
        if self.group.distributed:  # `--nproc 1` too: a group of one still has gloo's threads
            self.release_model()
        self.group.close()

    def release_model(self) -> None:
        """Drop everything that holds the process group before it is destroyed. DDP's reducer (and
        FSDP's state, and the compiler's caches of either) keep a reference to it; freed after
        destroy_process_group, the last of them destroys the gloo group while holding the GIL,
        and the group's worker threads, finishing a barrier, need the GIL to free its tensors:
        a hang, seen once in eight test runs."""
        for attr in ("train_model", "wrapped", "model", "optimizers", "scaler"):
            self.__dict__.pop(attr, None)
        if self.cfg.training.compile:
            torch._dynamo.reset()
        gc.collect()


def earlier_checkpoint_hint(path: Path) -> str:
    """For a damaged checkpoint in a run folder: the whole one before it, and how to use it."""
    found = list_checkpoints(path.parent)
    earlier = found[:found.index(path)] if path in found else []
    if not earlier:
        return ""
    return (f"; the one before it, {earlier[-1].name}, is whole: move {path.name} out of {path.parent} and "
            "resume again to continue from there")


def run_in_process(cfg: Config, run_dir: Path, emit: Emit = lambda e: None,
                   log: Callable[[str], None] = print, resume_from: Path | None = None) -> Trainer:
    """Train without the engine process (tests and benchmarks that compare against it)."""
    trainer = Trainer(cfg, run_dir, emit, log, lambda block: None, resume_from=resume_from)
    try:
        trainer.run()
    finally:
        trainer.close()
    return trainer



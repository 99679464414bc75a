"""The training loop: set-up, the step, and commands between steps; its parts do the rest.

Recovery from spikes and non-finite steps (`recovery.Recovery`), validation, task scores, the
target and samples (`evaluation.Evaluation`), and checkpoints with a resume's load
(`checkpointing.Checkpoints`) each hold their own state and are called from the loop.

The Trainer knows nothing of processes or terminals: it reports through `emit` (protocol events)
and `log` (text lines), and asks `next_command` for front-end commands between optimizer steps.
Steps are numbered from 1 in everything it reports; step N's batches use the 0-based index N-1.
Under several processes the same loop runs on every rank against a `group` (core/train/group.py):
rank 0 reports and writes the run folder, and every decision (stop, pause, skip a non-finite
step) is taken on values all ranks share, so the ranks never part ways.
"""

from __future__ import annotations

import gc
import math
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .. import protocol as P
from ..config import Config, ConfigError
from ..data import batches, budget as data_budget
from ..data.batches import DataUnit, step_rows
from ..data.cache import TokenData
from ..data.prepare import prepare
from ..hardware import cpu_precision, memory_estimate
from ..hardware.device import (attention_header, autocast_dtype, device_uuids, expands_kv, memory_stats, peak_flops,
                               resolve_device, resolve_precision)
from ..model.gpt import GPT, shape_from_config
from ..run.checkpoint_folder import tokenizer_file
from ..run.history_file import Summarised
from ..run.folder import METRICS, MetricsLog, TOKENIZER
from . import finetune, memory_probe
from .checkpointing import Checkpoints
from .evaluation import Evaluation
from .group import Group
from .layer_stats import LayerStatsTaker
from .loggers import Metrics, start_loggers
from .optim import build_optimizers, clip_grad_norm, describe, lr_multiplier, schedule_warning, set_lr, step_optimizers
from .profiling import Profiling
from .recovery import NonFiniteLoss, Recovery, SpikeStop  # noqa: F401 - SpikeStop: raised in recovery, caught by tests here
from .spikes import watching
from .step_clock import Between, StepClock
from .step_plan import StepPlan

Emit = Callable[[object], None]


class StoppedInSetup(Exception):
    """An Abort heard while the run was still being set up: it ends there, with no step to save."""


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
        self.recovery = Recovery(self)  # spikes and non-finite steps, with what they carry across steps
        self.evaluation = Evaluation(self)  # validation, task scores, the target, samples
        self.checkpoints = Checkpoints(self)  # a resume's load, saves, a full disk waited out
        self.profiling = Profiling(self)  # torch.profiler over a few steps, when asked
        self.layer_stats = LayerStatsTaker(self)  # each block's health every logging.layer_stats_every steps
        self.compiling = False  # until the first step this process trains has compiled the model
        self.between = Between()  # seconds of work between steps, for the next step's row
        self.data_unit: DataUnit | None = None  # a resumed run's, from its checkpoint
        self.drawn: tuple[tuple[int, int], tuple[np.ndarray, np.ndarray]] | None = None  # the last batch drawn
        self.deferred: list = []  # commands heard during set-up, for the first step
        self.polled_at = 0.0

    @property
    def saved_step(self) -> int | None:
        return self.checkpoints.saved_step

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
        self.cpu_verdict = (self.checkpoints.resumed_cpu_verdict() or self.agreed_cpu_verdict()
                            if self.device.type == "cpu" and cfg.training.precision == "auto" else None)
        self.precision = resolve_precision(cfg.training.precision, self.device, self.cpu_verdict)
        self.amp_dtype = autocast_dtype(self.precision)
        if self.device.type == "cpu":
            # Compiled CPU training otherwise differs from run to run (inductor scatters the
            # embedding gradient with atomic adds): same seed, same losses, exact resume.
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.stop_if_told(every=0)
        self.data = finetune.prepare_data(self) if cfg.data.format == "chat" else self.prepare_data()
        self.stop_if_told(every=0)
        if self.group.is_main:
            for line in data_budget.header(cfg, self.data.train):
                self.log(line)
        from tokenizers import Tokenizer
        self.tokenizer = Tokenizer.from_file(str(self.data.tokenizer_dir / "tokenizer.json"))
        self.evaluation.load_tasks()

        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        torch.manual_seed(cfg.training.seed)
        m = cfg.model
        # Initialised on CPU and then moved, so a seed gives the same weights on any device (and rank).
        self.model = GPT(shape_from_config(cfg)).to(self.device)
        finetune.start_from_base(self)  # a new fine-tuning run's weights: its base's
        self.model.activation_checkpointing = cfg.training.activation_checkpointing
        self.model.expand_kv = expands_kv(cfg, self.device, self.precision)
        # DDP or FSDP around the model (itself for one process); sharding comes before the
        # optimizers, which must hold the sharded parameters.
        self.wrapped = self.group.wrap(self.model)
        self.optimizers = build_optimizers(self.model, cfg.optimizer, self.device, self.precision)
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None
        if self.resume_from:
            self.checkpoints.load(self.resume_from)
        self.train_model = self.compiled_model()
        self.clock = StepClock(self.device)
        self.keep_grads = memory_estimate.keeps_grads(cfg)
        # Resumed too, where --set asks for it: the data is drawn in the checkpoint's own batches.
        if cfg.training.auto_micro_batch:
            memory_probe.fit_micro_batch(self, memory_probe.device_memory(self))  # logs the trials' peak
            cfg = self.cfg
        self.data_unit = self.checkpoints.agreed_data_unit()
        self.allocate_grads()
        self.plan = StepPlan(self)  # the batch and sequence-length schedules, checked against the data unit
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

    def agreed_cpu_verdict(self) -> cpu_precision.Verdict:
        """What "auto" means on this CPU (cpu_precision), the same for every process: each machine's
        first process probes if need be while the others wait, then they read its verdict; bf16
        only if every machine's verdict is bf16."""
        g = self.group
        verdict = cpu_precision.choose(self.cfg, self.log) if g.local_rank == 0 else None
        g.barrier()
        verdict = verdict or cpu_precision.known(self.cfg) or cpu_precision.Verdict(
            "fp32", why="this machine's first process left no verdict to read")
        verdicts = g.gather(verdict)
        if verdicts[0].precision == "fp32" or all(v.precision == "bf16" for v in verdicts):
            return verdicts[0]
        return cpu_precision.Verdict("fp32", why="bf16 measured faster on some of the run's machines, not all")

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
        finetune.evaluate_start(self)  # a new fine-tuning run's step 0
        t = self.cfg.training
        self.compiling = t.compile
        self.emit(P.StateChanged(P.COMPILING if t.compile else P.RUNNING))
        while self.step < t.max_steps and not self.evaluation.at_target:
            self.handle_commands()
            if self.stop:
                break
            try:
                with self.profiling.around_step():  # a profile asked for starts before a step, ends after one
                    self.within_memory("step", self.train_step)
            except NonFiniteLoss:
                self.checkpoints.save_last_good()
                raise
            if self.recovery.rolled_back:  # back at a checkpoint's step: evaluated, saved and sampled there already
                self.recovery.rolled_back = False
                continue
            validation, tasks = self.evaluation.due()
            if (validation or tasks) and self.step < t.max_steps:
                self.evaluation.evaluate(validation, tasks)
            if (every := self.cfg.checkpoint.every) and self.step % every == 0 and self.step < t.max_steps:
                self.checkpoints.save()
            if (every := self.cfg.sample.every) and self.step % every == 0 and self.step < t.max_steps:  # the last step samples below
                self.evaluation.periodic_samples()
        if self.stop is None:
            if not self.evaluation.at_target:  # evaluated at that step already
                self.evaluation.evaluate(True, bool(self.evaluation.tasks))
            self.checkpoints.save_final()
            if self.stop is None:  # not given up by an abort
                self.evaluation.periodic_samples()
                return P.FINISHED
        elif self.stop.save and self.step > 0:
            self.checkpoints.save_final()
        return P.INTERRUPTED if self.stop.interrupted else P.ABORTED

    def train_step(self) -> None:
        cfg, t, clock, compiling = self.cfg, self.cfg.training, self.clock, self.compiling
        t0 = time.perf_counter()
        clock.start()
        cut = self.recovery.lr_factor(self.step)
        set_lr(self.optimizers, lr_multiplier(self.step, t.max_steps, cfg.optimizer) * cut)
        loss_sum = torch.zeros((), device=self.device)
        step_batches, plan = [], self.plan.enter()
        for micro in range(plan.accum):
            first = (self.group.rank * plan.accum + micro) * t.micro_batch_size
            x, y = (torch.from_numpy(a).to(self.device, non_blocking=True)
                    for a in step_rows(self.draw, self.data_unit, self.step + self.recovery.batch_offset, first,
                                       t.micro_batch_size, plan.start))
            step_batches.append((x, y))
            clock.mark("data")
            if t.compile:
                # Each micro-batch is a whole forward and backward: nothing the graphs' pool holds
                # outlives it (the loss is divided, a new tensor, and gradients add into their own).
                torch.compiler.cudagraph_mark_step_begin()
            with self.group.accumulating(self.wrapped, last=micro == plan.accum - 1), self.autocast():
                loss = self.train_model(x, y) / plan.accum
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_sum += loss.detach()
            clock.mark("compute")
        # Every rank's loss, averaged: what one process accumulating all the micro-batches reports.
        loss_sum = self.group.mean(loss_sum)
        if self.scaler:
            for opt in self.optimizers:
                self.scaler.unscale_(opt)
        self.layer_stats.before_clip()
        grad_norm = clip_grad_norm(self.model.parameters(), t.grad_clip, self.group)
        # One sync per step: the loss is needed on the host anyway, and a non-finite value must
        # be caught before any optimizer touches the weights.
        loss_val, norm_val = (float(v) for v in torch.stack([loss_sum, grad_norm.float()]).tolist())
        clock.mark("sync")
        self.compiled()
        # Overflowing gradients are the loss scaler's to skip (and its scale to lower); a
        # non-finite loss is not: the scale only multiplies the backward, and skipping would go on
        # halving it to the end of the run.
        if not math.isfinite(loss_val) or not (self.scaler or math.isfinite(norm_val)):
            self.recovery.on_non_finite(loss_val, norm_val, step_batches)
            if self.scaler:  # it refuses the next step's unscale_ until an update ends this one
                self.scaler.update()
            return
        if self.recovery.judge(loss_val, norm_val):
            return
        step_optimizers(self.optimizers, self.scaler, norm_val)
        self.clear_grads()
        clock.mark("optimizer")
        self.layer_stats.after_update()
        self.step += 1
        self.tokens_seen += plan.tokens
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        parts = {} if compiling else clock.read()  # the step that compiled: the compiler's time
        self.between.add("compile", dt if compiling else 0.0)
        tps = plan.tokens / dt  # every rank's tokens
        mfu = plan.flops_per_token * tps / (self.peak * self.group.world) if self.peak else None
        lr, mem = self.optimizers[0].param_groups[0]["lr"], memory_stats(self.device)
        self.record(P.StepMetrics(self.step, loss_val, lr, norm_val, tps, mfu, dt, self.tokens_seen, mem, parts,
                                  self.between.take()))
        self.layer_stats.report()

    def draw(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch g of the run's data at the step's length; kept, since micro-batches smaller than it take it in parts."""
        key = g, self.plan.seq_len(self.step)
        if self.drawn is None or self.drawn[0] != key:
            self.drawn = key, batches.get_batch(self.data.train, self.cfg.training.seed, g, self.data_unit.rows, key[1])
        return self.drawn[1]

    def compiled(self) -> None:
        """RUNNING once the first step this process trains has compiled the model: a resumed run's
        first is not step 1, and until then the front-ends show compiling, not the steps."""
        if self.compiling:
            self.compiling = False
            self.emit(P.StateChanged(P.RUNNING))

    def within_memory(self, place: str, work: Callable[[], object]) -> object:
        """`work`, an out-of-memory error in it the run's end, explained (memory_probe.within_memory)."""
        return memory_probe.within_memory(self, place, work)

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
        cmds, block, self.deferred = self.deferred, self.paused, []  # paused: wait a moment for the first, then take what is queued
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
        elif isinstance(cmd, P.CheckpointNow) and self.step > 0:  # before the first step: nothing to save
            self.checkpoints.save()
        elif isinstance(cmd, P.Sample):
            self.evaluation.answer_sample(cmd)
        elif isinstance(cmd, P.Profile):
            self.profiling.request(cmd)
        elif isinstance(cmd, P.Abort):
            self.stop, self.paused = cmd, False

    def close(self, failed: bool = False) -> None:
        self.profiling.close()
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
            torch.compiler.reset()
        gc.collect()


def run_in_process(cfg: Config, run_dir: Path, emit: Emit = lambda e: None,
                   log: Callable[[str], None] = print, resume_from: Path | None = None) -> Trainer:
    """Train without the engine process (tests and benchmarks that compare against it)."""
    trainer = Trainer(cfg, run_dir, emit, log, lambda block: None, resume_from=resume_from)
    try:
        trainer.run()
    finally:
        trainer.close()
    return trainer



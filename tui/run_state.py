"""What a front-end knows of a run, folded from engine events.

Torch-free. Its figures are written out by `formatting`."""

from __future__ import annotations


import time
from dataclasses import dataclass, field

from ..core import protocol as P
from ..core.config import Config, ConfigError, config_from_dict
from ..core.process import live
from ..core.run.history import History, ReadsHistory
from ..core.run.target import Forecast, forecast_aim

@dataclass
class RunState(ReadsHistory):
    """The run as the front-end knows it, folded from events."""
    state: str = P.PREPARING
    # Paused stays true through a checkpoint or evaluation asked for while paused (their states
    # come and go): what "p" must undo.
    paused: bool = False
    run_dir: str = ""
    max_steps: int = 0
    start_step: int = 0
    step: int = 0
    loss: float | None = None
    # The rates shown all follow one smoothed step time, dt_ema (live.Pace: the run host's too, so
    # `ps` gives the same ETA), so tokens/s, steps/s, MFU and the ETA agree. A step's tokens and
    # its MFU × step time are the same every step: not smoothed.
    pace: live.Pace = field(default_factory=live.Pace)
    mfu_seconds: float | None = None  # MFU × step time
    clock: object = time.monotonic  # injectable, so snapshot tests render a fixed elapsed time
    started_at: float = 0.0  # when the run began, on `clock`: this front-end's start, or the host's (live.Began)
    ended_at: float | None = None  # when the run reached a terminal state: elapsed stops there
    train_started_at: float | None = None
    progress: P.Progress | None = None
    last_eval: P.EvalMetrics | None = None  # the last one with a validation loss: what the panels show
    last_tasks: dict[str, dict[str, float]] = field(default_factory=dict)  # each task's latest scores
    last_core: float | None = None
    first_loss: float | None = None
    last_checkpoint: str = ""
    samples: dict[str, str] = field(default_factory=dict)
    # The run so far for the charts, at a size that does not grow with it (core/run/history.py):
    # buckets of steps, the recent steps, every evaluation, checkpoint and spike exact.
    history: History = field(default_factory=History)
    _forecast: Forecast | None = None  # fitted again only after a new evaluation, when asked for
    lr: float | None = None
    grad_norm: float | None = None
    tokens_seen: int = 0
    mem: dict = field(default_factory=dict)
    device: str = ""
    precision: str = ""
    n_params: int = 0
    tokens_per_step: int = 0
    failure: P.Failure | None = None
    state_detail: str = ""
    config: Config | None = None  # the run's, built once from RunStarted's (run_config)

    def __post_init__(self) -> None:
        self.started_at = self.clock()

    @property
    def elapsed(self) -> float:
        """Wall time since the run (this start of it: a resume counts afresh) began, pauses
        included, frozen once it has ended. A front-end that starts the run begins counting with
        it; a viewer of a run that a host serves counts from the host's start (live.Began), so
        every viewer shows the same time, however late it attached."""
        end = self.ended_at if self.ended_at is not None else self.clock()
        return end - self.started_at

    @property
    def dt_ema(self) -> float | None:
        return self.pace.step_time

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second at the smoothed step time, the one steps/s and the ETA use."""
        return self.tokens_per_step / self.dt_ema if self.dt_ema else None

    @property
    def steps_per_s(self) -> float | None:
        return 1 / self.dt_ema if self.dt_ema else None

    @property
    def mfu(self) -> float | None:
        """MFU at the smoothed step time (the engine's figure is the last step's)."""
        if self.mfu_seconds is None or not self.dt_ema:
            return None
        return self.mfu_seconds / self.dt_ema

    def apply(self, ev: object) -> None:
        if isinstance(ev, P.RunStarted):
            self.run_dir, self.max_steps = ev.run_dir, ev.max_steps
            self.start_step = self.step = ev.start_step
            self.device, self.precision, self.n_params = ev.device, ev.precision, ev.n_params
            self.tokens_per_step, self.config = ev.tokens_per_step, run_config(ev.config)
            self.pace.start(ev.start_step)
        elif isinstance(ev, live.Began):
            # The host's wall-clock start, on this front-end's clock (monotonic: a clock set back
            # meanwhile does not change the time shown).
            self.started_at = self.clock() - max(0.0, time.time() - ev.at)
        elif isinstance(ev, P.StepMetrics):
            if self.train_started_at is None:
                self.train_started_at = self.clock()
            self.step, self.loss = ev.step, ev.loss
            self.mfu_seconds = ev.mfu * ev.dt if ev.mfu is not None else None
            self.lr, self.grad_norm, self.tokens_seen, self.mem = ev.lr, ev.grad_norm, ev.tokens_seen, ev.mem
            self.history.add_step(ev.step, ev.loss, ev.lr, ev.dt, ev.tokens_per_s)
            if self.first_loss is None:
                self.first_loss = ev.loss
            self.pace.add(ev.step, ev.dt)
        elif isinstance(ev, P.EvalMetrics):
            self.apply_eval(ev)
        elif isinstance(ev, P.Progress):
            self.progress = ev
        elif isinstance(ev, P.StateChanged):
            self.state, self.state_detail = ev.state, ev.detail
            if ev.state in (P.PAUSED, P.RUNNING) or ev.state in P.TERMINAL_STATES:
                self.paused = ev.state == P.PAUSED
            if ev.state in P.TERMINAL_STATES and self.ended_at is None:
                self.ended_at = self.clock()
        elif isinstance(ev, P.Failure):
            self.failure = ev
        elif isinstance(ev, P.CheckpointWritten):
            self.last_checkpoint = ev.path
            self.history.add_checkpoint(ev.step, ev.path)
        elif isinstance(ev, P.SampleText):
            self.samples[ev.request_id] = self.samples.get(ev.request_id, "") + ev.text
        elif isinstance(ev, P.SpikeSeen):
            self.history.spikes.append((ev.step, ev.loss, ev.action))
        elif isinstance(ev, P.RolledBack):
            self.roll_back(ev.step, ev.to_step)
        elif isinstance(ev, P.HistoryRead):
            self.read_history(ev.history)

    def roll_back(self, spike_step: int, to_step: int) -> None:
        """The curves as they were at `to_step`: the steps after it come again, on other batches.
        (A cut behind the history's exact rows, after a checkpoint interval longer than them, loses
        the rows of one bucket before `to_step` until the next attach reads the folder again.)"""
        self.history.cut(to_step + 1)
        self.history.rollbacks.append((spike_step, to_step))
        self.pace.cut(to_step)
        self._forecast = None
        self.step = to_step
        self.loss = self.history.loss

    def read_history(self, h: History) -> None:
        """The run so far, read from its folder by a viewer: the figures the panels show, as the
        events that made it would have left them."""
        self.history = h
        self._forecast = None
        last = h.last
        if h.count:
            self.step, self.loss, self.first_loss = h.last_step, h.loss, h.first_loss
            self.lr, self.grad_norm, self.mem = last.get("lr"), last.get("grad_norm"), last.get("mem") or {}
            self.tokens_seen = h.last_step * self.tokens_per_step
            if self.train_started_at is None:
                self.train_started_at = self.clock()
            self.pace.read(h.recent())  # the very step time the host folded from the same steps
            if last.get("mfu") is not None and last.get("dt"):
                self.mfu_seconds = last["mfu"] * last["dt"]
        if h.evals:
            step, val_loss, val_bpb = h.evals[-1]
            self.last_eval = P.EvalMetrics(step, val_loss, val_bpb)
        self.last_tasks = dict(h.last_task_scores)
        self.last_core = h.core[-1][1] if h.core else None
        if h.checkpoints:
            self.last_checkpoint = h.checkpoints[-1][1]

    @property
    def rollbacks(self) -> int:
        return len(self.history.rollbacks)

    def apply_eval(self, ev: P.EvalMetrics) -> None:
        """The validation loss and the task scores have cadences of their own: an evaluation may
        bring either, or both."""
        self.history.add_eval(ev.step, ev.val_loss, ev.val_bpb, ev.tasks, ev.core)
        if ev.val_loss is not None:
            self.last_eval = ev
            self._forecast = None
        for name, scores in ev.tasks.items():
            self.last_tasks[name] = scores
            self._forecast = None
        if ev.core is not None:
            self.last_core = ev.core

    @property
    def target(self) -> float:
        """training.target_val_loss as the run's config says; 0: none."""
        return float(self.config.training.target_val_loss or 0.0) if self.config else 0.0

    @property
    def target_task(self) -> tuple[str, float]:
        """training.target_task and its target_accuracy; ("", 0) for none."""
        if self.config is None:
            return "", 0.0
        t = self.config.training
        return str(t.target_task or ""), float(t.target_accuracy or 0.0)

    @property
    def cost_per_hour(self) -> float:
        return float(self.config.hardware.cost_per_hour or 0.0) if self.config else 0.0

    @property
    def forecast(self) -> Forecast | None:
        """When the run should reach its target (core/run/target.py's forecast_aim), fitted again
        only after a new evaluation; None without a target."""
        task, accuracy = self.target_task
        if not task and not self.target:
            return None  # not fitted, nor its thousands of evaluations gathered, on every redraw
        if self._forecast is None:
            values = self.tasks.get(task, []) if task else list(zip(self.val_steps, self.val_losses))
            self._forecast = forecast_aim(self.target, task, accuracy, values, self.tokens_per_step, self.max_steps,
                                          self.dt_ema)
        return self._forecast

    @property
    def eta(self) -> float | None:
        """live.eta, as the run host works it out for `ps` from the same step and step time."""
        if self.ended_at is not None:  # aborted or failed short of max_steps: nothing is coming
            return None
        return live.eta(self.step, self.max_steps, self.dt_ema)


def run_config(raw: dict) -> Config | None:
    """The run's config from the dict RunStarted carries (the engine's validated Config, as a
    dict to cross the queue); None where this lmcockpit cannot read it (a host of another version):
    the views then go without its target and cost, as for a run that names none."""
    try:
        return config_from_dict(raw, source="the run's config")
    except ConfigError:
        return None


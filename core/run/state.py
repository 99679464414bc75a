"""A run as its events make it: the one fold of the engine's events, kept by whoever watches the run.

The run host keeps one (its `live.json` summary, its stall watch and its notifications read it)
and hands a copy of its history to each viewer that joins (`catchup`); `--run`'s headless
front-end keeps its own, as the owner of its engine; each dashboard continues the copy it was
handed with the live events. The figures every view of a run shows alike are worked out here
once: the smoothed step time and the ETA (`Pace`, `eta`), so `ps`, the launch screen, each
dashboard and `--run`'s line agree.

Torch-free. Its figures are written out by the front-end's `formatting`."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from .. import protocol as P
from ..config import Config, ConfigError, config_from_dict
from ..step_schedules import Schedules
from .history import History, ReadsHistory
from .target import Evaluations, Forecast, forecast_aim

PACE_STEPS = 64  # the steps the smoothed step time is taken over: 0.9^64, the first one's share, is 0.1 %
LOG_LINES = 2000  # the log lines a run keeps for a viewer that joins: its log pane's worth and more


class Pace:
    """A run's step time, smoothed: what its ETA, tokens/s, steps/s and MFU follow, one figure in
    every process that shows one. The run host folds it for live.json (`ps`, the launch screen) and
    each front-end's RunState for its own views (the dashboard, `--run`'s line); they agree because
    the figure depends only on the run's last steps, not on when a process began to watch.

    An EMA (β 0.9) over the last PACE_STEPS steps since the run's latest start, that start's first
    step left out (it carries compilation). An EMA since the first step a process saw would not do:
    a viewer attaching at step 10,000 rebuilds this one from the run folder's recent rows (`read`)
    and has the very figure the host folded from events; one since its own attach differs from the
    host's, and from another viewer's, by what each happened to see first."""

    def __init__(self) -> None:
        self.first = 1  # the latest start's first step: not counted
        self.steps: deque[tuple[int, float]] = deque(maxlen=PACE_STEPS)  # (step, its time)
        self.step_time: float | None = None

    def start(self, start_step: int) -> None:
        """The run (re)starts after `start_step`: a resume's steps before it ran on another start."""
        self.first = start_step + 1
        self.steps.clear()
        self.step_time = None

    def add(self, step: int, dt: float) -> None:
        self._drop_from(step)  # a step again, after a rollback: those from it on are redone
        if step > self.first and dt > 0:
            self.steps.append((step, dt))
        self._fold()

    def cut(self, to_step: int) -> None:
        """Rolled back to `to_step`: the steps after it are no longer the run's."""
        self._drop_from(to_step + 1)
        self._fold()

    def read(self, rows: Iterable) -> None:
        """From a history's exact recent rows (core/run/history.py's Row: step, and the training
        seconds through it), each step's time the difference of two rows' times."""
        self.steps.clear()
        before = None
        for row in rows:
            if before is not None and row.step > self.first and row.time > before.time:
                self.steps.append((row.step, row.time - before.time))
            before = row
        self._fold()

    def _drop_from(self, step: int) -> None:
        while self.steps and self.steps[-1][0] >= step:
            self.steps.pop()

    def _fold(self) -> None:
        value = None
        for _, dt in self.steps:
            value = dt if value is None else 0.9 * value + 0.1 * dt
        self.step_time = value


def eta(step: int, max_steps: int, step_time: float | None) -> float | None:
    """Seconds left to `max_steps` at `step_time` a step (Pace's): the one ETA that `ps`, the launch
    screen, the dashboard and `--run`'s line show; None while there is no step time to go by."""
    if not step_time or not max_steps:
        return None
    return step_time * max(0, max_steps - step)


@dataclass
class RunState(ReadsHistory):
    """The run as its events make it (see the module's docstring)."""
    state: str = P.PREPARING
    engine_state: str = P.PREPARING  # the engine's own: the state a stall (STALLED) hides and its end gives back
    # Paused stays true through a checkpoint or evaluation asked for while paused (their states
    # come and go): what "p" must undo.
    paused: bool = False
    run_dir: str = ""
    max_steps: int = 0
    start_step: int = 0
    step: int = 0
    loss: float | None = None
    # The rates shown all follow one smoothed step time, dt_ema (Pace: the run host's too, so
    # `ps` gives the same ETA), so tokens/s, steps/s, MFU and the ETA agree. A step's tokens and
    # its MFU × step time are the same every step (under a batch or length schedule, the last
    # step's): not smoothed.
    pace: Pace = field(default_factory=Pace)
    mfu_seconds: float | None = None  # MFU × step time
    clock: object = time.monotonic  # injectable, so snapshot tests render a fixed elapsed time
    started_at: float = 0.0  # when the run began, on `clock`: this front-end's start, or the host's (P.Began)
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
    # The target's evaluations the forecast is fitted from, bounded (target.Evaluations): built
    # from the history when first asked for, then kept up with each evaluation.
    aim: Evaluations | None = None
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
    run_started: P.RunStarted | None = None  # as the engine said it: what a joining viewer is handed first
    log_tail: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_LINES))

    def __post_init__(self) -> None:
        self.started_at = self.clock()

    @property
    def elapsed(self) -> float:
        """Wall time since the run (this start of it: a resume counts afresh) began, pauses
        included, frozen once it has ended. A front-end that starts the run begins counting with
        it; a viewer of a run that a host serves counts from the host's start (P.Began), so
        every viewer shows the same time, however late it attached."""
        end = self.ended_at if self.ended_at is not None else self.clock()
        return end - self.started_at

    @property
    def dt_ema(self) -> float | None:
        return self.pace.step_time

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second at the smoothed step time, the one steps/s and the ETA use: the last
        step's tokens, which a batch or length schedule varies."""
        s = self.schedules
        tokens = s.step_tokens(max(self.step - 1, 0)) if s else self.tokens_per_step
        return tokens / self.dt_ema if self.dt_ema else None

    @property
    def schedules(self) -> Schedules | None:
        """The run's batch and sequence-length schedules where it has any (core/step_schedules.py)."""
        s = Schedules.of(self.config) if self.config else None
        return s if s and s.active else None

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
            self.run_started = ev
        elif isinstance(ev, P.Began):
            # The host's wall-clock start, on this front-end's clock (monotonic: a clock set back
            # meanwhile does not change the time shown).
            self.started_at = self.clock() - max(0.0, time.time() - ev.at)
        elif isinstance(ev, P.StepMetrics):
            if self.train_started_at is None:
                self.train_started_at = self.clock()
            self.step, self.loss = ev.step, ev.loss
            self.mfu_seconds = ev.mfu * ev.dt if ev.mfu is not None else None
            self.lr, self.grad_norm, self.tokens_seen, self.mem = ev.lr, ev.grad_norm, ev.tokens_seen, ev.mem
            self.history.add(ev)
            if self.first_loss is None:
                self.first_loss = ev.loss
            self.pace.add(ev.step, ev.dt)
        elif isinstance(ev, P.EvalMetrics):
            self.apply_eval(ev)
        elif isinstance(ev, P.Progress):
            self.progress = ev
        elif isinstance(ev, P.StateChanged):
            self.state, self.state_detail = ev.state, ev.detail
            if ev.state != P.STALLED:
                self.engine_state = ev.state
            if ev.state in (P.PAUSED, P.RUNNING) or ev.state in P.TERMINAL_STATES:
                self.paused = ev.state == P.PAUSED
            if ev.state in P.TERMINAL_STATES and self.ended_at is None:
                self.ended_at = self.clock()
        elif isinstance(ev, P.Failure):
            self.failure = ev
        elif isinstance(ev, P.Profiled):
            self.history.profile = ev
        elif isinstance(ev, P.LayerStats):
            self.history.layers.add(ev)
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
        elif isinstance(ev, P.LogLine):
            self.log_tail.append(ev.text)
        elif isinstance(ev, P.Ended):
            self.history.anatomy.add(None, ev.between)

    def roll_back(self, spike_step: int, to_step: int) -> None:
        """The curves as they were at `to_step`: the steps after it come again, on other batches.
        (A cut behind the history's exact rows, after a checkpoint interval longer than them, loses
        the rows of one bucket before `to_step`, in the host's history and every viewer's, until a
        host started on the run, a resume, reads the folder again.)"""
        self.history.cut(to_step + 1)
        self.history.rollbacks.append((spike_step, to_step))
        self.pace.cut(to_step)
        self._forecast = self.aim = None
        self.step = to_step
        self.loss = self.history.loss

    def read_history(self, h: History) -> None:
        """The run so far, read from its folder by a viewer: the figures the panels show, as the
        events that made it would have left them."""
        self.history = h
        self._forecast = self.aim = None
        last = h.last
        if h.count:
            self.step, self.loss, self.first_loss = h.last_step, h.loss, h.first_loss
            self.lr = last.lr if last else h.tail[-1].lr if h.tail else None
            self.grad_norm, self.mem = (last.grad_norm, last.mem or {}) if last else (None, {})
            s = self.schedules
            self.tokens_seen = s.tokens_before(h.last_step) if s else h.last_step * self.tokens_per_step
            if self.train_started_at is None:
                self.train_started_at = self.clock()
            self.pace.read(h.recent())  # the very step time the host folded from the same steps
            if last and last.mfu is not None and last.dt:
                self.mfu_seconds = last.mfu * last.dt
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
        task = self.target_task[0]
        value = (ev.tasks.get(task) or {}).get("accuracy") if task else ev.val_loss
        if self.aim is not None and value is not None:
            self.aim.add(ev.step, float(value))
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
        if self.aim is None:
            self.aim = Evaluations()
            for step, value in self.tasks.get(task, []) if task else zip(self.val_steps, self.val_losses):
                self.aim.add(step, value)
        if self._forecast is None:
            self._forecast = forecast_aim(self.target, task, accuracy, self.aim.values(), self.tokens_per_step,
                                          self.max_steps, self.dt_ema)
        return self._forecast

    @property
    def eta(self) -> float | None:
        """`eta`: the same figure `ps` reads from the run host's live.json."""
        if self.ended_at is not None:  # aborted or failed short of max_steps: nothing is coming
            return None
        s = self.schedules
        if s and self.dt_ema and 0 < self.step < self.max_steps:
            # A step's time taken in proportion to its tokens: the steps left, counted in the last one's
            ahead = (s.tokens_before(self.max_steps) - s.tokens_before(self.step)) / s.step_tokens(self.step - 1)
            return self.dt_ema * ahead
        return eta(self.step, self.max_steps, self.dt_ema)

    def catchup(self, reason: str, began: float | None = None) -> tuple[object, ...]:
        """What a viewer that joins (or fell behind, `reason` "lagged") is handed, as events: the
        run's RunStarted (it resets a view), when the run began (`began`, wall clock), the log's
        end (on joining: a lagged view has the lines it showed), the history as one HistoryRead, then
        the state, progress and failure now. Not copies: the caller pickles them before this state
        folds another event."""
        events: list[object] = [self.run_started] if self.run_started else []
        events += [P.Began(began)] if began else []
        events += [P.LogLine(text) for text in self.log_tail] if reason != "lagged" else []
        events.append(P.HistoryRead(self.history))
        if self.state != self.engine_state:  # stalled: the state the stall hides (what it said is gone), then the stall
            events.append(P.StateChanged(self.engine_state))
        events.append(P.StateChanged(self.state, self.state_detail))
        events += [self.progress] if self.progress else []
        events += [self.failure] if self.failure else []
        return tuple(events)


def run_config(raw: dict) -> Config | None:
    """The run's config from the dict RunStarted carries (the engine's validated Config, as a
    dict to cross the queue); None where this lmcockpit cannot read it (a host of another version):
    the views then go without its target and cost, as for a run that names none."""
    try:
        return config_from_dict(raw, source="the run's config")
    except ConfigError:
        return None


"""Metrics where teams look: TensorBoard event files and a Weights & Biases run, beside metrics.jsonl.

Every row the Trainer writes goes through `Metrics`: to metrics.jsonl first, then its scalars to
each logger [logging] turned on. A logger may never stop training: the first error one raises,
starting, writing or closing, is reported once in the log (train.log, the cockpit's log pane) and
that logger is switched off. tensorboard and wandb are imported only when a logger starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from pathlib import Path
from typing import Any, Callable, Protocol

from .. import protocol as P
from ..config import Config
from ..run.folder import TENSORBOARD, WANDB, MetricsLog
from ..run.safe_files import own_dir, pinned_dir, write_whole

WANDB_ID = "wandb_id"  # the W&B run's id, so that --resume continues the same W&B run
CLOSE_WAIT = 60.0  # s a logger may take to close (W&B uploads what is left) before the engine exits without it

TASK_SCORES = ("accuracy", "centered")  # each task's, as eval/TASK/accuracy; `tasks` is spread below
PREFIXES = ("train", "val", "perf", "memory", "eval")


def scalars(event: Any) -> dict[str, float]:
    """An event's numbers under their tags (protocol's `tagged` fields); those that are None (no
    MFU on a CPU) are left out. A step's memory and an evaluation's task scores are spread."""
    out = {f.metadata["tag"]: float(value) for f in dataclasses.fields(event)
           if "tag" in f.metadata and (value := getattr(event, f.name)) is not None}
    if isinstance(event, P.StepMetrics):
        for key, value in (event.mem or {}).items():  # allocated, reserved, peak: bytes
            out[f"memory/{key}_gib"] = value / 2**30
    if isinstance(event, P.EvalMetrics):
        for task, scores in event.tasks.items():
            out.update({f"eval/{task}/{key}": float(scores[key]) for key in TASK_SCORES})
    return out


class Logger(Protocol):
    name: str

    def write(self, step: int, values: dict[str, float]) -> None: ...

    def close(self, failed: bool) -> None: ...


class TensorBoardLogger:
    name = "tensorboard"

    def __init__(self, run_dir: Path, step: int):
        from torch.utils.tensorboard import SummaryWriter

        # Its writes go through a descriptor held open (safe_files.pinned_dir): a link planted at
        # tensorboard/ during the run never receives them.
        self.folder = contextlib.ExitStack()
        at = self.folder.enter_context(pinned_dir(run_dir / TENSORBOARD))
        # A resumed run redoes the steps after its checkpoint: purge_step makes TensorBoard drop
        # what the first attempt wrote from there on, as metrics.jsonl drops those lines.
        self.writer = SummaryWriter(str(at), purge_step=step + 1 if step else None, flush_secs=10)

    def write(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def close(self, failed: bool) -> None:
        self.writer.close()
        self.folder.close()


class WandbLogger:
    name = "wandb"

    def __init__(self, project: str, run_dir: Path, config: dict[str, Any]):
        import wandb

        # W&B's own processes write under wandb/, by name: it is checked as the user's folder
        # (not a link another account planted) before they start; they cannot be handed a descriptor.
        own_dir(run_dir / WANDB)
        id_file = run_dir / WANDB_ID
        saved = id_file.read_text().strip() if id_file.is_file() else None
        # console="off": the engine's stdout and stderr are already a pipe into train.log.
        self.run = wandb.init(project=project, dir=str(run_dir), config=config, name=run_dir.name, id=saved,
                              resume="allow", settings=wandb.Settings(console="off"))
        if saved is None:
            write_whole(id_file, self.run.id + "\n")  # a fresh name, never a link planted at a guessable one
        # W&B's own step (log(step=...)) may only go up: the steps a resume from an earlier checkpoint
        # redoes would be dropped. Rows go in at W&B's counter instead, charted against a `step` of ours.
        self.run.define_metric("step")
        for prefix in PREFIXES:
            self.run.define_metric(f"{prefix}/*", step_metric="step")

    def write(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **values})

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def start_loggers(cfg: Config, run_dir: Path, step: int) -> list[tuple[str, Callable[[], Logger]]]:
    """The loggers the config asks for, each as (name, how to start it): started by `Metrics`, so
    a logger that fails to start is reported like one that fails later."""
    wanted: list[tuple[str, Callable[[], Logger]]] = []
    if cfg.logging.tensorboard:
        wanted.append((TensorBoardLogger.name, lambda: TensorBoardLogger(run_dir, step)))
    if cfg.logging.wandb:
        # [notify] holds URLs with their tokens, and says nothing of how the run trains: an online
        # W&B run would upload them with the rest of its config.
        config = {section: values for section, values in cfg.to_dict().items() if section != "notify"}
        wanted.append((WandbLogger.name, lambda: WandbLogger(cfg.logging.wandb, run_dir, config)))
    return wanted


class Metrics:
    """metrics.jsonl plus the loggers: what the main rank's Trainer writes its rows to."""

    def __init__(self, jsonl: MetricsLog, log: Callable[[str], None]):
        self.jsonl, self.log = jsonl, log
        self.loggers: list[Logger] = []

    def start(self, wanted: list[tuple[str, Callable[[], Logger]]]) -> None:
        for name, make in wanted:
            try:
                self.loggers.append(make())
            except Exception as e:  # noqa: BLE001 - a logger must not stop the run, whatever it raised
                self.switch_off(name, "could not start", e)

    def write(self, event: Any) -> None:
        """`event`'s row (one of protocol's with a `kind`) to metrics.jsonl, its numbers to the loggers."""
        self.jsonl.write(event)
        values = scalars(event) if self.loggers else None  # most runs log to metrics.jsonl alone
        if not values:
            return
        for logger in list(self.loggers):
            try:
                logger.write(event.step, values)
            except Exception as e:  # noqa: BLE001 - a logger's failure, whatever it is, must never stop training
                self.loggers.remove(logger)
                self.switch_off(logger.name, f"failed at step {event.step}", e)

    def close(self, failed: bool = False) -> None:
        """`failed`: the run ended in a failure, which W&B shows as the run's state."""
        self.jsonl.close()
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            error = within(CLOSE_WAIT, lambda: logger.close(failed))
            if error is not None:
                self.log(f"warning: {logger.name} logging could not close ({one_line(error)})")

    def switch_off(self, name: str, when: str, error: BaseException) -> None:
        self.log(f"warning: {name} logging {when} ({one_line(error)}); it is switched off, training goes on")


def one_line(error: BaseException) -> str:
    return (f"{type(error).__name__}: {error}".strip().splitlines() or [type(error).__name__])[0]


def within(seconds: float, work: Callable[[], None]) -> BaseException | None:
    """`work`'s error, or a TimeoutError when it took longer than `seconds` (left running in a
    daemon thread: an upload that hangs must not keep the engine from exiting)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except Exception as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)

    thread = threading.Thread(target=run, name="logger-close", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        return TimeoutError(f"still closing after {seconds:g} s; left behind")
    return errors[0] if errors else None

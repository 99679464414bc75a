"""The messages between a front-end and the engine process: frozen dataclasses, no tensors.

Events flow engine → front-end on one queue, commands front-end → engine on another. Both
front-ends (the Textual cockpit and the headless console) speak exactly this, nothing else.

The events with a `kind` are also the schema of metrics.jsonl: a row is one such event, its kind,
the time and its fields in this order (core/run/rows.py writes and reads them; a field marked
NOT_IN_ROW travels only on the queue). A row may lack a field whose type admits None (read as
None) or that has a default; every other field it must hold, of its type. A field's `tag` is its
name in TensorBoard and W&B (core/train/loggers.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, TypedDict

from .config import ConfigError, choices_of


# Run states, in the order a healthy run passes through them.
PREPARING = "preparing data"
COMPILING = "compiling"
RUNNING = "running"
PAUSED = "paused"
EVALUATING = "evaluating"
CHECKPOINTING = "checkpointing"
FINISHED = "finished"
ABORTED = "aborted"
FAILED = "failed"
INTERRUPTED = "interrupted"
# Not the engine's: what the process owning it says when the engine has gone silent (process/stall.py).
STALLED = "stalled"
TERMINAL_STATES = frozenset({FINISHED, ABORTED, FAILED, INTERRUPTED})
ENDED = (FINISHED, ABORTED, INTERRUPTED)  # an `end` row's states; a failure writes a `failure` row
SPIKE_ACTIONS = choices_of("training.on_spike")  # what a spike row says was done


# ------------------------------------------------------------------------------ row fields
NOT_IN_ROW = {"row": False}


def tagged(tag: str, **kwargs: Any) -> Any:
    """A field that TensorBoard and W&B show under `tag`."""
    return field(metadata={"tag": tag}, **kwargs)


def choice_of(*choices: str) -> Any:
    return field(metadata={"choices": choices})


class TaskScores(TypedDict):
    """A task's entry in an evaluation's `tasks`."""
    accuracy: float
    centered: float
    items: int


# ------------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class RunStarted:
    run_dir: str
    config: dict[str, Any]
    n_params: int
    device: str
    precision: str
    start_step: int
    max_steps: int
    tokens_per_step: int
    world: int = 1  # training processes, all nodes together
    # This node's devices, one per local process ("cuda:0", "cuda:1"); empty: just `device`.
    devices: tuple[str, ...] = ()
    # The UUID of each of `devices` ("" for the CPU or where torch cannot say), which is how the
    # front-end finds their NVML readings; empty from an engine that does not send them.
    device_uuids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Progress:
    """A long preparation phase (tokenizer training, tokenising): done out of total units."""
    phase: str
    done: int
    total: int
    unit: str = ""


@dataclass(frozen=True)
class StepMetrics:
    """An optimizer step: `mem` is the device's allocated, reserved and peak bytes (none on a CPU)."""
    kind: ClassVar[str] = "step"
    step: int
    loss: float = tagged("train/loss")
    lr: float = tagged("train/lr")
    grad_norm: float = tagged("train/grad_norm")
    tokens_per_s: float = tagged("perf/tokens_per_s")
    mfu: float | None = tagged("perf/mfu")  # None: no known peak (a CPU)
    dt: float = field()
    tokens_seen: int | None = field()  # None: a row from before steps said it
    mem: dict[str, float] | None = field(default_factory=dict)  # bytes; None: a row from before {} was written
    # Where the step's seconds went (run/anatomy.py: data, compute, sync, optimizer; empty for the
    # step that compiled), and the seconds spent since the step before on other work (evaluation,
    # tasks, samples, checkpoints, compile). Empty in a row from before steps said them.
    parts: dict[str, float] = field(default_factory=dict)
    between: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalMetrics:
    """An evaluation's results: the validation loss, the task scores, or both (each has its own
    cadence, eval.every and eval.tasks_every). `tasks` maps a task's name to its
    {"accuracy": A, "centered": C, "items": N}; `core` is the CORE score, when every CORE task
    was scored."""
    kind: ClassVar[str] = "eval"
    # A row with neither says nothing of the run.
    needs_one_of: ClassVar[tuple[str, ...]] = ("val_loss", "tasks")
    step: int
    val_loss: float | None = tagged("val/loss")
    val_bpb: float | None = tagged("val/bpb")
    tasks: dict[str, TaskScores] = field(default_factory=dict)
    core: float | None = tagged("eval/core", default=None)


@dataclass(frozen=True)
class CheckpointWritten:
    kind: ClassVar[str] = "checkpoint"
    step: int
    path: str


@dataclass(frozen=True)
class SpikeSeen:
    """A loss spike at `step`, and what training.on_spike did: warn, skip, rollback or stop. The
    loss and gradient norm against the window's mean: their z-scores (z_grad None where the
    gradient norm did not stand out enough to say)."""
    kind: ClassVar[str] = "spike"
    step: int
    loss: float
    action: str = choice_of(*SPIKE_ACTIONS)
    mean_loss: float
    z: float
    grad_norm: float
    z_grad: float | None
    live: bool = field(default=True, metadata=NOT_IN_ROW)  # False: read back from metrics.jsonl by a viewer catching up, not news


@dataclass(frozen=True)
class RolledBack:
    """Training went back from the spike at `step` to the checkpoint of `to_step`: the steps after
    `to_step` shown so far are no longer the run's, and will come again on other batches. The
    learning rate is `lr_factor` times the schedule's for `lr_steps` steps from `to_step`."""
    kind: ClassVar[str] = "rollback"
    step: int
    to_step: int
    batches_skipped: int
    rollbacks: int  # this run's so far, this one included
    lr_factor: float
    lr_steps: int


@dataclass(frozen=True)
class TargetReached:
    """The first evaluation to reach the run's target: `what` is "val_loss" (at or under
    training.target_val_loss) or the task of training.target_task (its accuracy at or above)."""
    kind: ClassVar[str] = "target"
    step: int
    what: str
    value: float
    target: float
    seconds: float | None = None  # the run's training time when it was reached (rank 0 knows it)


@dataclass(frozen=True)
class NonFinite:
    """A non-finite loss or gradient at `step`; `action` "skip" (training goes on) or "stop"."""
    step: int
    action: str


@dataclass(frozen=True)
class SampleText:
    """A piece of generated text of sample `row`; `done` marks the end of the whole request."""
    request_id: str
    step: int
    prompt: str
    text: str
    done: bool = False
    row: int = 0


@dataclass(frozen=True)
class Sampled:
    """A whole sample as metrics.jsonl keeps it (the queue carries its pieces, SampleText)."""
    kind: ClassVar[str] = "sample"
    step: int
    prompt: str
    text: str


@dataclass(frozen=True)
class Ended:
    """How the engine's training ended when it did not fail: a stop at the target and an abort
    both end short of max_steps, and only the engine knows which it was (a row; the queue says it
    with StateChanged)."""
    kind: ClassVar[str] = "end"
    step: int
    state: str = choice_of(*ENDED)
    between: dict[str, float] = field(default_factory=dict)  # the last step's evaluation and checkpoint (StepMetrics')


@dataclass(frozen=True)
class Failed:
    """A run's failure as metrics.jsonl keeps it (the queue carries Failure)."""
    kind: ClassVar[str] = "failure"
    step: int
    message: str


@dataclass(frozen=True)
class Profiled:
    """A profile of `steps` training steps from `step` on (core/train/profiling.py): its trace (a
    path in the run folder; `memory` the CUDA memory history's, "" where none was recorded) and
    a summary: seconds by kind of work (`kinds`: matmul, attention, elementwise, optimizer,
    communication, copies, other, idle) and the operators that took the most self time, on the
    CPU (`top`) and on the GPU (`top_cuda`, empty on a CPU), in seconds over the profiled steps."""
    kind: ClassVar[str] = "profile"
    step: int
    steps: int
    trace: str
    seconds: float  # the profiled steps' wall time
    kinds: dict[str, float] = field(default_factory=dict)
    top: dict[str, float] = field(default_factory=dict)
    top_cuda: dict[str, float] = field(default_factory=dict)
    memory: str = ""


@dataclass(frozen=True)
class LayerStats:
    """Each transformer block's health at `step` (logging.layer_stats_every; core/train/layer_stats.py):
    its gradient norm before clipping, and its update-to-weight ratio, ||W after - W before|| /
    ||W before|| over the block's parameters, a list entry per block from the first. The embedding
    (which is also the head) with the final norm is `embed_*`: not a block."""
    kind: ClassVar[str] = "layers"
    step: int
    grad_norm: list[float]
    update_ratio: list[float]
    embed_grad_norm: float
    embed_update_ratio: float


@dataclass(frozen=True)
class Note:
    """Something metrics.jsonl says of itself (rows a full disk cost)."""
    kind: ClassVar[str] = "note"
    text: str


@dataclass(frozen=True)
class LogLine:
    text: str


@dataclass(frozen=True)
class StateChanged:
    state: str
    detail: str = ""


@dataclass(frozen=True)
class Failure:
    message: str
    traceback: str = ""
    user_error: bool = False  # a mistake in the input (bad data path, corpus too small): exit 2


@dataclass(frozen=True)
class Catchup:
    """From a run host to one viewer: the run so far as events (`snapshot`: RunState.catchup's,
    the host's fold of every event before the next one this viewer gets), then live events. Sent
    on attaching and after the viewer fell behind and events for it were dropped."""
    reason: str  # "attached" | "lagged"
    snapshot: tuple = ()
    viewers: int = 1


@dataclass(frozen=True)
class Began:
    """Not from the engine: when this start of the run began by the wall clock (time.time()), as
    the run host that owns it recorded in live.json's `started`. A viewer is handed it before the
    run's history, so that elapsed is the run's own, the same in every viewer, not the time since
    that viewer attached."""
    at: float


@dataclass
class HistoryRead:
    """Not from the engine: the run so far in a history whose size does not grow with it, as the
    run host folded it (or read it from the run folder, core/run/history_file.py). It replaces
    whatever history a front-end had folded; live events follow from where it ends."""
    history: Any  # core.run.history.History


FAILED_LINE = "engine: run failed: "  # how train.log records a failure; the front-ends say it their way


class RunFailure(RuntimeError):
    """The engine cannot go on, for a reason its message says in full (non-finite loss, out of GPU
    memory): a Failure with no traceback, which would only add the engine's own frames."""


# ----------------------------------------------------------------------------------- commands
@dataclass(frozen=True)
class Pause:
    pass


@dataclass(frozen=True)
class Resume:
    pass


@dataclass(frozen=True)
class CheckpointNow:
    pass


@dataclass(frozen=True)
class Profile:
    """Profile the next `steps` training steps after one warm-up step; `memory`: also record the
    CUDA memory history (a GPU's only)."""
    steps: int = 5
    memory: bool = False


@dataclass(frozen=True)
class Abort:
    """Stop the run; with `save`, after writing a checkpoint of the current step."""
    save: bool = True
    interrupted: bool = False  # a signal asked for it: the run ends as INTERRUPTED, exit 130


@dataclass(frozen=True)
class Sample:
    """Continue `prompt` in `num_samples` rows, each drawn on its own; `greedy` (or temperature 0)
    takes the most likely token instead. top_k 0 and top_p 1 switch those filters off.
    With `messages`, a chat model's turn: the conversation so far as (role, text) pairs, the user's
    last (`prompt` then repeats it, for a view to show), rendered in the chat template
    (core/data/chat_template.py); the reply ends at <|assistant_end|>."""
    request_id: str
    prompt: str
    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: int = 50
    seed: int = 0
    top_p: float = 1.0
    num_samples: int = 1
    greedy: bool = False
    messages: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Cancel:
    """Stop generating for request `request_id`. The chat engine honours it; the trainer does not
    yet (its samples are short, and training waits for them)."""
    request_id: str


# -------------------------------------------------------------------------- sampling settings
@dataclass(frozen=True)
class Setting:
    kind: type
    expected: str  # said to the user when a value is refused
    ok: Callable[[Any], bool]


# The sampling settings a request carries, with their valid ranges: one place for the chat
# command's flags, its REPL and the engines that answer requests.
SAMPLE_SETTINGS: dict[str, Setting] = {
    "max_new_tokens": Setting(int, "a positive integer", lambda v: v > 0),
    "temperature": Setting(float, "a number, 0 or more (0: greedy)", lambda v: math.isfinite(v) and v >= 0),
    "top_k": Setting(int, "an integer, 0 (off) or more", lambda v: v >= 0),
    "top_p": Setting(float, "a number in (0, 1] (1: off)", lambda v: 0 < v <= 1),
    "num_samples": Setting(int, "an integer from 1 to 64", lambda v: 1 <= v <= 64),
    "seed": Setting(int, "an integer, 0 or more", lambda v: 0 <= v < 2**63),
    "greedy": Setting(bool, "on or off", lambda v: True),
}
_BOOLS = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}


def parse_setting(key: str, text: str) -> Any:
    """A setting's value from text (a flag, a REPL `set`); a ConfigError saying what is expected."""
    setting = SAMPLE_SETTINGS[key]
    try:
        value = _BOOLS[text.lower()] if setting.kind is bool else setting.kind(text)
    except (KeyError, ValueError):
        value = None
    if value is None or not setting.ok(value):
        raise ConfigError(f"expected {setting.expected}, got {text!r}")
    return value


def check_sample(request: Sample) -> None:
    for key, setting in SAMPLE_SETTINGS.items():
        value = getattr(request, key)
        if not (_is_a(setting.kind, value) and setting.ok(value)):
            raise ConfigError(f"{key} = {value!r}: expected {setting.expected}")
    if request.messages:
        check_messages(request.messages)


CHAT_ROLES = ("system", "user", "assistant")


def check_messages(messages: tuple[tuple[str, str], ...]) -> None:
    """A chat request's conversation: (role, text) pairs, a system message first if at all, then
    turns alternating from the user's, the user's last (chat_template.prompt_ids' order)."""
    turns = messages[1:] if messages and messages[0][0] == "system" else messages
    for i, pair in enumerate(messages):
        if not (isinstance(pair, tuple) and len(pair) == 2 and pair[0] in CHAT_ROLES and isinstance(pair[1], str)):
            raise ConfigError(f"messages[{i}] = {pair!r}: expected (role, text), the role one of {', '.join(CHAT_ROLES)}")
    expected = [("user", "assistant")[i % 2] for i in range(len(turns))]
    if not turns or [role for role, _ in turns] != expected or len(turns) % 2 == 0:
        raise ConfigError(f"messages: roles {[role for role, _ in messages]}: expected a system message first if "
                          "any, then turns alternating from the user's, the user's last")


def _is_a(kind: type, value: Any) -> bool:
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)

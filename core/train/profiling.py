"""A profile of a few training steps while the run trains on: torch.profiler, asked for at any time.

A front-end's `Profile` command (the cockpit's `f`) or `profile.at_step` starts the profiler before
a warm-up step (recorded by the profiler, then dropped: its first step pays for starting up), then
records the next `steps` steps: the CPU's operators always, the GPU's kernels where the run has
one, and the Python stack, which is what puts the model's modules (`nn.Module: Block_0`) in the
trace (a compiled model shows only its outermost module: the compiled graph runs no Python of
the modules inside it). The trace goes to `profiles/step_N/trace.json.gz` (N: the first step recorded; Perfetto and
chrome://tracing open it), a summary to the log and a `profile` row, and the profiler is stopped:
the steps after it run as fast as those before. With `memory` on a GPU, the CUDA allocator's history
over the same steps goes beside it as `memory.pickle` (pytorch.org/memory_viz).

The summary's seconds by kind of work are the operators' self time (on a GPU, their kernels'),
each operator sorted by its name, everything inside the optimizers' `step` as optimizer; `idle` is
the rest of the steps' wall time, in no operator (Python, the data, waiting). Under several
processes rank 0 alone profiles, and its trace stands for the run; the other ranks train as before
(and wait for it at each step's collectives, as they would for any slower rank).
"""

from __future__ import annotations

import contextlib
import gzip
import pickle
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from .. import protocol as P
from ..run.folder import PROFILES
from ..run.safe_files import pinned_dir, write_whole

TOP = 10  # operators in the summary's lists
MAX_STEPS = 1000  # profile.steps' bound: a trace of every call grows with each step
KINDS = ("matmul", "attention", "elementwise", "optimizer", "communication", "copies", "other", "idle")
# What the profiler records with the Python stack that is no operator: its time is no operator's.
PYTHON = re.compile(r"nn\.Module: |<built-in |<frozen |.*\.py\(\d+\): |ProfilerStep")
COMMUNICATION = ("nccl", "c10d", "gloo", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                 "broadcast", "barrier")
MATMUL = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm", "gemm", "_scaled_mm", "conv")
COPIES = ("copy_", "to", "_to_copy", "contiguous", "clone", "_copy_from", "_copy_from_and_resize", "memcpy",
          "cudamemcpy", "tocopybackward", "clonebackward", "copybackwards", "pin_memory", "_pin_memory")
ELEMENTWISE = ("add", "sub", "mul", "div", "neg", "pow", "sqrt", "rsqrt", "exp", "log", "silu", "gelu", "relu",
               "sigmoid", "tanh", "softmax", "_softmax", "log_softmax", "_log_softmax", "logsoftmax", "mean", "sum",
               "norm", "linalg_vector_norm", "rms_norm", "_fused_rms_norm", "layer_norm", "native_layer_norm",
               "where", "clamp", "fill_", "zero_", "lerp", "cos", "sin", "cat", "stack", "abs", "maximum",
               "minimum", "sign", "reciprocal", "nll_loss", "nllloss", "cross_entropy", "embedding", "dropout",
               "masked_fill", "triu", "tril", "_foreach", "cpp_fused", "triton_", "fused", "unbind", "rotary",
               "_unsafe_view", "_amp", "isfinite", "eq", "ne", "lt", "gt", "le", "ge", "bitwise", "any", "all",
               "stack", "max", "min", "rsub")


def kind_of(name: str, in_optimizer: bool) -> str:
    """The kind of work an operator of this name does (KINDS); its last part decides
    ("autograd::engine::evaluate_function: MmBackward0" is a matmul's backward)."""
    if in_optimizer:
        return "optimizer"
    if PYTHON.match(name):
        return "idle"
    whole = name.lower()
    if any(c in whole for c in COMMUNICATION):
        return "communication"
    if "attention" in whole or "sdpa" in whole or "flash" in whole:
        return "attention"
    last = re.split(r"::|: ", whole)[-1].strip()
    if last.startswith(MATMUL):
        return "matmul"
    if last in COPIES or last.startswith(COPIES[7:]):
        return "copies"
    if last.startswith(ELEMENTWISE):
        return "elementwise"
    return "other"


def in_optimizer(event) -> bool:
    """Whether `event` runs inside an optimizer's step (torch.optim marks each `Optimizer.step#...`)."""
    while event is not None:
        if event.name.startswith("Optimizer."):
            return True
        event = event.cpu_parent
    return False


def summary(events, cuda: bool) -> tuple[float, dict[str, float], dict[str, float], dict[str, float]]:
    """(the profiled steps' wall seconds, seconds by kind, top operators by CPU self time, by GPU
    self time) from the profiler's events."""
    wall = sum(e.cpu_time_total for e in events if e.name.startswith("ProfilerStep")) / 1e6
    kinds = dict.fromkeys(KINDS, 0.0)
    top: dict[str, float] = {}
    top_cuda: dict[str, float] = {}
    for e in events:
        python = PYTHON.match(e.name) is not None
        own = (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6
        kind = kind_of(e.name, in_optimizer(e))
        if kind != "idle":  # idle: the wall time no operator took, below
            kinds[kind] += max(own, 0.0)
        if not python:
            top[e.name] = top.get(e.name, 0.0) + e.self_cpu_time_total / 1e6
            if cuda:
                top_cuda[e.name] = top_cuda.get(e.name, 0.0) + e.self_device_time_total / 1e6
    busy = sum(v for k, v in kinds.items() if k != "idle")
    kinds["idle"] = max(wall - busy, 0.0)

    def largest(seconds: dict[str, float]) -> dict[str, float]:
        return {name: round(s, 6) for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:TOP] if s > 0}
    return round(wall, 6), {k: round(v, 6) for k, v in kinds.items()}, largest(top), largest(top_cuda)


class Profiling:
    def __init__(self, trainer):
        self.trainer = trainer  # the Trainer whose part this is (its module imports this one)
        self.asked: tuple[P.Profile, int] | None = None  # a profile to start before the next step, its warm-up steps
        self.profiler: profile | None = None
        self.first = self.count = 0  # the first step recorded, and how many
        self.left = 0  # train_step calls the profiler still sees (the warm-up's included)
        self.memory = False
        self.events = None  # the recorded events, once the last step is recorded
        self.private: Path | None = None  # where torch wrote the trace, before it is gzipped into the run folder
        at = trainer.cfg.profile.at_step
        self.at_step = at if trainer.group.is_main else 0  # profile.at_step, until it is started

    def request(self, cmd: P.Profile) -> None:
        tr = self.trainer
        if not tr.group.is_main:  # rank 0's profile stands for the run
            return
        if not 0 < cmd.steps <= MAX_STEPS:
            tr.log(f"profile: {cmd.steps} steps asked for; a profile records 1 to {MAX_STEPS}: refused")
            return
        if self.profiler is not None or self.asked is not None:
            busy = f"steps {self.first}-{self.first + self.count - 1}" if self.profiler else "the next steps"
            tr.log(f"profile: one is being taken already ({busy}): this request is refused; ask again once it "
                   "is written")
            return
        self.asked = cmd, 1

    @contextlib.contextmanager
    def around_step(self) -> Iterator[None]:
        """A training step, with the profiler started before it where one is asked for, and told of
        it after (not after a step that raised: the run ends, and `close` stops the profiler)."""
        self.before_step()
        yield
        self.after_step()

    def before_step(self) -> None:
        """Start the profiler where one is asked for: the step about to train is its warm-up (none
        where profile.at_step is the next step: step 1, or a resume's first)."""
        tr = self.trainer
        if self.at_step and self.profiler is None and self.asked is None:
            if self.at_step <= tr.step:  # a resume past it
                tr.log(f"profile: profile.at_step = {self.at_step} is behind the run (step {tr.step}): no profile")
                self.at_step = 0
            elif self.at_step - tr.step <= 2:
                p = tr.cfg.profile
                self.asked, self.at_step = (P.Profile(p.steps, p.memory), self.at_step - tr.step - 1), 0
        if self.asked is None or self.profiler is not None:
            return
        with tr.between.timing("profile"):
            self.start(*self.asked)
        self.asked = None

    def start(self, cmd: P.Profile, warmup: int) -> None:
        tr = self.trainer
        cuda = tr.device.type == "cuda"
        self.first, self.count, self.left, self.events = tr.step + 1 + warmup, cmd.steps, warmup + cmd.steps, None
        self.memory = cmd.memory and cuda
        if cmd.memory and not cuda:
            tr.log("profile: the memory history is the CUDA allocator's: none on this run's CPU")
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, device=tr.device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.profiler = profile(activities=activities, schedule=schedule(wait=0, warmup=warmup, active=cmd.steps, repeat=1),
                                on_trace_ready=self.recorded, with_stack=True)
        self.profiler.start()
        tr.log(f"profile: recording steps {self.first}-{self.first + cmd.steps - 1}"
               f"{' after a warm-up step' if warmup else ''}; the trace goes to {self.folder / 'trace.json.gz'}")

    @property
    def folder(self) -> Path:
        return self.trainer.run_dir / PROFILES / f"step_{self.first}"

    def recorded(self, prof: profile) -> None:
        """The schedule's last step is recorded: its events, and the trace. torch writes the trace
        to a path it opens itself, so it goes to a private folder first; the run folder's own
        writes never follow a link (safe_files)."""
        self.events = prof.events()
        self.private = Path(tempfile.mkdtemp(prefix="lmcockpit-profile-"))
        try:
            prof.export_chrome_trace(str(self.private / "trace.json"))
        except OSError as e:  # a full /tmp: the summary is still told; `write` says what became of the trace
            self.trainer.log(f"warning: profile: the trace could not be exported ({e})")

    def after_step(self) -> None:
        """Count the step the profiler saw; after the last, stop it and write what it recorded."""
        if self.profiler is None:
            return
        self.left -= 1
        self.profiler.step()
        if self.left > 0:
            return
        with self.trainer.between.timing("profile"):
            self.finish()

    def finish(self) -> None:
        tr = self.trainer
        prof, self.profiler = self.profiler, None
        prof.stop()
        snapshot = torch.cuda.memory._snapshot() if self.memory else None
        if self.memory:
            torch.cuda.memory._record_memory_history(enabled=None, device=tr.device)
        cuda = tr.device.type == "cuda"
        wall, kinds, top, top_cuda = summary(self.events or [], cuda)
        self.events = None
        del prof
        try:
            trace, memory = self.write(snapshot)
        except OSError as e:  # a full disk, a link planted at profiles/: the run goes on without the files
            tr.log(f"warning: profile: not written to {self.folder} ({e}); training goes on")
            trace = memory = ""
        event = P.Profiled(self.first, self.count, trace, wall, kinds, top, top_cuda, memory)
        for line in lines(event, cuda):
            tr.log(line)
        tr.record(event)

    def write(self, snapshot) -> tuple[str, str]:
        """The trace, gzipped, and the memory history, in the run folder: their paths ("" for none)."""
        private, self.private = self.private, None
        if private is None:
            raise FileNotFoundError("the profiler handed over no trace")
        try:
            with pinned_dir(self.trainer.run_dir / PROFILES) as root, pinned_dir(root / self.folder.name) as folder:
                with open(private / "trace.json", "rb") as fh:
                    write_whole(folder / "trace.json.gz", chunks_gzipped(fh))
                if snapshot is not None:
                    write_whole(folder / "memory.pickle", pickle.dumps(snapshot))
        finally:
            shutil.rmtree(private, ignore_errors=True)
        return str(self.folder / "trace.json.gz"), str(self.folder / "memory.pickle") if snapshot is not None else ""

    def close(self) -> None:
        """A run that ends while profiling (an abort, a failure) leaves no profiler running."""
        if self.profiler is not None:
            prof, self.profiler = self.profiler, None
            prof.on_trace_ready = None  # a profile cut short is not written
            prof.stop()
            if self.memory:
                torch.cuda.memory._record_memory_history(enabled=None, device=self.trainer.device)


def chunks_gzipped(fh, size: int = 1 << 20):
    """The file `fh` gzipped, a piece at a time (a trace of a big model's steps is hundreds of MB)."""
    out = _Pieces()
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=6, mtime=0) as gz:
        while chunk := fh.read(size):
            gz.write(chunk)
            yield from out.take()
    yield from out.take()


class _Pieces:
    """A file-like sink that GzipFile writes into and `take` empties."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.pieces.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass

    def take(self) -> list[bytes]:
        pieces, self.pieces = self.pieces, []
        return pieces


def lines(event: P.Profiled, cuda: bool) -> list[str]:
    """The summary as the log shows it: the kinds of work, then the top operators."""
    total = sum(event.kinds.values()) or 1.0
    kinds = ", ".join(f"{k} {100 * s / total:.0f}%" for k, s in sorted(event.kinds.items(), key=lambda kv: -kv[1])
                      if s > 0)
    out = [f"profile: steps {event.step}-{event.step + event.steps - 1} took {event.seconds:.3f} s "
           f"({'GPU' if cuda else 'CPU'} time: {kinds}); trace: {event.trace or 'not written'}"]
    for label, top in (("CPU", event.top), ("GPU", event.top_cuda)):
        if top:
            out.append(f"profile: top {label} operators by self time: "
                       + ", ".join(f"{name} {1000 * s:.1f} ms" for name, s in list(top.items())[:5]))
    if event.memory:
        out.append(f"profile: CUDA memory history: {event.memory} (open it at pytorch.org/memory_viz)")
    return out


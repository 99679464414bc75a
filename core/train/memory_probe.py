"""Memory on the GPU: the largest micro-batch that fits, and what a CUDA out-of-memory error becomes.

The largest micro-batch that fits (training.auto_micro_batch), and what a CUDA out-of-memory
error becomes (`within_memory`): the run's end, with one message that names the place (a training
step, validation, task scoring, sampling under FSDP), what was asked and free, what holds the
memory and what to change, and a snapshot of the allocator when its history was recorded; a
sample that runs out of memory in one process is dropped instead (evaluation.py). Functions of a
set-up trainer (`Fitting`: what they use of it, so this module need not import the Trainer that
imports it): they read its model, data and device, and replace its config's micro-batch. Also the measurement memory_estimate.py's per-token
counts are checked against (`saved_bytes_per_token`)."""

from __future__ import annotations

import dataclasses
import gc
import os
import pickle
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable, Protocol

import psutil
import torch

from .. import protocol as P
from ..config import Config
from ..data import batches
from ..data.cache import TokenData
from ..hardware import memory_estimate
from ..hardware.device import compute_capability
from ..model.gpt import GPT, shape_from_config
from ..run.safe_files import pinned_dir, write_whole


class Fitting(Protocol):
    """What the micro-batch search and the out-of-memory message use of a set-up Trainer."""
    cfg: Config
    device: torch.device
    precision: str
    data: TokenData
    model: torch.nn.Module
    step: int
    saved_step: int | None

    def log(self, text: str) -> None: ...
    def allocate_grads(self) -> None: ...
    def autocast(self) -> AbstractContextManager: ...
    def train_model(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


class OutOfMemory(P.RunFailure):
    """The GPU ran out of memory: the message says where, how much, and what to change."""


def oom_in(e: BaseException | None) -> torch.OutOfMemoryError | None:
    """The out-of-memory error `e` is or was raised because of (the compiler wraps what it hits)."""
    while e is not None and not isinstance(e, torch.OutOfMemoryError):
        e = e.__cause__ or e.__context__
    return e


class CudaMemory:
    """What the micro-batch search asks of the GPU's caching allocator."""

    def __init__(self, trainer: Fitting):
        self.trainer, self.device = trainer, trainer.device

    def budget(self) -> int:
        free, _ = torch.cuda.mem_get_info(self.device)
        return free + torch.cuda.memory_reserved(self.device)

    def fits(self, mb: int) -> bool:
        return trial_step(self.trainer, mb)

    def take_peak(self) -> int:
        """The peak allocated so far, then a fresh count: what training reports is its own."""
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak


class HostMemory:
    """On CPU the estimate against available RAM decides alone: running out there is the OOM
    killer, not an exception a trial could catch; and there is no peak counter to reset."""

    def budget(self) -> int:
        return psutil.virtual_memory().available

    def fits(self, mb: int) -> bool:
        return True

    def take_peak(self) -> int | None:
        return None


def device_memory(trainer: Fitting) -> CudaMemory | HostMemory:
    return CudaMemory(trainer) if trainer.device.type == "cuda" else HostMemory()


def fit_micro_batch(trainer: Fitting, memory: CudaMemory | HostMemory) -> int | None:
    """training.auto_micro_batch: the largest micro-batch the estimator allows, confirmed by a
    trial step and halved on out-of-memory, with accumulation raised to keep the step's tokens.
    Returns the trials' peak allocated memory (None on CPU), after which the peak counts afresh."""
    t = trainer.cfg.training
    effective = t.micro_batch_size * t.grad_accum_steps
    # Estimated at the precision "auto" became here (fp16 on cards without bf16 keeps the plain loss).
    resolved = dataclasses.replace(trainer.cfg, training=dataclasses.replace(t, precision=trainer.precision))
    estimated = memory_estimate.largest_micro_batch(resolved, memory.budget(), trainer.device.type,
                                        compute_capability=compute_capability(trainer.device))
    tried: list[int] = []

    def attempt(n: int) -> bool:
        tried.append(n)
        return memory.fits(n)

    mb = memory_estimate.choose_micro_batch(effective, max(1, estimated), attempt)
    if mb is None:
        raise OutOfMemory(out_of_memory_message(trainer, "a micro-batch of 1 did not fit"))
    trial_peak = memory.take_peak()
    # The search's answer is the run's micro-batch from here on, as if written in the config: the
    # checkpoints' config records it, so a resume (on any number of processes) does not search again.
    trainer.cfg = dataclasses.replace(trainer.cfg, training=dataclasses.replace(
        t, micro_batch_size=mb, grad_accum_steps=effective // mb, auto_micro_batch=False))
    peak = f"; the trials peaked at {trial_peak / memory_estimate.GiB:.2f} GiB allocated" if trial_peak is not None else ""
    trainer.log(f"auto micro-batch: {mb} × {effective // mb} accumulation steps ({effective} sequences a step; "
                f"the estimate allowed {estimated}, tried {', '.join(map(str, tried))}{peak})")
    return trial_peak


def trial_step(trainer: Fitting, mb: int) -> bool:
    """Whether micro-batch `mb` trains without running out of memory: two compiled forward and
    backward passes (the second with the first's gradients alive, as under accumulation) beside
    a block as large as the optimizer state the first real step creates. Leaves the weights,
    the optimizer and every random state untouched."""
    t = trainer.cfg.training
    n = memory_estimate.param_counts(trainer.cfg)
    x, y = (torch.from_numpy(a).to(trainer.device)
            for a in batches.get_batch(trainer.data.train, t.seed, 0, mb, t.seq_len))
    trainer.log(f"auto micro-batch: trying {mb}")

    def passes() -> None:  # its tensors die with its frame, also when it raises
        optimizer_state = torch.empty(8 * n.adamw + 4 * n.muon, dtype=torch.uint8, device=trainer.device)
        trainer.allocate_grads()
        for _ in range(2):
            torch.compiler.cudagraph_mark_step_begin()
            with trainer.autocast():
                loss = trainer.train_model(x, y)
            loss.backward()
        torch.cuda.synchronize(trainer.device)
        del optimizer_state

    try:
        passes()
        ok = True
    except Exception as e:
        if oom_in(e) is None:
            raise
        ok = False
        # An out-of-memory error can stop a CUDA graph half recorded: the next trial starts clean.
        torch.compiler.reset()
    trainer.model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()
    return ok


def out_of_memory_message(trainer: Fitting, error: str, place: str = memory_estimate.STEP,
                          cache_bytes: int | None = None, snapshot: Path | None = None) -> str:
    cfg, device = trainer.cfg, trainer.device
    step = trainer.step + 1 if place == memory_estimate.STEP else trainer.step
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, total, peak = props.name, props.total_memory, torch.cuda.max_memory_allocated(device)
    else:
        name, total, peak = "CPU", psutil.virtual_memory().total, None
    return memory_estimate.out_of_memory_message(cfg, step, error, name, total, peak, trainer.saved_step, place,
                                                 cache_bytes, str(snapshot) if snapshot else None)


def saved_bytes_per_token(cfg, device: str, compiled: bool, amp_dtype: torch.dtype | None,
                          expand_kv: bool = False) -> float:
    """What autograd keeps for backward from one training forward of `cfg`'s model, per token: the
    bytes of every distinct storage saved at micro-batch 2 less those at micro-batch 1, so what
    does not grow with the batch (weights, their casts, the rotary tables) cancels. What
    memory_estimate.layer_activation_bytes and memory_estimate.head_activation_bytes count (and, compiled, the logits).
    `expand_kv`: attention repeats K/V to the query's heads (GPT.expand_kv), as where no kernel
    takes grouped-query attention."""
    T, dev = cfg.training.seq_len, torch.device(device)
    torch.manual_seed(0)
    model = GPT(shape_from_config(cfg)).to(dev)
    model.expand_kv = expand_kv
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved(B: int) -> int:
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        forward = torch.compile(model) if compiled else model
        idx = torch.randint(0, cfg.tokenizer.vocab_size, (B, T), device=dev)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast(dev.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            forward(idx, idx)
        return sum(n for ptr, n in storages.items() if ptr not in params)

    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):  # one graph per micro-batch
        return (saved(2) - saved(1)) / T


def unless_out_of_memory(work: Callable[[], object], device: torch.device,
                         at: tuple[str, int] | None = None) -> tuple[object, str | None]:
    """(work(), None), or (None, the out-of-memory error's text) with the memory it held given
    back; any other error goes through. `at`: the place and step, for the tests' hook."""
    try:
        if at is not None:
            injected_oom(*at)
        return work(), None
    except Exception as e:  # the compiler wraps what it hits: oom_in looks behind, and re-raises the rest
        oom = oom_in(e)
        if oom is None:
            raise
        error = str(oom)
    gc.collect()  # outside the handler: the error's frames no longer hold its tensors
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return None, error


# Where an out-of-memory error can end a run, as LMCOCKPIT_TEST_OOM names them.
PLACES = {"step": memory_estimate.STEP, "validation": memory_estimate.VALIDATION, "tasks": memory_estimate.TASKS,
          "sampling": memory_estimate.SAMPLING}
# What the CUDA allocator raises when the card is full (torch 2.x's wording), for the tests' hook.
TEST_OOM_TEXT = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.64 GiB of which "
                 "1.10 GiB is free. Including non-PyTorch memory, this process has 22.52 GiB memory in use. Of the "
                 "allocated memory 21.30 GiB is allocated by PyTorch, and 300.00 MiB is reserved by PyTorch but "
                 "unallocated.")


def injected_oom(place: str, step: int) -> None:
    """Tests only: with LMCOCKPIT_TEST_OOM=PLACE@N (PLACE one of PLACES' keys; N the step being
    trained, or for the others the step just completed), that place raises what CUDA raises when
    the card is full, so a test on a machine without a GPU runs the real engine into it."""
    if os.environ.get("LMCOCKPIT_TEST_OOM") == f"{place}@{step}":
        raise torch.OutOfMemoryError(TEST_OOM_TEXT)


def within_memory(trainer, place: str, work: Callable[[], object]) -> object:
    """`work`, with an out-of-memory error in it made a RunFailure that says where (`place`, a key
    of PLACES), how much, what holds the memory and what to change. What the allocator held is
    measured, and its recorded history dumped, before the memory is given back. Evaluation and
    sampling run between steps, on the weights of a whole step: one process saves them first
    (several cannot: the other ranks may be inside a collective)."""
    step = trainer.step + 1 if place == "step" else trainer.step
    try:
        injected_oom(place, step)
        return work()
    except Exception as e:  # the compiler wraps what it hits: oom_in looks behind, and re-raises the rest
        oom = oom_in(e)
        if oom is None:
            raise
        error = str(oom)
        cache = snapshot = None
        if trainer.device.type == "cuda":
            cache = torch.cuda.memory_reserved(trainer.device) - torch.cuda.memory_allocated(trainer.device)
            snapshot = dump_snapshot(snapshot_path(trainer.run_dir, step, trainer.group.rank, trainer.group.world))
    gc.collect()  # outside the handler: the error's frames no longer hold its tensors
    if trainer.device.type == "cuda":
        torch.cuda.empty_cache()
    if place != "step" and not trainer.group.distributed and trainer.step > 0:
        trainer.checkpoints.save_final()
    raise OutOfMemory(out_of_memory_message(trainer, error, PLACES[place], cache, snapshot))


def snapshot_path(run_dir: Path, step: int, rank: int = 0, world: int = 1) -> Path:
    """Where the allocator's snapshot goes; each process of a group writes its own."""
    return Path(run_dir) / "profiles" / f"oom_step_{step}" / ("memory.pickle" if world == 1 else f"memory_rank{rank}.pickle")


def dump_snapshot(path: Path) -> Path | None:
    """`path` with the caching allocator's snapshot in it (what torch.cuda.memory._dump_snapshot writes,
    for pytorch.org/memory_viz), or None when no allocation history was being recorded
    (torch.cuda.memory._record_memory_history: its traces are empty without it) or it could not be
    written: the run's failure is the message, a snapshot only its detail."""
    try:
        snapshot = torch.cuda.memory._snapshot()
        if not any(snapshot.get("device_traces") or []):
            return None
        # through folders checked as the user's own (safe_files), as nan_debug writes
        with pinned_dir(path.parent.parent) as profiles, pinned_dir(profiles / path.parent.name) as at:
            write_whole(at / path.name, pickle.dumps(snapshot))
    except (OSError, RuntimeError):
        return None
    return path

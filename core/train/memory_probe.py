"""Memory on the GPU: the largest micro-batch that fits, and what a CUDA out-of-memory error becomes.

The largest micro-batch that fits (training.auto_micro_batch), and the
message a CUDA out-of-memory error becomes. Functions of a set-up trainer (`Fitting`: what they
use of it, so this module need not import the Trainer that imports it): they read its model, data
and device, and replace its config's micro-batch. Also the measurement memory_estimate.py's per-token
counts are checked against (`saved_bytes_per_token`)."""

from __future__ import annotations

import dataclasses
import gc
from contextlib import AbstractContextManager
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


def out_of_memory_message(trainer: Fitting, error: str, doing: str = "training") -> str:
    cfg, device = trainer.cfg, trainer.device
    step = trainer.step + 1 if doing == "training" else trainer.step
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, total, peak = props.name, props.total_memory, torch.cuda.max_memory_allocated(device)
    else:
        name, total, peak = "CPU", psutil.virtual_memory().total, None
    return memory_estimate.out_of_memory_message(cfg, step, error, name, total, peak, trainer.saved_step, doing)


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


def unless_out_of_memory(work: Callable[[], object], device: torch.device) -> tuple[object, str | None]:
    """(work(), None), or (None, the out-of-memory error's text) with the memory it held given
    back; any other error goes through."""
    try:
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

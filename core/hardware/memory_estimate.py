"""Peak training memory from a config, by arithmetic: no torch, so the front-end can judge presets.

What one GPU holds while a run trains (B = micro-batch, T = seq_len, V = vocabulary, L = layers,
N = parameters; `a` = bytes of the autocast dtype: 2 for bf16/fp16, 4 for fp32):

* weights: fp32 master weights, 4·N; with autocast also the 2-byte copies of the matrices that
  autocast caches for the step and the matmuls keep for backward, 2·(N − norms) compiled, where the
  head's copy of the embedding is one of them; eager casts the head's copy inside the loss instead;
* gradients: fp32, 4·N, all of them at the activation peak (the start of backward) from the second
  micro-batch of an accumulated step on, and always under CUDA graphs (`keeps_grads`); otherwise
  none yet, beyond the head's (counted with the loss);
* optimizer state: AdamW keeps two fp32 moments of its parameters (embedding and norms), 8 bytes
  each; Muon one fp32 momentum buffer of its matrices, 4 bytes each. Muon's step also needs a
  working set for the largest group of same-shape matrices it orthogonalises at once;
* activations: what autograd saves for backward, counted tensor by tensor per layer and token
  below (eager and compiled differ: the compiler fuses casts and norms), with the K/V that
  attention repeats to the query's heads where no kernel takes grouped-query attention (fp32 on
  a GPU, fp16 before Ampere: attention.py). With activation checkpointing each layer keeps only
  its input, and backward recomputes one layer at a time;
* the loss: compiled, the (B, T, V) logits in the autocast dtype; eager, the loss is computed a
  block of rows at a time (gpt.LinearCrossEntropy), so one block of logits and the head's
  gradient, never the whole logits;
* evaluation and sampling, between steps (inference_bytes): no activations are kept, so one
  block's working set at the eval batch (eval.batch_size, by default the micro-batch), the loss a block of rows at a time and, for sampling, the KV cache of the
  whole context, beside the weights, their casts and the optimizer state. Not the peak of any
  preset, but counted: a run must not fit its steps and fail at its first evaluation;
* margins for what no formula sees (compile workspaces, allocator fragmentation, the CUDA context).

Under FSDP (distributed.strategy = "fsdp" with several processes) each GPU keeps 1/world of the
fp32 weights, gradients and optimizer state, plus the whole parameters of what is gathered at a
time: the root's (the embedding and final norm, for the whole pass) and two blocks (the one
running and the one prefetched); its gradients stay sharded under accumulation too, since each
micro-batch's are reduce-scattered (group.accumulating). DDP keeps everything whole, its
gradients as views into its communication buckets (no second copy), which exist from the first
step to the last: they are zeroed in place, never freed (grads_between_steps).

What the CPU can check, `tests/test_fit.py` does: the per-token counts against the tensors autograd
saves (eager exactly, fp32 and bf16; compiled within 3%), Muon's working set against the CPU
allocator's events (exactly), and a whole eager step's peak against `estimate(cfg, "cpu")`
(within 1%; 1.5% with activation checkpointing, whose recomputed block's new gradients it
counts whole). The GPU's kernels, inductor's CUDA buffers and the margins, named constants below, are
first estimates: calibrate them against `torch.cuda.max_memory_allocated` with bench/gpu_check.py
(parts memory and saved) before trusting a verdict within a few per cent.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from ..config import CUDA_GRAPH_MODES, Config
from . import attention, cpu_precision

GiB = 1024**3

# -------------------------------------------------------------------------- calibration (GPU)
COMPILE_MARGIN = 0.05  # share of allocated memory for inductor's workspaces and fused-kernel buffers
ALLOCATOR_MARGIN = 0.08  # reserved over allocated: the caching allocator's fragmentation (expandable segments)
CUDA_CONTEXT_BYTES = int(0.75 * GiB)  # context, kernel images, cuBLAS workspace: on the card, not in the allocator
HEADROOM = 0.10  # "fits" leaves this share of the card free; less than that is "tight"


def keeps_grads(cfg: Config) -> bool:
    """Whether training allocates every gradient once and zeroes it in place between steps.

    Under CUDA graphs a gradient that backward creates is a tensor in the graph's private pool,
    which autograd installs as `.grad` and the next replay overwrites: the second micro-batch of
    an accumulated step would add its gradient to itself, or fail with "accessing tensor output
    of CUDAGraphs that has been overwritten by a subsequent run" (pytorch/pytorch#169545).
    Gradients allocated outside the graphs only ever have the graph's output added to them. These
    modes train in one process only (config.cuda_graphs_need_one_process says why).
    """
    t = cfg.training
    return t.compile and t.compile_mode in CUDA_GRAPH_MODES


def ddp(cfg: Config) -> bool:
    """Whether DDP wraps the model: several processes, not sharded."""
    return cfg.world > 1 and cfg.distributed.strategy != "fsdp"


def grads_between_steps(cfg: Config) -> bool:
    """Whether every gradient exists for the whole run, zeroed in place after each step: under CUDA
    graphs (keeps_grads), and under DDP, whose communication buckets hold them from the start; a
    gradient set to None there would come back as a fresh tensor beside its bucket."""
    return keeps_grads(cfg) or ddp(cfg)


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # tied with the LM head: counted once; else with the head's, and the value embeddings'
    norms: int  # and every other vector: the U-net's skip weights, the value mixes
    matrices: int  # the 2-D matrices inside the blocks
    kind: str = "muon"  # optimizer.kind: with "adamw", AdamW holds every parameter
    lookups: int = 0  # of `embedding`, the tables only looked up (no matmul): an untied token embedding, value embeddings

    @property
    def total(self) -> int:
        return self.embedding + self.norms + self.matrices

    @property
    def adamw(self) -> int:
        """AdamW's share (optim.split_params): the embedding and every norm, or all of them."""
        return self.total if self.kind == "adamw" else self.embedding + self.norms

    @property
    def muon(self) -> int:
        return 0 if self.kind == "adamw" else self.matrices


def param_counts(cfg: Config) -> ParamCounts:
    """The parameters of `GPT(shape_from_config(cfg))`, counted from the config alone."""
    m, d, hd = cfg.model, cfg.model.d_model, cfg.head_dim
    q, kv, f = m.n_head * hd, m.n_kv_head * hd, cfg.mlp_hidden
    mlp = 2 if m.mlp == "relu2" else 3  # up and down; SwiGLU's gate besides
    per_layer = d * q + 2 * d * kv + q * d + mlp * d * f  # q, k, v, o; gate, up, down
    V = cfg.tokenizer.vocab_size
    lookups = (0 if m.tie_embeddings else V * d) + m.value_embeds * V * kv
    scalars = (m.n_layer // 2 if m.unet_skips else 0) + 2 * 2 * m.value_embeds  # skip weights; value mixes
    return ParamCounts(embedding=V * d + lookups,
                       norms=m.n_layer * (2 * d + 2 * hd) + d + scalars,  # two block norms, q/k norms; final norm
                       matrices=m.n_layer * per_layer, kind=cfg.optimizer.kind, lookups=lookups)


def muon_step_bytes(cfg: Config, device_type: str) -> int:
    """Muon's working set while it steps (muon.Muon.step), the largest over its groups of
    same-shape matrices: the fp32 stack of their updates, 4 bytes an element, and the last update
    written into it; the Newton–Schulz iterate and the next one, in bf16 on a GPU (in fp32
    elsewhere, where the stack is the first iterate: 4 + 2·4 bytes an element in all); and two
    k × k Gram products per matrix, k its shorter side."""
    m, d, hd = cfg.model, cfg.model.d_model, cfg.head_dim
    q, kv, f = m.n_head * hd, m.n_kv_head * hd, cfg.mlp_hidden
    s = 2 if device_type == "cuda" or amp_bytes(cfg, device_type) == 2 else 4  # optim.build_optimizers
    groups: Counter = Counter()  # shape: how many matrices of it
    mlp = [(f, d), (d, f)] if m.mlp == "relu2" else [(f, d), (f, d), (d, f)]
    for shape in [(q, d), (kv, d), (kv, d), (d, q), *mlp]:
        groups[shape] += m.n_layer
    return max(n * (r * c * (4 + 2 * s) + 2 * s * min(r, c) ** 2) + 4 * r * c for (r, c), n in groups.items())


def amp_bytes(cfg: Config, device_type: str) -> int:
    """Bytes per element of what autocast computes in: precision "auto" is bf16/fp16 on a GPU; on
    a CPU, bf16 where this CPU's cached verdict says so (cpu_precision; no probe here), else fp32."""
    p = cfg.training.precision
    if p == "auto":
        if device_type == "cuda":
            return 2
        verdict = cpu_precision.known(cfg)
        return 2 if verdict is not None and verdict.precision == "bf16" else 4
    return 4 if p == "fp32" else 2


def layer_activation_bytes(cfg: Config, a: int, compiled: bool, path: str = attention.NATIVE) -> int:
    """Bytes one block saves for backward per token, its attention taking `path` (attention.py).

    The residual stream is fp32 (the embedding is fp32 and each branch's low-precision output
    promotes on the add), so each norm's input is 4 bytes; the matmuls' inputs and outputs are in
    the autocast dtype. Every RMSNorm also keeps one fp32 reciprocal RMS per row: two per token for
    the block's norms, one per head for QK-norm.
    """
    m, d = cfg.model, cfg.model.d_model
    q, kv, f = m.n_head * cfg.head_dim, m.n_kv_head * cfg.head_dim, cfg.mlp_hidden
    rms = 4 * (2 + m.n_head + m.n_kv_head)
    # ReLU² (model.mlp = "relu2") has no gate: one linear on the second norm, and it keeps relu(up)
    # and its square where SwiGLU keeps three (compiled) or four (eager) tensors of the hidden width.
    relu2 = m.mlp == "relu2"
    if compiled:
        # What the partitioner keeps: the fp32 residual into each norm, each matmul's input in the
        # autocast dtype (one cast shared by q/k/v, one by gate/up), the q, k and v projections, the
        # normed and rotated q and k that SDPA takes, its output and log-sum-exp, and the SwiGLU
        # gate, up and product.
        return (2 * (4 * d + a * d) + a * (q + 2 * kv) + a * (q + kv) + a * q + 4 * m.n_head
                + (2 if relu2 else 3) * a * f + rms + attention.extra_bytes_per_token(cfg, a, path))
    # Eager: each block norm saves its fp32 input and normalised output; each linear its own cast
    # of the norm's weighted output (3 for q/k/v, 2 for gate/up; in fp32 one shared tensor per
    # norm); QK-norm its input in fp32 (a copy under autocast) and its output cast back; SDPA v and
    # its own low-precision copies of q and k; SwiGLU the gate, silu(gate), up and the product.
    casts = (3 + (1 if relu2 else 2)) * a * d if a < 4 else 2 * a * d
    return (2 * 8 * d + casts + (4 + a) * (q + kv) + a * kv + a * (q + kv) + a * q + 4 * m.n_head
            + (2 if relu2 else 4) * a * f
            + rms + attention.extra_bytes_per_token(cfg, a, path))


def head_activation_bytes(cfg: Config, a: int, compiled: bool) -> int:
    """Bytes per token saved after the last block: the token ids (int64, for the embedding's
    backward) and the final norm's. Compiled: its fp32 input, the head's input in the autocast
    dtype and two per-row statistics of the loss. Eager: its fp32 input and output, and the fp32
    gradient of the head's input that the blockwise loss computes in its forward."""
    d = cfg.model.d_model
    return 8 + 4 + ((4 + a) * d + 8 if compiled else 8 * d + 4 * d)


def saved_per_token(cfg: Config, a: int, compiled: bool, path: str = attention.NATIVE) -> int:
    """Bytes per token autograd keeps for backward without activation checkpointing: the blocks,
    what follows them and, compiled, the logits the fused loss keeps (eager's blockwise loss keeps
    none). What memory_probe.saved_bytes_per_token measures in a real forward."""
    return (cfg.model.n_layer * layer_activation_bytes(cfg, a, compiled, path)
            + head_activation_bytes(cfg, a, compiled) + (a * cfg.tokenizer.vocab_size if compiled else 0))


# gpt.LinearCrossEntropy's block of logits (elements), by device; a test keeps the two equal.
LOSS_BLOCK_ELEMENTS = {"cuda": 1 << 26, "cpu": 1 << 22}


def loss_bytes(cfg: Config, a: int, compiled: bool, tokens: int, device_type: str, fp16: bool = False) -> int:
    """The loss's memory beyond the saved activations, at its peak.

    Compiled: the fused loss keeps the logits in the autocast dtype (a·V per token; its backward
    writes their gradient over them), and backward forms the head's gradient in the autocast dtype
    beside the fp32 gradient of the embedding lookup, (4 + a)·V·d.

    Eager (gpt.LinearCrossEntropy), the larger of two moments. In the forward: the head's input
    (fp32, and its cast under autocast), the weight's fp32 gradient and cast, and one block of
    fp32 logits with logsumexp's temporary of its size, or later the block's gradient, its cast
    and its product with the block's input. At the start of backward: the scaled copies of the
    saved gradients of the head's input (4·d per token) and weight, beside the weight's.

    Eager fp16 keeps the plain loss (gpt._fp16_autocast says why), whose peak is the start of
    backward: cross-entropy's saved fp32 log-probabilities, the gradient arriving at them and the
    one they pass on, 12·V a token, beside the head's fp16 copy of the weight that the matmul saved.
    """
    V, d = cfg.tokenizer.vocab_size, cfg.model.d_model
    if compiled:
        return tokens * a * V + (4 + a) * V * d
    if fp16:
        return tokens * 12 * V + 2 * V * d
    amp = a if a < 4 else 0  # bytes of a cast (none in fp32)
    block = min(tokens, max(1, LOSS_BLOCK_ELEMENTS[device_type] // V)) * V
    forward = (tokens * d + V * d) * (4 + amp) + max(8 * block, (amp or 4) * V * d + (4 + amp) * block)
    backward = tokens * 4 * d + 8 * V * d
    return max(forward, backward)


def inference_layer_bytes(cfg: Config, a: int) -> int:
    """Bytes per token one block holds at its peak without gradients: its fp32 input (which the
    caller still holds), the residual after attention and the norm's output, 12·d, beside the
    MLP's silu(gate), up and their product (and, under autocast, the cast of its input)."""
    d, f = cfg.model.d_model, cfg.mlp_hidden
    return 12 * d + (12 * f if a == 4 else a * d + 3 * a * f)


def inference_bytes(cfg: Config, a: int, tokens: int, device_type: str) -> int:
    """The working set of evaluation or sampling, the larger, beyond what stays held between steps.

    Evaluation (gpt.GPT.token_losses) runs an eval batch through the blocks one at a time, then
    takes the loss a block of rows at a time: the final hidden states and each token's loss in
    fp32, and one block of fp32 logits with logsumexp's temporary of its size. Sampling (a chat
    request or a periodic sample, one row) prefills up to the whole context beside the KV cache,
    which holds the keys and values of every layer for the whole context in the autocast dtype.
    """
    m, V, T = cfg.model, cfg.tokenizer.vocab_size, cfg.max_seq_len
    layer = inference_layer_bytes(cfg, a)
    block = min(tokens, max(1, LOSS_BLOCK_ELEMENTS[device_type] // V)) * V
    evaluation = max(tokens * layer, tokens * (4 * m.d_model + 4) + 8 * block)
    kv_cache = 2 * m.n_layer * T * m.n_kv_head * cfg.head_dim * a
    sampling = kv_cache + T * layer
    return max(evaluation, sampling)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes at the peak of a training step, by part; `allocated` is what `max_memory_allocated` shows."""
    weights: int
    grads: int
    optimizer: int
    activations: int
    loss: int
    recompute: int  # activation checkpointing: one block recomputed in backward, beside the blocks' inputs
    muon_step: int  # Muon's working set while it steps (activations are gone by then)
    inference: int  # evaluation or sampling between steps, whichever holds more, with what stays held then
    margin: int  # compile workspaces
    allocated: int
    reserved: int  # allocated plus fragmentation, plus the eval pool beside CUDA graphs' private pool
    total: int  # reserved plus the CUDA context: what the card must hold (CPU: reserved)


def estimate(cfg: Config, device_type: str = "cuda", micro_batch: int | None = None,
             compute_capability: tuple[int, int] | None = None) -> MemoryEstimate:
    """Peak memory of training `cfg` on one device ("cuda" or "cpu"), optionally at another micro-batch.
    A GPU's compute capability decides its attention kernel (attention.path_for); unknown, Ampere's."""
    t, m = cfg.training, cfg.model
    B = micro_batch or t.micro_batch_size
    tokens = B * t.seq_len
    a = amp_bytes(cfg, device_type)
    compiled = t.compile
    n = param_counts(cfg)
    d = m.d_model

    shards = cfg.world if cfg.distributed.strategy == "fsdp" else 1
    block = (n.matrices + n.norms - m.d_model) // m.n_layer  # one block's parameters (not the final norm)
    gathered = 0 if shards == 1 else 4 * (n.embedding + 2 * block)
    head = n.embedding - n.lookups  # the head's matrix, the only one of them autocast casts
    casts = n.matrices + (head if compiled else 0)
    weights = 4 * n.total // shards + gathered + (2 * casts if a < 4 else 0)
    grads_all = 4 * n.total // shards + gathered
    # Without accumulation, backward has created none when the saved activations peak (the head's
    # is part of the loss); with it, or with gradients kept between steps, all of them.
    kept = grads_between_steps(cfg)
    grads_at_peak = grads_all if t.grad_accum_steps > 1 or kept else 0
    optimizer = (8 * n.adamw + 4 * n.muon) // shards

    layer = layer_activation_bytes(cfg, a, compiled, attention.path_for(cfg, device_type, compute_capability))
    # With activation checkpointing each block keeps only its fp32 input. Backward recomputes one
    # block at a time, once the loss's and the head's backward are done: that block's activations
    # and two gradients of the MLP's width inside its backward, beside the blocks' inputs, the
    # head's gradient (autograd holds it until the embedding's, the same tied matrix, is added at
    # the end of backward) and, without accumulation, the block's new gradients (with it, each is
    # added in place as it comes).
    ckpt = t.activation_checkpointing
    stored = tokens * m.n_layer * (4 * d if ckpt else layer)
    activations = stored + tokens * head_activation_bytes(cfg, a, compiled)
    loss = loss_bytes(cfg, a, compiled, tokens, device_type, fp16=t.precision == "fp16")
    recompute = (tokens * (layer + 2 * a * cfg.mlp_hidden) + 4 * n.embedding + (0 if grads_at_peak else 4 * block)
                 if ckpt else 0)

    muon_step = muon_step_bytes(cfg, device_type) if n.muon else 0
    held = weights + grads_at_peak + optimizer
    # Between steps: the fp32 weights and autocast's casts of every matrix (the head's too, which
    # the evaluation loss casts), the optimizer state, and the gradients only where they are kept.
    between = (4 * n.total // shards + gathered + (2 * (n.matrices + head) if a < 4 else 0) + optimizer
               + (grads_all if kept else 0))
    working = inference_bytes(cfg, a, (cfg.eval.batch_size or B) * t.seq_len, device_type)  # eval.batch_size
    inference = between + working
    peak = max(held + activations + loss, held + stored + recompute, weights + grads_all + optimizer + muon_step,
               inference)
    margin = int(peak * COMPILE_MARGIN) if compiled else 0
    allocated = peak + margin
    reserved = int(allocated * (1 + ALLOCATOR_MARGIN))
    if compiled and t.compile_mode in CUDA_GRAPH_MODES and device_type == "cuda":
        # CUDA graphs keep training's memory in a private pool; evaluation and sampling (eager, no
        # grad) cannot reuse it and need their own.
        reserved += working
    total = reserved + (CUDA_CONTEXT_BYTES if device_type == "cuda" else 0)
    return MemoryEstimate(weights, grads_at_peak, optimizer, activations, loss, recompute, muon_step, inference,
                          margin, allocated, reserved, total)


def verdict(needed_bytes: int, card_bytes: int) -> str:
    """"fits" with HEADROOM to spare, "tight" when it fits without it, else "does not fit"."""
    if needed_bytes <= card_bytes * (1 - HEADROOM):
        return "fits"
    return "tight" if needed_bytes <= card_bytes else "does not fit"


def judge(cfg: Config, card_bytes: int | None) -> tuple[MemoryEstimate, str]:
    """A preset's estimate and verdict: against `card_bytes` (the GPU a machine has) when given,
    else against the GPU class the preset was sized for; "–" for a CPU preset and no GPU. A preset
    trains on the GPU whenever there is one (device "auto"), so it is estimated for one then."""
    hw = cfg.hardware
    on_gpu = card_bytes is not None or hw.vram_gb > 0
    est = estimate(cfg, "cuda" if on_gpu else "cpu")
    against = card_bytes if card_bytes is not None else int(hw.vram_gb * GiB)
    return est, verdict(est.total, against) if against else "–"


def largest_micro_batch(cfg: Config, budget_bytes: int, device_type: str = "cuda",
                        limit: int | None = None, compute_capability: tuple[int, int] | None = None) -> int:
    """The largest micro-batch (up to `limit`, default the effective batch) whose estimated
    `reserved` memory fits `budget_bytes`; 0 when not even 1 does. Memory grows with the
    micro-batch, so a bisection finds it."""
    t = cfg.training
    hi = limit or t.micro_batch_size * t.grad_accum_steps
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate(cfg, device_type, mid, compute_capability).reserved <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def choose_micro_batch(effective: int, start: int, fits: Callable[[int], bool]) -> int | None:
    """The micro-batch a run uses: the largest divisor of `effective` (micro-batch × accumulation,
    kept exact so tokens per step do not change) not above `start` for which `fits` holds, halving
    after each one that does not. None when not even 1 fits."""
    mb = _divisor_at_most(effective, max(1, min(start, effective)))
    while True:
        if fits(mb):
            return mb
        if mb == 1:
            return None
        mb = _divisor_at_most(effective, mb // 2)


def _divisor_at_most(n: int, k: int) -> int:
    return next(c for c in range(k, 0, -1) if n % c == 0)


# Where an out-of-memory error can end a run (memory_probe.within_memory), as the message names them.
STEP, VALIDATION, TASKS, SAMPLING = "training step", "validation", "task scoring", "sampling"


def _size(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _torch_figure(pattern: str, error: str) -> str | None:
    """A size CUDA's out-of-memory message states ("2.00 GiB"), found by the words around it."""
    found = re.search(pattern.replace("SIZE", r"([\d.]+ [KMGT]?i?B)"), error)
    return found[1] if found else None


def held_parts(cfg: Config, place: str, device_type: str, cache_bytes: int | None) -> str:
    """What holds the memory at `place`, by the estimator's count at the run's micro-batch: the
    parameters (with autocast's casts), gradients, optimizer state, and a step's activations and
    loss or evaluation's and sampling's working set; then the allocator's cache, measured."""
    t = cfg.training
    est = estimate(cfg, device_type)
    if place == STEP:
        work = [("activations", est.activations), ("the loss", est.loss), ("recomputation", est.recompute)]
        grads = est.grads
    else:
        a = amp_bytes(cfg, device_type)
        work = [("the working set between steps", inference_bytes(cfg, a, cfg.eval_batch_size * t.seq_len, device_type))]
        grads = est.grads if grads_between_steps(cfg) else 0  # otherwise freed after each step
    parts = [("parameters", est.weights), ("gradients", grads), ("optimizer state", est.optimizer), *work]
    held = ", ".join(f"{name} {_size(n)}" for name, n in parts if n)
    cache = f"; the allocator's cache {_size(cache_bytes)}" if cache_bytes is not None else ""
    batch = f"micro-batch {t.micro_batch_size}" if place == STEP else f"eval batch {cfg.eval_batch_size}"
    return f"holding (as estimated at {batch}) {held}{cache}"


def out_of_memory_changes(cfg: Config, place: str) -> str:
    """What to change after running out of memory at `place`: only what a resume from the kept
    checkpoint accepts (run/resume.py): for a step, the same sequences a step, split otherwise,
    and recomputation (auto_micro_batch searches in one process only); for validation and task
    scoring, their own batch (eval.batch_size), which no step depends on."""
    t = cfg.training
    if place == SAMPLING:
        return ("fewer samples or new tokens a request (sample.max_new_tokens for the periodic ones), "
                "or sample.every=0")
    if place != STEP:
        if cfg.eval_batch_size > 1:
            return (f"--set eval.batch_size={cfg.eval_batch_size // 2} (validation and task scoring only; "
                    "training's micro-batch stays)")
        return "in a new run: a shorter training.seq_len or a smaller model"
    changes = []
    if t.micro_batch_size > 1:
        mb = _divisor_at_most(t.micro_batch_size, t.micro_batch_size // 2)
        changes.append(f"--set training.micro_batch_size={mb} --set training.grad_accum_steps="
                       f"{t.grad_accum_steps * t.micro_batch_size // mb} (the same tokens per step)")
        if not t.auto_micro_batch and cfg.world == 1:
            changes.append("training.auto_micro_batch=true")
    if not t.activation_checkpointing:
        changes.append("training.activation_checkpointing=true")
    change = ", or ".join(changes)
    if t.micro_batch_size == 1:
        change += "; or, in a new run, " if changes else "in a new run: "
        change += "a shorter training.seq_len or a smaller model"
    return change


def out_of_memory_message(cfg: Config, step: int, error: str, device_name: str, device_bytes: int,
                          peak_bytes: int | None, last_checkpoint: int | None, place: str = STEP,
                          cache_bytes: int | None = None, snapshot: str | None = None) -> str:
    """What an out-of-memory failure tells the user, on one line: where (`place`, one of STEP,
    VALIDATION, TASKS, SAMPLING), how much was asked and free (from torch's `error`), what holds
    the memory, and what to change. `step` is the step being trained, or for the other places the
    step just completed; on a CPU there is no peak to report (`peak_bytes` None). `cache_bytes`:
    the caching allocator's reserved but unallocated memory where measured, else what `error`
    says of it; `snapshot`: where the allocator's recorded history was dumped."""
    t, hw = cfg.training, cfg.hardware
    gpu = device_name != "CPU"
    asked = _torch_figure(r"Tried to allocate SIZE", error)
    if asked:
        free = _torch_figure(r"of which SIZE is free", error)
        capacity = _torch_figure(r"total capacity of SIZE", error)
        what = f"tried to allocate {asked}" + (f" with {free} free" if free else "") + (
            f" of {capacity}" if free and capacity else "")
    else:
        cpu = re.search(r"you tried to allocate \d+ bytes", error)
        what = cpu[0] if cpu else error.strip().splitlines()[0]
    if cache_bytes is None and (unallocated := _torch_figure(r"SIZE is reserved by PyTorch but unallocated", error)):
        number, unit = unallocated.split()
        cache_bytes = int(float(number) * {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": GiB, "TiB": 1024 * GiB}[unit])
    sized = f"sized for {hw.gpu_class} ({hw.vram_gb:g} GB)" if hw.vram_gb else f"gpu_class {hw.gpu_class!r}"
    kept = (f"the checkpoint of step {last_checkpoint} is kept" if last_checkpoint
            else "no checkpoint had been written yet")
    where = f"in training step {step}" if place == STEP else f"in {place} after step {step}"
    device_type = "cuda" if gpu else "cpu"
    estimated = estimate(cfg, device_type).allocated
    peak = (f"peak allocated {_size(peak_bytes)} (estimated {_size(estimated)})" if peak_bytes is not None
            else f"estimated peak {_size(estimated)}")
    dumped = f"; memory snapshot: {snapshot} (open it at pytorch.org/memory_viz)" if snapshot else ""
    return (f"out of {'GPU ' if gpu else ''}memory {where} ({what}): micro-batch {t.micro_batch_size} × {t.seq_len} "
            f"tokens, config {sized}, on {device_name} with {_size(device_bytes)}; {peak}, "
            f"{held_parts(cfg, place, device_type, cache_bytes)}. "
            f"Change: {out_of_memory_changes(cfg, place)}; {kept}{dumped}.")

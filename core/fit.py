"""Peak training memory from a config, by arithmetic: no torch, so the front-end can judge presets.

What one GPU holds while a run trains (B = micro-batch, T = seq_len, V = vocabulary, L = layers,
N = parameters; `a` = bytes of the autocast dtype: 2 for bf16/fp16, 4 for fp32):

* weights: fp32 master weights, 4·N; with autocast also the 2-byte copies of the matrices that
  autocast caches for the step and the matmuls keep for backward, 2·(N − norms);
* gradients: fp32, 4·N. At the activation peak (the start of backward) only the head's gradient
  exists yet when there is no accumulation; from the second micro-batch of an accumulated step
  on, all of them do, and under CUDA graphs always (`keeps_grads`);
* optimizer state: AdamW keeps two fp32 moments of its parameters (embedding and norms), 8 bytes
  each; Muon one fp32 momentum buffer of its matrices, 4 bytes each. Muon's step also needs a
  working set for the largest group of same-shape matrices it orthogonalises at once;
* activations: what autograd saves for backward, counted tensor by tensor per layer and token
  below (eager and compiled differ: the compiler fuses casts and norms). With activation
  checkpointing each layer keeps only its input, and backward recomputes one layer at a time;
* logits and loss: (B, T, V) in fp32 for the loss, and their gradient;
* margins for what no formula sees (compile workspaces, allocator fragmentation, the CUDA context).

Under FSDP (distributed.strategy = "fsdp" with several processes) each GPU keeps 1/world of the
fp32 weights, gradients and optimizer state, plus the whole parameters of what is gathered at a
time: the root's (the embedding and final norm, for the whole pass) and two blocks (the one
running and the one prefetched); its gradients stay sharded under accumulation too, since each
micro-batch's are reduce-scattered (group.accumulating). DDP keeps everything whole, its
gradients as views into its communication buckets (no second copy).

The margins are named constants below. They are first estimates, not measurements: calibrate
them against `torch.cuda.max_memory_allocated` with bench/gpu_check.py on a GPU before trusting a
verdict within a few per cent.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from .config import CUDA_GRAPH_MODES, Config

GiB = 1024**3

# -------------------------------------------------------------------------- calibration (GPU)
COMPILE_MARGIN = 0.05  # share of allocated memory for inductor's workspaces and fused-kernel buffers
ALLOCATOR_MARGIN = 0.08  # reserved over allocated: the caching allocator's fragmentation (expandable segments)
CUDA_CONTEXT_BYTES = int(0.75 * GiB)  # context, kernel images, cuBLAS workspace: on the card, not in the allocator
MUON_STEP_BYTES = 16  # per element of Muon's largest same-shape group: fp32 updates and stack, bf16 iterates
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


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # tied with the LM head: counted once
    norms: int
    matrices: int  # the 2-D matrices inside the blocks

    @property
    def total(self) -> int:
        return self.embedding + self.norms + self.matrices

    @property
    def adamw(self) -> int:
        """AdamW's share (optim.split_params): the embedding and every norm."""
        return self.embedding + self.norms

    @property
    def muon(self) -> int:
        return self.matrices


def param_counts(cfg: Config) -> ParamCounts:
    """The parameters of `GPT(shape_from_config(cfg))`, counted from the config alone."""
    m, d, hd = cfg.model, cfg.model.d_model, cfg.head_dim
    q, kv, f = m.n_head * hd, m.n_kv_head * hd, cfg.mlp_hidden
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f  # q, k, v, o; gate, up, down
    return ParamCounts(embedding=cfg.tokenizer.vocab_size * d,
                       norms=m.n_layer * (2 * d + 2 * hd) + d,  # two block norms, q_norm and k_norm; final norm
                       matrices=m.n_layer * per_layer)


def muon_largest_group(cfg: Config) -> int:
    """Elements in Muon's largest batch of same-shape matrices (it stacks them per shape)."""
    m, d, hd = cfg.model, cfg.model.d_model, cfg.head_dim
    q, kv, f = m.n_head * hd, m.n_kv_head * hd, cfg.mlp_hidden
    groups: Counter = Counter()
    for shape in [(q, d), (kv, d), (kv, d), (d, q), (f, d), (f, d), (d, f)]:
        groups[shape] += m.n_layer * shape[0] * shape[1]
    return max(groups.values())


def amp_bytes(cfg: Config, device_type: str) -> int:
    """Bytes per element of what autocast computes in: precision "auto" is bf16/fp16 on a GPU, fp32 on CPU."""
    p = cfg.training.precision
    if p == "auto":
        return 2 if device_type == "cuda" else 4
    return 4 if p == "fp32" else 2


def layer_activation_bytes(cfg: Config, a: int, compiled: bool) -> int:
    """Bytes one block saves for backward per token.

    The residual stream is fp32 (the embedding is fp32 and each branch's low-precision output
    promotes on the add), so each norm's input is 4 bytes; the matmuls' inputs and outputs are in
    the autocast dtype. QK-norm's weight is fp32, so q and k leave it in fp32.
    """
    m, d = cfg.model, cfg.model.d_model
    q, kv, f = m.n_head * cfg.head_dim, m.n_kv_head * cfg.head_dim, cfg.mlp_hidden
    amp = a < 4
    if compiled:
        # What the partitioner keeps: the fp32 residual into each norm, each matmul's input in the
        # autocast dtype (one cast shared by q/k/v, one by gate/up), the q, k and v projections, the
        # normed and rotated q and k that SDPA takes, its output and log-sum-exp, and the SwiGLU
        # gate, up and product.
        return (2 * (4 * d + a * d) + a * (q + 2 * kv) + a * (q + kv) + a * q + 4 * m.n_head
                + 3 * a * f)
    # Eager autocast: each norm saves its input and its fp32 output, each linear its own cast of
    # the input (3 for q/k/v, 2 for gate/up; none in fp32, where they share the norm's output);
    # QK-norm keeps an fp32 copy, its fp32 output and the cast back; SDPA its own low-precision q
    # and k; SwiGLU the gate, silu(gate), up and the product.
    casts = (3 + 2) * a * d if amp else 2 * a * d
    qk_norm = (8 + (a if amp else 0)) * (q + kv)
    return (2 * 8 * d + casts + qk_norm + a * kv + a * (q + kv) + a * q + 4 * m.n_head + 4 * a * f)


def logits_bytes(cfg: Config, a: int, compiled: bool) -> int:
    """Bytes per token for the logits and the loss at their peak (the start of backward).

    Eager: the fp32 log-probabilities cross-entropy saves, their gradient and the logits' fp32
    gradient. Compiled: the fused loss keeps the logits in the autocast dtype, and its backward
    writes one fp32 gradient.
    """
    return cfg.tokenizer.vocab_size * ((a + 4) if compiled else 12)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes at the peak of a training step, by part; `allocated` is what `max_memory_allocated` shows."""
    weights: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    muon_step: int  # Muon's working set while it steps (activations are gone by then)
    margin: int  # compile workspaces
    allocated: int
    reserved: int  # allocated plus fragmentation, plus the eval pool beside CUDA graphs' private pool
    total: int  # reserved plus the CUDA context: what the card must hold (CPU: reserved)


def estimate(cfg: Config, device_type: str = "cuda", micro_batch: int | None = None) -> MemoryEstimate:
    """Peak memory of training `cfg` on one device ("cuda" or "cpu"), optionally at another micro-batch."""
    t, m = cfg.training, cfg.model
    B = micro_batch or t.micro_batch_size
    tokens = B * t.seq_len
    a = amp_bytes(cfg, device_type)
    compiled = t.compile
    n = param_counts(cfg)
    d, V = m.d_model, cfg.tokenizer.vocab_size

    shards = cfg.world if cfg.distributed.strategy == "fsdp" else 1
    block = (n.matrices + n.norms - m.d_model) // m.n_layer  # one block's parameters (not the final norm)
    gathered = 0 if shards == 1 else 4 * (n.embedding + 2 * block)
    weights = 4 * n.total // shards + gathered + (2 * (n.total - n.norms) if a < 4 else 0)
    grads_all = 4 * n.total // shards + gathered
    # Without accumulation, backward has created only the head's (the tied embedding's) gradient
    # when the saved activations peak; with it, or with gradients kept between steps, all of them.
    grads_at_peak = grads_all if t.grad_accum_steps > 1 or keeps_grads(cfg) else 4 * n.embedding
    optimizer = (8 * n.adamw + 4 * n.muon) // shards

    layer = layer_activation_bytes(cfg, a, compiled)
    if t.activation_checkpointing:
        per_token = m.n_layer * 4 * d + layer  # each block's fp32 input, plus one block recomputed
    else:
        per_token = m.n_layer * layer
    per_token += (4 + a) * d if compiled else (8 + a) * d  # final norm and the head's input
    activations = tokens * per_token
    logits = tokens * logits_bytes(cfg, a, compiled)

    muon_step = MUON_STEP_BYTES * muon_largest_group(cfg)
    peak = max(weights + grads_at_peak + optimizer + activations + logits,
               weights + grads_all + optimizer + muon_step)
    margin = int(peak * COMPILE_MARGIN) if compiled else 0
    allocated = peak + margin
    reserved = int(allocated * (1 + ALLOCATOR_MARGIN))
    if compiled and t.compile_mode in CUDA_GRAPH_MODES and device_type == "cuda":
        # CUDA graphs keep training's memory in a private pool; evaluation (eager, no grad) cannot
        # reuse it and needs its own: the logits in the autocast dtype, their fp32 copy and the
        # fp32 log-probabilities, plus one block's working set.
        reserved += tokens * (V * (a + 8) + layer)
    total = reserved + (CUDA_CONTEXT_BYTES if device_type == "cuda" else 0)
    return MemoryEstimate(weights, grads_at_peak, optimizer, activations, logits, muon_step, margin, allocated,
                          reserved, total)


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
                        limit: int | None = None) -> int:
    """The largest micro-batch (up to `limit`, default the effective batch) whose estimated
    `reserved` memory fits `budget_bytes`; 0 when not even 1 does. Memory grows with the
    micro-batch, so a bisection finds it."""
    t = cfg.training
    hi = limit or t.micro_batch_size * t.grad_accum_steps
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate(cfg, device_type, mid).reserved <= budget_bytes:
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


def out_of_memory_message(cfg: Config, step: int, error: str, device_name: str, device_bytes: int, peak_bytes: int,
                          last_checkpoint: int | None) -> str:
    """What a CUDA out-of-memory failure tells the user: where, how much, and what to change."""
    t, hw = cfg.training, cfg.hardware
    asked = re.search(r"Tried to allocate [\d.]+ \w+", error)
    what = asked[0].lower() if asked else error.strip().splitlines()[0]
    sized = f"sized for {hw.gpu_class} ({hw.vram_gb:g} GB)" if hw.vram_gb else f"gpu_class {hw.gpu_class!r}"
    if t.micro_batch_size > 1:
        change = (f"--set training.micro_batch_size={t.micro_batch_size // 2} --set training.grad_accum_steps="
                  f"{t.grad_accum_steps * 2} (the same tokens per step), or training.auto_micro_batch=true, or "
                  "training.activation_checkpointing=true")
    else:
        change = "training.activation_checkpointing=true, a shorter training.seq_len or a smaller model"
    kept = (f"the checkpoint of step {last_checkpoint} is kept" if last_checkpoint
            else "no checkpoint had been written yet")
    return (f"out of GPU memory at step {step} ({what}): micro-batch {t.micro_batch_size} × {t.seq_len} tokens, "
            f"config {sized}, on {device_name} with {device_bytes / GiB:.1f} GiB; peak allocated "
            f"{peak_bytes / GiB:.1f} GiB (estimated {estimate(cfg, 'cuda').allocated / GiB:.1f} GiB). "
            f"Change: {change}; {kept}.")

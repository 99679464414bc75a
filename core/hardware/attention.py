"""Which kernel grouped-query attention runs on, decided before a run starts and without torch.

Decided from what a run knows before it starts, with no torch, so the memory estimate
(memory_estimate.py) and the launch screen follow the same decision as the model.

`F.scaled_dot_product_attention(enable_gqa=True)` picks a kernel by the checks in torch's
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (CUDA) and sdp_utils_cpp.cpp (CPU), with
sdp_utils_cpp.h, and falls to the math kernel without a word when none of the fused ones takes the
call. The math kernel repeats K/V itself and keeps the (B, H, T, T) probabilities for backward.
What torch 2.13 does:

* CPU: the CPU flash kernel takes GQA (`check_batch_size_and_num_heads_dense<supports_gqa>`) in
  float32, float64, bfloat16 and float16: K/V as they are.
* CUDA flash and cuDNN take GQA, but only in fp16/bf16, on compute capability 8.0 to 12.1 (flash:
  head_dim ≤ 256; training with head_dim in (192, 224] is refused on sm86–89 and sm120–121).
* CUDA memory-efficient attention takes fp32 (and fp16 from sm50) but not GQA in torch 2.13: its
  backward returns dK/dV with the query's head count (torch/_meta_registrations.py,
  `meta__scaled_dot_product_efficient_backward`). Given K/V repeated to the query's heads, it runs
  where flash cannot: fp32, and fp16 before Ampere (V100, T4, RTX 20xx). Its one further demand is
  a head_dim divisible by its GEMM alignment (`minimum_gemm_alignment`); where that fails too,
  only the math kernel is left. (Upstream's sdp_utils.cpp now lets it take GQA, pytorch/pytorch#191085:
  with a torch that has it, fp32 could keep K/V as they are; the run header names torch's own choice.)
"""

from __future__ import annotations

NATIVE = "native-gqa"  # K/V as they are: the kernel shares each K/V head among its query heads
EXPAND = "expand-kv"  # K/V repeated to the query's heads, for the memory-efficient kernel
MATH = "math"  # no fused kernel takes it: the (B, H, T, T) probabilities are kept

AMPERE = (8, 0)  # what a GPU is assumed to be when its compute capability is not known
FUSED_NEWEST = (12, 1)  # the newest architecture torch 2.13's flash, cuDNN and memory-efficient kernels accept
MEM_EFFICIENT_OLDEST = (5, 0)
FLASH_MAX_HEAD_DIM = 256


def attention_path(device_type: str, precision: str, compute_capability: tuple[int, int] | None = None,
                   head_dim: int = 64) -> str:
    """The path a training step's attention takes: NATIVE, EXPAND or MATH. `precision` is the
    resolved one ("fp32", "bf16", "fp16"); an unknown compute capability is taken for Ampere."""
    if device_type != "cuda":
        return NATIVE
    cc = compute_capability or AMPERE
    if precision in ("bf16", "fp16") and flash_takes(cc, head_dim):
        return NATIVE
    return EXPAND if mem_efficient_takes(precision, cc, head_dim) else MATH


def flash_takes(cc: tuple[int, int], head_dim: int) -> bool:
    """Flash (and cuDNN, which accepts no more) in fp16/bf16, with gradients."""
    if not AMPERE <= cc <= FUSED_NEWEST or head_dim > FLASH_MAX_HEAD_DIM:
        return False
    # Its backward has no kernel for these head sizes on the consumer architectures' shared memory.
    consumer = (8, 6) <= cc <= (8, 9) or (12, 0) <= cc <= (12, 1)
    return not (consumer and 192 < head_dim <= 224)


def mem_efficient_takes(precision: str, cc: tuple[int, int], head_dim: int) -> bool:
    """Memory-efficient attention with K/V at the query's head count: fp32 and fp16 everywhere it
    runs, bf16 from Ampere; head_dim a multiple of its GEMM's alignment (8 elements in 16-bit, 4 in
    fp32 from Ampere, where fp32 runs on tensor cores; 1 before)."""
    if not MEM_EFFICIENT_OLDEST <= cc <= FUSED_NEWEST or (precision == "bf16" and cc < AMPERE):
        return False
    alignment = 8 if precision != "fp32" else 4 if cc >= AMPERE else 1
    return head_dim % alignment == 0


def path_for(cfg, device_type: str, compute_capability: tuple[int, int] | None = None,
             precision: str | None = None) -> str:
    """`attention_path` for a run config (`cfg` is a `config.Config`) at `precision`, by default its
    own, "auto" resolved as device.choose_precision does (bf16 from Ampere on a GPU, fp16 before).
    A model with as many K/V heads as query heads shares none: its K/V go as they are."""
    m = cfg.model
    if m.n_kv_head == m.n_head:
        return NATIVE
    cc = compute_capability or AMPERE
    precision = precision or cfg.training.precision
    if precision == "auto":
        precision = ("bf16" if cc >= AMPERE else "fp16") if device_type == "cuda" else "fp32"
    return attention_path(device_type, precision, cc, cfg.head_dim)


def extra_bytes_per_token(cfg, a: int, path: str) -> int:
    """What a path adds to one block's saved activations per token, beyond the native path's: the
    repeated K and V the kernel keeps for backward in place of the K/V heads, 2·a·(q − kv); the math
    kernel also keeps its fp32 probabilities, H·T of them per token (a first estimate: its other
    fp32 copies are not counted)."""
    if path == NATIVE:
        return 0
    m = cfg.model
    expanded = 2 * a * (m.n_head - m.n_kv_head) * cfg.head_dim
    return expanded + (4 * m.n_head * cfg.training.seq_len if path == MATH else 0)


def header(cfg, path: str, kernel: str, precision: str, device_type: str = "cuda") -> str:
    """The run header's attention line: the kernel torch picked for the model's call, the path that
    call takes and, expanded, what the repeated K/V add to a step's activations."""
    m, t = cfg.model, cfg.training
    named = kernel if device_type == "cuda" else f"{kernel} ({device_type.upper()})"
    if path == NATIVE:
        line = f"attention: {named}, " + ("GQA native" if m.n_kv_head < m.n_head else "no K/V heads shared")
    else:
        # With activation checkpointing one block's activations exist at a time.
        layers = 1 if t.activation_checkpointing else m.n_layer
        a = 4 if precision == "fp32" else 2
        mib = extra_bytes_per_token(cfg, a, path) * t.micro_batch_size * t.seq_len * layers / 2**20
        size = f"{mib:,.0f}" if mib >= 10 else f"{mib:.1f}"
        line = f"attention: {named}, K/V expanded from {m.n_kv_head} to {m.n_head} heads (+{size} MiB of activations)"
    if kernel == "math":
        line += "; warning: the math kernel is slow and keeps (B, H, T, T) attention probabilities"
        if path != MATH:
            line += f", where attention.py expected a fused kernel at {precision}"
        elif cfg.head_dim % 8:
            line += (f"; a head_dim that is a multiple of 8 (not {cfg.head_dim}) lets the memory-efficient "
                     "kernel take it")
    return line

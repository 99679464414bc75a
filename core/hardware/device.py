"""Which device and precision a run uses, its attention kernel, and the peak FLOP/s MFU is measured against."""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn.attention import SDPBackend

from ..config import ConfigError
from . import attention, gpu_env
from .compute_estimate import peak_tflops, unknown_peak_note

def resolve_device(spec: str) -> torch.device:
    """The device a run trains on, made the current CUDA device (inductor's kernels and CUDA
    graphs use the current device). "cuda:N" counts the GPUs CUDA_VISIBLE_DEVICES leaves visible,
    as torch does; "auto" is the visible GPU with the most free memory, or the CPU without one."""
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"hardware.device = {spec!r}, but this machine has no usable CUDA GPU "
                          f"(torch {torch.__version__}); use \"auto\" or \"cpu\"")
    index = _most_free_gpu() if spec == "auto" else torch.device(spec).index or 0
    if index >= torch.cuda.device_count():
        raise ConfigError(f"hardware.device = {spec!r}, but only {torch.cuda.device_count()} GPU(s) are visible")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _most_free_gpu() -> int:
    """The visible GPU with the most free memory by NVML, matched to torch's numbering by UUID
    (NVML counts every GPU in bus order; torch only the visible ones, in CUDA's order). Reading
    NVML creates no CUDA context, so the GPUs not chosen are left untouched. GPU 0 without NVML."""
    free = {gpu_env.normalise_uuid(g.uuid): g.free for g in gpu_env.read_nvml().gpus if g.uuid and g.free is not None}
    readings = []
    for i in range(torch.cuda.device_count()):
        uuid = gpu_uuid(i)
        if uuid in free:
            readings.append((i, free[uuid]))
    best = gpu_env.most_free(readings)
    return 0 if best is None else best


def gpu_uuid(device: torch.device | int) -> str:
    """A CUDA device's UUID as `gpu_env.normalise_uuid` writes it (a MIG instance's own, under
    MIG), or "" where torch cannot say (a build whose device properties lack it)."""
    try:
        return gpu_env.normalise_uuid(str(torch.cuda.get_device_properties(device).uuid))
    except Exception:  # noqa: BLE001 - an unknown UUID only costs the front-end its exact match
        return ""


def device_uuids(devices: tuple[str, ...]) -> tuple[str, ...]:
    """The UUID of each of a run's devices ("" for the CPU), sent in RunStarted: the front-end
    finds each device's NVML readings by it, as CUDA's and NVML's numberings can differ (CUDA puts
    the fastest GPU first and follows CUDA_VISIBLE_DEVICES; NVML counts every GPU in bus order).
    Reading device properties creates no CUDA context, so rank 0 can read those of the other local
    ranks' GPUs without taking memory on them."""
    return tuple(gpu_uuid(torch.device(d)) if d.startswith("cuda") else "" for d in devices)


def native_bf16(device: torch.device) -> bool:
    """bf16 in hardware: compute capability 8.0 (Ampere) or newer, or any ROCm GPU. Not
    `torch.cuda.is_bf16_supported()`, which also says yes where bf16 is only emulated (slowly)."""
    return bool(torch.version.hip) or torch.cuda.get_device_properties(device).major >= 8


def choose_precision(precision: str, device_type: str, has_native_bf16: bool, cpu_bf16: bool = False) -> str:
    """"auto": bf16 on GPUs that have it, fp16 (with a grad scaler) on older ones; on a CPU, bf16
    where cpu_precision measured it clearly faster (`cpu_bf16`), else fp32."""
    if device_type == "cuda":
        if precision == "auto":
            return "bf16" if has_native_bf16 else "fp16"
        if precision == "bf16" and not has_native_bf16:
            raise ConfigError("training.precision = \"bf16\" needs a GPU with bf16 in hardware (Ampere or "
                              "newer); this one only emulates it: use \"auto\" (fp16 with a grad scaler)")
        return precision
    if precision == "fp16":
        raise ConfigError("training.precision = \"fp16\" needs a CUDA GPU; use \"bf16\" or \"fp32\" on CPU")
    if precision == "auto":
        return "bf16" if cpu_bf16 else "fp32"
    return precision


def resolve_precision(precision: str, device: torch.device, cpu_verdict=None) -> str:
    """`cpu_verdict`: a cpu_precision.Verdict for "auto" on a CPU (none: fp32)."""
    return choose_precision(precision, device.type, device.type == "cuda" and native_bf16(device),
                            cpu_verdict is not None and cpu_verdict.precision == "bf16")


def autocast_dtype(precision: str) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def compute_capability(device: torch.device) -> tuple[int, int] | None:
    """A CUDA device's (major, minor); None elsewhere."""
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def expands_kv(cfg, device: torch.device, precision: str) -> bool:
    """Whether the model repeats K/V to the query's heads on `device` (GPT.expand_kv): where no
    fused kernel takes grouped-query attention at `precision` (attention.py says which)."""
    return attention.path_for(cfg, device.type, compute_capability(device), precision) != attention.NATIVE


KERNELS = {"MATH": "math", "FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "memory-efficient",
           "CUDNN_ATTENTION": "cuDNN"}


def attention_header(cfg, device: torch.device, precision: str) -> str:
    """The run header's attention line. The kernel is torch's own choice for the call the model
    makes (one sequence of the run's length, K/V expanded or not, with gradients), so a fall to the
    math kernel that attention.py did not foresee is said, not silent."""
    m, T, D = cfg.model, cfg.training.seq_len, cfg.head_dim
    path = attention.path_for(cfg, device.type, compute_capability(device), precision)
    kv_heads = m.n_kv_head if path == attention.NATIVE else m.n_head
    dtype = autocast_dtype(precision) or torch.float32
    q = torch.zeros(1, m.n_head, T, D, dtype=dtype, device=device, requires_grad=True)
    kv = torch.zeros(1, kv_heads, T, D, dtype=dtype, device=device)
    # Private, and kept: torch has no public way to ask which kernel scaled_dot_product_attention picks.
    choice = SDPBackend(torch._fused_sdp_choice(q, kv, kv, None, 0.0, True, enable_gqa=True))
    kernel = KERNELS.get(choice.name, choice.name.lower())
    return attention.header(cfg, path, kernel, precision, device.type)


def peak_flops(device: torch.device, log: Callable[[str], None] | None = None) -> float | None:
    """The device's dense bf16 peak in FLOP/s, or None where MFU means nothing (CPU, unknown GPU);
    an unknown GPU is said to `log`, so a run without MFU says why."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    tflops = peak_tflops(name)
    if tflops is None and log is not None:
        log(unknown_peak_note(name))
    return tflops * 1e12 if tflops else None


def memory_stats(device: torch.device) -> dict[str, int]:
    if device.type == "cuda":
        return {"allocated": torch.cuda.memory_allocated(device),
                "reserved": torch.cuda.memory_reserved(device),
                "peak": torch.cuda.max_memory_allocated(device)}
    return {}

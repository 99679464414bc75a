"""Which device and precision a run uses, and the peak FLOP/s that MFU is measured against."""

from __future__ import annotations

import torch

from .config import ConfigError

# Dense bf16 tensor-core peak, TFLOP/s, by a substring of the CUDA device name (first match wins,
# so the more specific names come first).
PEAK_BF16_TFLOPS = [
    ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("GH200", 989.0),
    ("A100", 312.0), ("A10G", 70.0), ("A6000", 155.0), ("L40S", 362.0), ("L4", 121.0),
    ("RTX 4090", 165.0), ("RTX 4080", 97.5), ("RTX 4070 Ti", 80.0), ("RTX 4070", 58.0),
    ("RTX 3090", 71.0), ("RTX 3080", 59.5), ("RTX 3070", 40.6), ("RTX 3060", 25.6),
    ("V100", 125.0), ("T4", 65.0),
]


def resolve_device(spec: str) -> torch.device:
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"hardware.device = {spec!r}, but this machine has no usable CUDA GPU "
                          f"(torch {torch.__version__}); use \"auto\" or \"cpu\"")
    dev = torch.device(spec)
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"hardware.device = {spec!r}, but only {torch.cuda.device_count()} GPU(s) are visible")
    return dev


def resolve_precision(precision: str, device: torch.device) -> str:
    """"auto": bf16 on GPUs that have it, fp16 (with a grad scaler) on older ones, fp32 on CPU.

    On CPU, bf16 autocast measured slower than fp32 on an AVX512-BF16 machine without AMX
    (1.15 s against 0.72 s per compiled step at the cpu preset's shape), so auto keeps fp32.
    """
    if device.type == "cuda":
        if precision == "auto":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return precision
    if precision == "fp16":
        raise ConfigError("training.precision = \"fp16\" needs a CUDA GPU; use \"bf16\" or \"fp32\" on CPU")
    return "fp32" if precision == "auto" else precision


def autocast_dtype(precision: str) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak in FLOP/s, or None where MFU means nothing (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


def memory_stats(device: torch.device) -> dict[str, int]:
    if device.type == "cuda":
        return {"allocated": torch.cuda.memory_allocated(device),
                "reserved": torch.cuda.memory_reserved(device),
                "peak": torch.cuda.max_memory_allocated(device)}
    return {}

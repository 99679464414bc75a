"""Which device and precision a run uses, which attention kernel, and the peak FLOP/s that MFU is
measured against."""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

from ..config import ConfigError
from . import attention, gpu_env

# Dense bf16 tensor-core peak (fp32 accumulate, no sparsity), TFLOP/s, by a substring of the CUDA
# device name. First match wins, so the more specific names come first ("RTX 4070 Ti SUPER" before
# "RTX 4070 Ti" before "RTX 4070"; "L40S" and "L40" before "L4"; "H100 PCIe"/"H100 NVL" before "H100").
# GeForce cards run bf16 with fp32 accumulation at half their fp16-accumulate rate: these are the
# fp32-accumulate figures (RTX 4090: 165, not 330), the ones a training matmul gets.
PEAK_BF16_TFLOPS = [
    ("GH200", 989.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
    ("H800", 989.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("A10G", 70.0),
    ("A6000", 155.0), ("RTX 6000 Ada", 364.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0),
    ("RTX 4090", 165.0), ("RTX 4080 SUPER", 104.0), ("RTX 4080", 97.5), ("RTX 4070 Ti SUPER", 88.2),
    ("RTX 4070 Ti", 80.0), ("RTX 4070 SUPER", 71.0), ("RTX 4070", 58.0), ("RTX 4060 Ti", 44.1), ("RTX 4060", 30.2),
    ("RTX 3090 Ti", 80.0), ("RTX 3090", 71.0), ("RTX 3080 Ti", 68.2), ("RTX 3080", 59.5),
    ("RTX 3070", 40.6), ("RTX 3060 Ti", 32.4), ("RTX 3060", 25.6),
    ("V100", 125.0), ("T4", 65.0),  # no bf16 on these two: their fp16 peak, which "auto" uses
]


def peak_tflops(name: str) -> float | None:
    """The table's dense bf16 peak for a CUDA device name, or None for a card it does not know."""
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key in name), None)


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
    free = {gpu_env.normalise_uuid(g.uuid): g.free for g in gpu_env.read_nvml().gpus}
    readings = []
    for i in range(torch.cuda.device_count()):
        uuid = gpu_env.normalise_uuid(str(torch.cuda.get_device_properties(i).uuid))
        if uuid in free:
            readings.append((i, free[uuid]))
    best = gpu_env.most_free(readings)
    return 0 if best is None else best


def native_bf16(device: torch.device) -> bool:
    """bf16 in hardware: compute capability 8.0 (Ampere) or newer, or any ROCm GPU. Not
    `torch.cuda.is_bf16_supported()`, which also says yes where bf16 is only emulated (slowly)."""
    return bool(torch.version.hip) or torch.cuda.get_device_properties(device).major >= 8


def choose_precision(precision: str, device_type: str, has_native_bf16: bool) -> str:
    """"auto": bf16 on GPUs that have it, fp16 (with a grad scaler) on older ones, fp32 on CPU.

    On CPU, bf16 autocast measured slower than fp32 on an AVX512-BF16 machine without AMX
    (1.15 s against 0.72 s per compiled step at the cpu preset's shape), so auto keeps fp32.
    """
    if device_type == "cuda":
        if precision == "auto":
            return "bf16" if has_native_bf16 else "fp16"
        if precision == "bf16" and not has_native_bf16:
            raise ConfigError("training.precision = \"bf16\" needs a GPU with bf16 in hardware (Ampere or "
                              "newer); this one only emulates it: use \"auto\" (fp16 with a grad scaler)")
        return precision
    if precision == "fp16":
        raise ConfigError("training.precision = \"fp16\" needs a CUDA GPU; use \"bf16\" or \"fp32\" on CPU")
    return "fp32" if precision == "auto" else precision


def resolve_precision(precision: str, device: torch.device) -> str:
    return choose_precision(precision, device.type, device.type == "cuda" and native_bf16(device))


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
    choice = SDPBackend(torch._fused_sdp_choice(q, kv, kv, None, 0.0, True, enable_gqa=True))
    kernel = KERNELS.get(choice.name, choice.name.lower())
    return attention.header(cfg, path, kernel, precision, device.type)


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak in FLOP/s, or None where MFU means nothing (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    tflops = peak_tflops(torch.cuda.get_device_name(device))
    return tflops * 1e12 if tflops else None


def memory_stats(device: torch.device) -> dict[str, int]:
    if device.type == "cuda":
        return {"allocated": torch.cuda.memory_allocated(device),
                "reserved": torch.cuda.memory_reserved(device),
                "peak": torch.cuda.max_memory_allocated(device)}
    return {}

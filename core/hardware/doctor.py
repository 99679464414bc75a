"""The torch side of `lmcockpit doctor`: what this torch build can do here, as one JSON line.

Run as `python -m lmcockpit.core.hardware.doctor` by the front-end's doctor, in a process of its own: a
broken torch install then shows up as a diagnosis instead of a crash, and the front-end stays
torch-free. The process starts with the allocator variable the engine would set, so the
allocator check reports what a run really gets.
"""

from __future__ import annotations

import dataclasses
import json
import time
import traceback

import torch
import torch.nn.functional as F

from .device import native_bf16, peak_tflops


def gpu_facts() -> list[dict]:
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        dev = torch.device("cuda", i)
        out.append({"index": i, "name": p.name, "total": p.total_memory, "capability": f"{p.major}.{p.minor}",
                    "bf16": native_bf16(dev), "peak_tflops": peak_tflops(p.name)})
    return out


def compile_smoke_test(device: torch.device) -> dict:
    """Compile a tiny function (a norm, a matmul, a pointwise tail) and run it: the whole path a
    training step's compile takes (dynamo, inductor, the C++ or Triton toolchain), in seconds."""
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return F.silu(x @ w).sum(-1)

    x, w = torch.randn(64, 128, device=device), torch.randn(128, 128, device=device)
    t0 = time.perf_counter()
    try:
        got = torch.compile(f, dynamic=False)(x, w)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ok = torch.allclose(got, f(x, w), rtol=1e-3, atol=1e-3)
        return {"ok": bool(ok), "seconds": time.perf_counter() - t0, "device": str(device),
                "error": "" if ok else "the compiled function gave a different result"}
    except Exception as e:  # noqa: BLE001 - any failure here is the diagnosis
        return {"ok": False, "seconds": time.perf_counter() - t0, "device": str(device),
                "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}


def flash_attention(device: torch.device, bf16: bool) -> dict:
    """Whether SDPA's flash kernel runs the model's attention call (causal, grouped-query)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.bfloat16 if bf16 else torch.float16
    q = torch.randn(1, 4, 128, 64, device=device, dtype=dtype)
    kv = torch.randn(1, 2, 128, 64, device=device, dtype=dtype)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize(device)
        return {"ok": True, "error": ""}
    except Exception as e:  # noqa: BLE001 - "no kernel available" is a RuntimeError with the reasons
        return {"ok": False, "error": str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}


def expandable_segments(device: torch.device) -> bool | None:
    """Whether the allocator really uses expandable segments (torch has ignored the variable
    under some names in some releases): read from a memory snapshot after one allocation."""
    keep = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    # Private, and kept: the public torch.cuda.memory_snapshot() returns only the segments, not
    # the allocator_settings that recent releases state outright.
    snapshot = torch.cuda.memory._snapshot()
    del keep
    settings = snapshot.get("allocator_settings") or {}
    if "expandable_segments" in settings:  # recent releases say it outright
        return bool(settings["expandable_segments"])
    flags = [seg["is_expandable"] for seg in snapshot.get("segments", []) if "is_expandable" in seg]
    return any(flags) if flags else None


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return getattr(triton, "__version__", "unknown")


def facts() -> dict:
    cuda = torch.cuda.is_available()
    gpus = gpu_facts() if cuda else []
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    out = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "hip_build": torch.version.hip,
           "cuda_available": cuda, "gpus": gpus, "triton": triton_version(),
           "flash_built": torch.backends.cuda.is_flash_attention_available(),
           "compile": compile_smoke_test(device)}
    if cuda:
        out["flash"] = flash_attention(device, gpus[0]["bf16"])
        out["expandable_segments"] = expandable_segments(device)
    else:
        out["cpu_precision"] = cpu_precision_facts()
    return out


def cpu_precision_facts() -> dict:
    """What precision "auto" trains in on this CPU: the cached verdict, or the probe at the cpu
    preset's shape (then cached, as a first run would)."""
    from ..config import load_config
    from .cpu_precision import cache_path, choose, known

    cfg = load_config("cpu")[0]
    probed = known(cfg) is None
    verdict = choose(cfg)
    return {**dataclasses.asdict(verdict), "probed": probed, "cache": str(cache_path())}


def main() -> None:
    try:
        result = facts()
    except Exception:  # noqa: BLE001 - reported to the front-end, which explains it
        result = {"error": traceback.format_exc()}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

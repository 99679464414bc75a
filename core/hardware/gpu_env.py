"""GPU set-up that has to happen before torch initialises CUDA, and NVML facts: no torch here.

The engine calls `configure_allocator` first thing, and the doctor reports what it would set;
`hardware.device = "auto"` picks among the GPUs that NVML reads with `most_free`.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import MutableMapping

# Expandable segments let the caching allocator grow one mapping instead of carving fixed blocks,
# so memory freed by evaluation or sampling between steps is reused rather than fragmenting.
ALLOC_VALUE = "expandable_segments:True"
# The names torch reads, in its order of precedence. The generic PYTORCH_ALLOC_CONF arrived in
# torch 2.8 with PYTORCH_CUDA_ALLOC_CONF kept as an alias, but 2.9.1 ignored expandable_segments
# given under the new name for CUDA (pytorch#183387; fixed by 2.11). The old name works in every
# release (2.8 to 2.11 only warn that it is deprecated), so it is used before 2.11, the new one after.
ALLOC_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
NEW_ALLOC_NAME_SINCE = (2, 11)


@dataclass(frozen=True)
class AllocSetting:
    name: str  # the environment variable ("" where lmcockpit sets none)
    value: str
    by_user: bool  # set before lmcockpit started: never overridden

    def describe(self) -> str:
        if self.by_user:
            return f"{self.name}={self.value} (yours: lmcockpit leaves it as it is)"
        if not self.name:
            return "torch's default (expandable segments need Linux)"
        return f"{self.name}={self.value} (set by lmcockpit in the engine process)"


def torch_version() -> tuple[int, int] | None:
    """(major, minor) of the installed torch, read from its package metadata: importing torch
    would be too late (and too slow for the front-end)."""
    try:
        found = re.match(r"(\d+)\.(\d+)", metadata.version("torch"))
    except metadata.PackageNotFoundError:
        return None
    return (int(found[1]), int(found[2])) if found else None


def alloc_var_name(version: tuple[int, int] | None) -> str:
    new = version is not None and version >= NEW_ALLOC_NAME_SINCE
    return "PYTORCH_ALLOC_CONF" if new else "PYTORCH_CUDA_ALLOC_CONF"


def allocator_setting(environ: MutableMapping[str, str], version: tuple[int, int] | None,
                      platform: str = sys.platform) -> AllocSetting:
    """What the allocator will run with: the user's own variable if any is set, else ours."""
    for name in ALLOC_VARS:
        if environ.get(name):
            return AllocSetting(name, environ[name], by_user=True)
    if platform != "linux":
        return AllocSetting("", "", by_user=False)
    return AllocSetting(alloc_var_name(version), ALLOC_VALUE, by_user=False)


def configure_allocator(environ: MutableMapping[str, str] = os.environ) -> AllocSetting:
    """Set the allocator variable unless the user set one. Must run before torch initialises
    CUDA (it reads the variable once, then): the first thing the engine process does."""
    setting = allocator_setting(environ, torch_version())
    if setting.name and not setting.by_user:
        environ[setting.name] = setting.value
    return setting


# ------------------------------------------------------------------------------------- NVML
@dataclass(frozen=True)
class NvmlGPU:
    index: int  # NVML's index: PCI bus order, all GPUs, whatever CUDA_VISIBLE_DEVICES says
    uuid: str  # "" where NVML would not say
    name: str  # "?" where NVML would not say
    total: int | None  # bytes; None where NVML would not say
    free: int | None
    compute_capability: tuple[int, int] | None


@dataclass(frozen=True)
class NvmlInfo:
    gpus: list[NvmlGPU]
    driver: str  # "" without NVML, "?" where NVML would not say
    error: str  # "" or why NVML could not be read (no library, no driver, no GPU count)


def ask(query, default=None):
    """NVML's answer to `query`, or `default`. A driver refuses single queries for reasons that say
    nothing about the rest (NotSupported on a MIG instance, GpuIsLost for a card that fell off the
    bus, a name that is not UTF-8, a pynvml too old for the call): each costs its own field only,
    never the cockpit that asked."""
    try:
        return query()
    except Exception:  # noqa: BLE001 - see above: any failure means "no answer"
        return default


def read_nvml() -> NvmlInfo:
    """Every GPU the driver sees. Never raises: what NVML will not say is left unknown."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - missing library, missing driver: both mean no NVML
        return NvmlInfo([], "", f"no NVML ({type(e).__name__}: {e})")
    try:
        driver = ask(lambda: _str(pynvml.nvmlSystemGetDriverVersion()), "?")
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except Exception as e:  # noqa: BLE001 - without a count no GPU can be named
            return NvmlInfo([], driver, f"NVML cannot count the GPUs ({type(e).__name__}: {e})")
        gpus = (_nvml_gpu(pynvml, i) for i in range(count))
        return NvmlInfo([g for g in gpus if g is not None], driver, "")
    finally:
        ask(pynvml.nvmlShutdown)  # a failed shutdown leaves nothing the caller could act on


def _nvml_gpu(pynvml, i: int) -> NvmlGPU | None:
    """GPU `i`, or None where NVML gives no handle for it (a GPU that fell off the bus)."""
    h = ask(lambda: pynvml.nvmlDeviceGetHandleByIndex(i))
    if h is None:
        return None
    mem = ask(lambda: pynvml.nvmlDeviceGetMemoryInfo(h))
    cc = ask(lambda: pynvml.nvmlDeviceGetCudaComputeCapability(h))
    return NvmlGPU(i, ask(lambda: _str(pynvml.nvmlDeviceGetUUID(h)), ""),
                   ask(lambda: _str(pynvml.nvmlDeviceGetName(h)), "?"),
                   ask(lambda: int(mem.total)), ask(lambda: int(mem.free)),
                   ask(lambda: (int(cc[0]), int(cc[1]))))


def normalise_uuid(uuid: str) -> str:
    """NVML says "GPU-8f0c…" for a GPU and "MIG-8f0c…" for a MIG instance, torch's device
    properties "8f0c…" for either: compare them without the prefix."""
    uuid = uuid.strip().lower()
    return uuid[4:] if uuid.startswith(("gpu-", "mig-")) else uuid


def most_free(readings: list[tuple[int, int]]) -> int | None:
    """The device index with the most free bytes among (index, free_bytes) readings; the lowest
    index among equals, so an idle machine always starts on the same GPU. None without readings."""
    if not readings:
        return None
    return min(readings, key=lambda r: (-r[1], r[0]))[0]


def _str(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)

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
CUDA_VAR, HIP_VAR, NEW_VAR = "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"
ALLOC_VARS = (CUDA_VAR, HIP_VAR, NEW_VAR)  # every name a torch release reads
# The generic PYTORCH_ALLOC_CONF arrived in torch 2.8 with PYTORCH_CUDA_ALLOC_CONF kept as an alias,
# but 2.9.1 ignored expandable_segments given under the new name for CUDA (pytorch#183387; fixed by
# 2.11). The old name works in every release (2.8 to 2.11 only warn that it is deprecated), so it is
# used before 2.11, the new one after.
NEW_ALLOC_NAME_SINCE = (2, 11)
# Which variable torch takes when several are set: it parses the first one present and never looks
# at the others. 2.8 to 2.11 put the new name first (the releases that warn about the old one);
# the change that dropped the warning went back to the old name first "to keep the parsing order
# stable" (c10/core/AllocatorConfig.cpp, AcceleratorAllocatorConfig::instance, and
# c10/cuda/CUDAAllocatorConfig.h, CUDAAllocatorConfig::instance, which on a CUDA build skips the HIP
# name for the CUDA-only keys). 2.13 was run to check it; 2.12 is taken from when the warning went.
NEW_NAME_FIRST = ((2, 8), (2, 12))


@dataclass(frozen=True)
class AllocSetting:
    name: str  # the environment variable that takes effect ("" where none does)
    value: str
    by_user: bool  # set before lmcockpit started: never overridden
    ignored: tuple[str, ...] = ()  # the user's other allocator variables, which torch passes over

    def describe(self) -> str:
        if self.by_user and not self.name:
            return f"torch's default (this torch does not read your {_named(self.ignored)})"
        if self.by_user:
            passed_over = (f"; {_named(self.ignored)} also set, but torch reads {self.name} first: ignored"
                           if self.ignored else "")
            return f"{self.name}={self.value} (yours: lmcockpit leaves it as it is{passed_over})"
        if not self.name:
            return "torch's default (expandable segments need Linux)"
        return f"{self.name}={self.value} (set by lmcockpit in the engine process)"


def alloc_var_order(version: tuple[int, int] | None) -> tuple[str, ...]:
    """The allocator variables this torch reads, the one it takes when several are set first.
    An unknown version is taken to be a current one."""
    if version is not None and version < NEW_NAME_FIRST[0]:
        return (CUDA_VAR, HIP_VAR)
    if version is not None and version < NEW_NAME_FIRST[1]:
        return (NEW_VAR, CUDA_VAR, HIP_VAR)
    return ALLOC_VARS


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
    return NEW_VAR if new else CUDA_VAR


def allocator_setting(environ: MutableMapping[str, str], version: tuple[int, int] | None,
                      platform: str = sys.platform) -> AllocSetting:
    """What the allocator will run with: the user's own variable if they set any, else ours.
    torch takes the first variable of its order that is present at all: an empty one too, as
    its defaults."""
    if any(environ.get(name) for name in ALLOC_VARS):
        taken = next((name for name in alloc_var_order(version) if name in environ), "")
        return AllocSetting(taken, environ.get(taken, ""), by_user=True,
                            ignored=tuple(name for name in ALLOC_VARS if environ.get(name) and name != taken))
    if platform != "linux":
        return AllocSetting("", "", by_user=False)
    return AllocSetting(alloc_var_name(version), ALLOC_VALUE, by_user=False)


def configure_allocator(environ: MutableMapping[str, str] = os.environ) -> AllocSetting:
    """Set the allocator variable unless the user set one. Must run before torch initialises
    CUDA (it reads the variable once, then): the first thing the engine process does."""
    setting = allocator_setting(environ, torch_version())
    if setting.name and not setting.by_user:
        for name in ALLOC_VARS:  # empty: nothing of the user's, but torch could take it before ours
            if name in environ:
                del environ[name]
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


def _named(names: tuple[str, ...]) -> str:
    return " and ".join(names)


def _str(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)

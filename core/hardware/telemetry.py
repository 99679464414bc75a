"""GPU and system readings that need no torch: NVML (through pynvml) and psutil.

Sampled by the front-end at about 1 Hz, so its panels work before a run starts and while the
engine is busy compiling. No GPU or no NVML: `gpus` is empty and `nvml_error` says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import psutil


@dataclass(frozen=True)
class GPUReading:
    index: int
    name: str
    util: float  # %
    mem_util: float  # %
    mem_used: int  # bytes
    mem_total: int
    temperature: float | None  # °C
    power: float | None  # W
    sm_clock: int | None  # MHz


@dataclass(frozen=True)
class Reading:
    cpu_percent: float
    ram_used: int
    ram_total: int
    gpus: list[GPUReading] = field(default_factory=list)


class Telemetry:
    def __init__(self):
        self.nvml = None
        self.nvml_error = ""
        self.driver = ""
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.driver = _str(pynvml.nvmlSystemGetDriverVersion())
        except Exception as e:  # noqa: BLE001 - no library, no driver, no GPU: all mean "no NVML"
            self.nvml_error = f"no NVML: {e}" if str(e) else "no NVML"
        psutil.cpu_percent(None)  # the first call primes the counter

    def read(self) -> Reading:
        vm = psutil.virtual_memory()
        return Reading(psutil.cpu_percent(None), vm.total - vm.available, vm.total, self._gpus())

    def _gpus(self) -> list[GPUReading]:
        if self.nvml is None:
            return []
        n = self.nvml
        out = []
        for i in range(n.nvmlDeviceGetCount()):
            try:
                h = n.nvmlDeviceGetHandleByIndex(i)
                util = n.nvmlDeviceGetUtilizationRates(h)
                mem = n.nvmlDeviceGetMemoryInfo(h)
            except Exception:  # noqa: BLE001 - MIG and some virtual GPUs refuse these: that GPU goes unread
                continue
            out.append(GPUReading(i, _str(n.nvmlDeviceGetName(h)), float(util.gpu), float(util.memory),
                                  int(mem.used), int(mem.total),
                                  _opt(lambda: float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))),
                                  _opt(lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0),
                                  _opt(lambda: int(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)))))
        return out


def _str(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _opt(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a reading some cards do not support
        return None


# ------------------------------------------- which NVML GPU a torch device is
def cuda_visible(env: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as its entries; None when unset, which means CUDA sees every GPU."""
    return None if env is None else [e.strip() for e in env.split(",") if e.strip()]


def nvml_index(device: str, visible: str | None = None) -> int | None:
    """The NVML index of the GPU behind torch device `device` ("cuda", "cuda:N"); None for a
    device that is no CUDA GPU ("cpu").

    CUDA numbers only the GPUs that CUDA_VISIBLE_DEVICES (`visible`) lists, in its order, while
    NVML numbers every GPU: with "2,3", cuda:0 is NVML GPU 2. Entries that are not integers
    (GPU-…/MIG-… UUIDs) would take NVML calls to resolve, so then CUDA index N is read as NVML
    GPU N: right when the UUIDs list the GPUs in NVML's order, wrong otherwise."""
    if device == "cuda":
        n = 0
    elif device.startswith("cuda:") and device[5:].isdigit():
        n = int(device[5:])
    else:
        return None
    entries = cuda_visible(visible)
    if entries and all(e.isdigit() for e in entries) and n < len(entries):
        return int(entries[n])
    return n


def run_gpu_indices(devices: tuple[str, ...], visible: str | None = None) -> list[int]:
    """NVML indices of the GPUs a run's devices are, in order, each once; empty for a CPU run."""
    indices = [nvml_index(d, visible) for d in devices]
    return list(dict.fromkeys(i for i in indices if i is not None))


def cuda_gpu_count(n_gpus: int, visible: str | None = None) -> int:
    """How many of the `n_gpus` GPUs that NVML sees CUDA may use: a run can start a process on each."""
    entries = cuda_visible(visible)
    if entries is None:
        return n_gpus
    if all(e.isdigit() for e in entries):
        return len({e for e in entries if int(e) < n_gpus})
    return min(len(entries), n_gpus)


def find_gpu(reading: Reading | None, index: int) -> GPUReading | None:
    return next((g for g in reading.gpus if g.index == index), None) if reading else None

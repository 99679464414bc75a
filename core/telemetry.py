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
            h = n.nvmlDeviceGetHandleByIndex(i)
            util = n.nvmlDeviceGetUtilizationRates(h)
            mem = n.nvmlDeviceGetMemoryInfo(h)
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

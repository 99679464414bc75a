"""GPU and system readings that need no torch: NVML (through pynvml) and psutil.

Sampled by the front-end at about 1 Hz, so its panels work before a run starts and while the
engine is busy compiling. No GPU or no NVML: `gpus` is empty and `nvml_error` says why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psutil

from .gpu_env import ask, normalise_uuid


@dataclass(frozen=True)
class GPUReading:
    """One GPU as NVML read it; None (name "?", uuid "") where NVML would not say."""
    index: int  # NVML's: every GPU, in PCI bus order
    name: str
    util: float | None  # %
    mem_util: float | None  # %
    mem_used: int | None  # bytes
    mem_total: int | None
    temperature: float | None  # °C
    power: float | None  # W
    sm_clock: int | None  # MHz
    uuid: str = ""  # NVML's "GPU-…"
    mig_uuids: tuple[str, ...] = ()  # NVML's "MIG-…" of its MIG instances: what CUDA lists under MIG


@dataclass(frozen=True)
class Reading:
    cpu_percent: float
    ram_used: int
    ram_total: int
    gpus: list[GPUReading] = field(default_factory=list)


@dataclass(frozen=True)
class ProcessLoad:
    """A run's processes (its host and every process under it: the engine, torchrun's workers,
    data workers) taken together."""
    cpu_percent: float  # of one core: 2 busy cores read 200
    rss: int  # bytes, summed (shared pages count once per process, as `top` counts them)
    cores: int  # the machine's logical cores, so a bar can show how much of it the run takes


TREE_EVERY = 5.0  # seconds between listings of a run's processes (a DataLoader's workers come and go)


class Telemetry:
    """Never raises: NVML failing a query costs that field ("?"/None), failing for a GPU's handle
    costs that GPU, and failing to count the GPUs costs all of them, with `nvml_error` saying why."""

    def __init__(self):
        self.nvml = None
        self.nvml_error = ""
        self.driver = ""
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - no library, no driver, no GPU: all mean "no NVML"
            self.nvml_error = f"no NVML: {e}" if str(e) else "no NVML"
        else:
            self.nvml = pynvml
            self.driver = ask(lambda: _str(pynvml.nvmlSystemGetDriverVersion()), "?")
        psutil.cpu_percent(None)  # the first call primes the counter

    def read(self) -> Reading:
        vm = psutil.virtual_memory()
        return Reading(psutil.cpu_percent(None), vm.total - vm.available, vm.total, self._gpus())

    def process_load(self, pid: int) -> ProcessLoad | None:
        """CPU and memory of process `pid` and its descendants; None once it is gone. psutil
        measures a process's CPU since the previous call on the same Process object: they are kept
        between calls, so the first reading of a process counts 0 and later ones its real share."""
        known: dict[int, psutil.Process] = getattr(self, "_processes", {})
        now = time.monotonic()
        if pid not in known or now - getattr(self, "_listed_at", -TREE_EVERY) >= TREE_EVERY:
            # Listing descendants reads every process's /proc entry: on a busy shared machine that
            # is most of a reading, so the tree is listed again every TREE_EVERY seconds only.
            try:
                root = known.get(pid) or psutil.Process(pid)
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:
                return None
            known = {p.pid: known.get(p.pid, p) for p in tree}
            self._listed_at = now
        cpu = rss = 0
        for p in list(known.values()):
            try:
                cpu += p.cpu_percent(None)
                rss += p.memory_info().rss
            except psutil.Error:  # ended since the listing
                if p.pid == pid:
                    return None
                del known[p.pid]
        self._processes = known
        return ProcessLoad(cpu, rss, psutil.cpu_count() or 1)

    def _gpus(self) -> list[GPUReading]:
        if self.nvml is None:
            return []
        try:
            count = int(self.nvml.nvmlDeviceGetCount())
        except Exception as e:  # noqa: BLE001 - a driver in trouble: say so where "no GPU" shows
            self.nvml_error = f"NVML cannot count the GPUs: {type(e).__name__}: {e}"
            return []
        self.nvml_error = ""
        handles = ((i, ask(lambda i=i: self.nvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count))
        return [self._gpu(i, h) for i, h in handles if h is not None]  # no handle: a GPU off the bus

    def _gpu(self, i: int, h) -> GPUReading:
        n = self.nvml
        util = ask(lambda: n.nvmlDeviceGetUtilizationRates(h))
        mem = ask(lambda: n.nvmlDeviceGetMemoryInfo(h))
        return GPUReading(i, ask(lambda: _str(n.nvmlDeviceGetName(h)), "?"),
                          ask(lambda: float(util.gpu)), ask(lambda: float(util.memory)),
                          ask(lambda: int(mem.used)), ask(lambda: int(mem.total)),
                          ask(lambda: float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))),
                          ask(lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0),
                          ask(lambda: int(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM))),
                          ask(lambda: _str(n.nvmlDeviceGetUUID(h)), ""), mig_uuids(n, h))


def mig_uuids(n, h) -> tuple[str, ...]:
    """The UUIDs of GPU `h`'s MIG instances; () for a GPU without MIG on (most answer NotSupported)."""
    if ask(lambda: n.nvmlDeviceGetMigMode(h)[0] == n.NVML_DEVICE_MIG_ENABLE) is not True:
        return ()
    slots = ask(lambda: range(int(n.nvmlDeviceGetMaxMigDeviceCount(h))), ())
    uuids = (ask(lambda k=k: _str(n.nvmlDeviceGetUUID(n.nvmlDeviceGetMigDeviceHandleByIndex(h, k))), "")
             for k in slots)
    return tuple(u for u in uuids if u)  # an empty slot answers NotFound


def _str(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# ------------------------------------------- which NVML GPU a torch device is
def cuda_visible(env: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as its entries; None when unset, which means CUDA sees every GPU."""
    return None if env is None else [e.strip() for e in env.split(",") if e.strip()]


def find_uuid(gpus: list[GPUReading], uuid: str, prefix: bool = False) -> GPUReading | None:
    """The GPU that is `uuid`, or that has it among its MIG instances (whose figures are then the
    whole GPU's). `prefix`: `uuid` may be the start of one, as CUDA_VISIBLE_DEVICES allows."""
    want = normalise_uuid(uuid)
    if not want:
        return None
    same = (lambda u: normalise_uuid(u).startswith(want)) if prefix else (lambda u: normalise_uuid(u) == want)
    return next((g for g in gpus if any(same(u) for u in (g.uuid, *g.mig_uuids) if u)), None)


def nvml_index(device: str, visible: str | None = None, uuid: str = "",
               gpus: list[GPUReading] | None = None) -> int | None:
    """The NVML index of the GPU behind torch device `device` ("cuda", "cuda:N"); None for a
    device that is no CUDA GPU ("cpu"), or whose `uuid` NVML's readings `gpus` do not list.

    By `uuid` (the engine's, from RunStarted) where it is known: CUDA puts the fastest GPU first
    and numbers only those CUDA_VISIBLE_DEVICES (`visible`) lists, in its order, while NVML numbers
    every GPU in bus order. A known UUID that NVML does not list (no NVML, a GPU it cannot read)
    gives no index: a guess could show another GPU's figures as the run's. Without a UUID (a CPU
    engine's, an older engine's), by CUDA_VISIBLE_DEVICES: with "2,3", cuda:0 is NVML GPU 2; a
    GPU-…/MIG-… entry is looked up in `gpus`; else CUDA index N is read as NVML GPU N, which is
    right on a machine of equal GPUs."""
    if device == "cuda":
        n = 0
    elif device.startswith("cuda:") and device[5:].isdigit():
        n = int(device[5:])
    else:
        return None
    gpus = gpus or []
    if uuid:
        found = find_uuid(gpus, uuid)
        return found.index if found else None
    entries = cuda_visible(visible)
    if entries and n < len(entries):
        if all(e.isdigit() for e in entries):
            return int(entries[n])
        if found := find_uuid(gpus, entries[n], prefix=True):
            return found.index
    return n


def run_gpu_indices(devices: tuple[str, ...], visible: str | None = None, uuids: tuple[str, ...] = (),
                    gpus: list[GPUReading] | None = None) -> list[int]:
    """NVML indices of the GPUs a run's devices are, in order, each once; empty for a CPU run.
    `uuids`: RunStarted's, one per device (fewer, or none, from an older engine)."""
    uuids = (*uuids, *[""] * (len(devices) - len(uuids)))
    indices = [nvml_index(d, visible, u, gpus) for d, u in zip(devices, uuids)]
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

"""`lmcockpit doctor`: everything a run on this machine depends on, checked, with a plain diagnosis.

Exit 0 when a run can start: on a GPU, or on the CPU when the machine has none. Exit 1 when
something stops it: torch that does not import, a GPU the driver sees but torch cannot use, a
compiler that fails (every preset compiles). Warnings (no bf16, no flash attention, little disk)
slow a run down or limit it without stopping it.

Torch's facts come from `python -m lmcockpit.core.hardware.doctor` in a child process, so this command
stays torch-free and reports a broken torch install instead of crashing on it.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.text import Text

from ... import __version__
from ...core.config import Config
from ...core.data.store import cache_root
from ...core.hardware import gpu_env
from ...core.hardware.cpu_precision import MARGIN
from . import command_parser
from ..usage import Parser, new_console

TORCH_CHECK_TIMEOUT = 600  # a cold compile smoke test on a slow machine takes well under a minute
LOW_DISK = 10 * 1024**3  # a checkpoint of the h100 preset (weights and optimizer state) is about 4 GB
GiB = 1024**3


@dataclass(frozen=True)
class Check:
    status: str  # "ok", "info", "warn" or "FAIL"
    what: str
    detail: str


STYLE = {"ok": "green", "info": "cyan", "warn": "yellow", "FAIL": "bold red"}


def torch_facts(env: dict[str, str]) -> tuple[dict | None, str]:
    """The child's JSON facts, or None and why there are none."""
    try:
        # -P: the working folder not first on sys.path (a clone's lmcockpit/ would shadow the installed one)
        proc = subprocess.run([sys.executable, "-P", "-m", "lmcockpit.core.hardware.doctor"], capture_output=True,
                              text=True, env=env, timeout=TORCH_CHECK_TIMEOUT)
    except subprocess.TimeoutExpired:
        return None, f"the torch check did not finish in {TORCH_CHECK_TIMEOUT} s"
    lines = proc.stdout.strip().splitlines()
    try:
        facts = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        err = proc.stderr.strip().splitlines()
        return None, err[-1] if err else f"the torch check exited with code {proc.returncode} and said nothing"
    if "error" in facts:
        return None, facts["error"].strip().splitlines()[-1]
    return facts, ""


def free_disk(path: Path) -> tuple[Path, int]:
    """Free bytes where `path` is or would be created (its nearest existing ancestor)."""
    path = path.expanduser().absolute()
    while not path.exists():
        path = path.parent
    return path, shutil.disk_usage(path).free


def checks() -> list[Check]:
    out = [Check("info", "lmcockpit", f"{__version__}, Python {platform.python_version()}, {platform.platform()}")]
    nvml = gpu_env.read_nvml()
    env = dict(os.environ)
    allocator = gpu_env.configure_allocator(env)  # what the engine process will run with
    facts, why = torch_facts(env)
    if facts is None:
        out.append(Check("FAIL", "torch", f"cannot be imported or used here: {why}"))
        return out + gpu_lines_from_nvml(nvml) + disk_checks()

    build = (f"CUDA {facts['cuda_build']} build" if facts["cuda_build"]
             else f"ROCm {facts['hip_build']} build" if facts["hip_build"] else "CPU-only build")
    out.append(Check("ok", "torch", f"{facts['torch']}, {build}"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        out.append(Check("info", "CUDA_VISIBLE_DEVICES", f"{visible!r}: torch numbers only these GPUs, from 0"))
    cuda = facts["cuda_available"]

    if nvml.error:
        # installing pynvml helps where it is missing, not where the driver fails a query
        install = " (pip install nvidia-ml-py)" if nvml.error.startswith("no NVML") else ""
        out.append(Check("warn" if cuda else "info", "NVML",
                         f"{nvml.error}" + ("; the GPU panel and hardware.device = \"auto\"'s choice by free memory "
                                            f"need it{install}" if cuda else "")))
    else:
        out.append(Check("ok", "NVML", f"driver {nvml.driver}, {len(nvml.gpus)} GPU(s)"))

    if cuda:
        for g in facts["gpus"]:
            peak = f"MFU against {g['peak_tflops']:g} TFLOP/s" if g["peak_tflops"] else "not in the MFU table"
            out.append(Check("ok", f"cuda:{g['index']}", f"{g['name']}, {g['total'] / GiB:.1f} GiB, "
                                                          f"compute capability {g['capability']}, {peak}"))
            out.append(Check("ok", "  bf16", "in hardware: precision \"auto\" trains in bf16") if g["bf16"] else
                       Check("warn", "  bf16", "not in hardware: precision \"auto\" uses fp16 with a grad scaler"))
    elif nvml.gpus and visible is not None and facts["cuda_build"]:
        out.append(Check("warn", "GPU", f"CUDA_VISIBLE_DEVICES={visible!r} hides all {len(nvml.gpus)} GPU(s) from "
                                        "torch: runs train on the CPU"))
    elif nvml.gpus:
        names = ", ".join(g.name for g in nvml.gpus)
        fix = ("install a CUDA build of torch (https://pytorch.org/get-started/locally/)" if not facts["cuda_build"]
               else f"torch's CUDA {facts['cuda_build']} cannot use driver {nvml.driver}: update the driver or "
                    "install a torch built for an older CUDA")
        out.append(Check("FAIL", "GPU", f"the driver sees {names}, but torch cannot use it: {fix}. "
                                        "CPU runs still work with --set hardware.device=\"cpu\""))
    else:
        out.append(Check("info", "GPU", "none found: runs train on the CPU (the cpu and debug presets; "
                                        "the GPU presets would take days)"))

    smoke = facts["compile"]
    if smoke["ok"]:
        out.append(Check("ok", "torch.compile", f"smoke test compiled and ran on {smoke['device']} "
                                                f"in {smoke['seconds']:.1f} s"))
    else:
        out.append(Check("FAIL", "torch.compile", f"failed on {smoke['device']} ({smoke['error']}); every preset "
                                                  "compiles: fix the toolchain or --set training.compile=false"))
    if facts["triton"]:
        out.append(Check("ok", "Triton", facts["triton"]))
    else:
        out.append(Check("FAIL" if cuda else "info", "Triton",
                         "not installed: torch.compile needs it on a GPU (pip install triton)" if cuda
                         else "not installed (only compiling for a GPU needs it)"))
    if cuda:
        flash = facts["flash"]
        out.append(Check("ok", "flash attention", "SDPA's flash kernel runs the model's attention") if flash["ok"]
                   else Check("warn", "flash attention", f"not usable here ({flash['error']}): SDPA falls back to a "
                                                         "slower kernel"))
    else:
        out.append(Check("info", "flash attention", "a GPU kernel: not used on the CPU"
                                                    + ("" if facts["flash_built"] else " (not in this build)")))
        out.append(cpu_precision_check(facts["cpu_precision"]))

    expandable = facts.get("expandable_segments")
    if cuda and expandable is False and "expandable_segments:true" in allocator.value.lower():
        out.append(Check("warn", "allocator", f"{allocator.describe()}, but torch {facts['torch']} does not "
                                              "apply it: expandable segments are off"))
    else:
        out.append(Check("ok", "allocator", allocator.describe()))
    return out + disk_checks()


def cpu_precision_check(v: dict) -> Check:
    """precision "auto" on this CPU, with what was measured (cpu_precision.Verdict's fields)."""
    if v["speedup"] is None:
        return Check("info", "CPU precision", f"{v['precision']} ({v['why']})")
    how = "measured now" if v["probed"] else "measured before"
    return Check("ok", "CPU precision", f"precision \"auto\" trains in {v['precision']}: a block's forward and "
                                        f"backward took {v['fp32_ms']:.0f} ms in fp32, {v['bf16_ms']:.0f} ms in bf16 "
                                        f"({v['speedup']:.2f}×; bf16 from {MARGIN:g}×), {how} ({v['probe']}); "
                                        f"kept in {v['cache']}")


def gpu_lines_from_nvml(nvml: gpu_env.NvmlInfo) -> list[Check]:
    return [Check("info", f"GPU {g.index}", f"{g.name}, {size(g.total)} (from NVML)") for g in nvml.gpus]


def size(total: int | None) -> str:
    return f"{total / GiB:.1f} GiB" if total is not None else "memory unknown"


def disk_checks() -> list[Check]:
    out = []
    for what, path in (("disk (runs)", Path("runs")), ("disk (cache)", cache_root(Config()))):
        where, free = free_disk(path)
        detail = f"{free / GiB:.0f} GiB free at {where}"
        out.append(Check("ok", what, detail) if free >= LOW_DISK else
                   Check("warn", what, detail + ": checkpoints of the larger presets need several GB each"))
    return out


def build_parser() -> Parser:
    return command_parser(__name__, description=__doc__.split("\n\n")[0])


def main(argv: list[str]) -> int:
    build_parser().parse_args(argv)
    console = new_console()
    results = checks()
    for c in results:
        console.print(Text.assemble((f"{c.status:<5} ", STYLE[c.status]), (f"{c.what}: ", "bold"), c.detail))
    failed = [c for c in results if c.status == "FAIL"]
    if failed:
        console.print(Text(f"a run cannot start: fix the {len(failed)} FAIL line(s) above", style="bold red"))
        return 1
    gpu = any(c.what.startswith("cuda:") for c in results)
    console.print(Text(f"ready: runs can start on {'the GPU' if gpu else 'the CPU (no GPU here)'}", style="bold green"))
    return 0

"""Where a benchmark ran, and how its results land in bench/RESULTS.md."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


MATMUL_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")  # what bf16 matmuls on a CPU run on


def cpu_name() -> str:
    """The CPU's name, with its family and model: a VM may name it only "AMD EPYC", and two
    generations under that name have given ratios 1.4 times apart (bench/RESULTS.md, 2026-11-26)."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]  # the first processor's block
        info = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    except OSError:
        return "unknown CPU"
    info = {k.strip(): v.strip() for k, v in info.items()}
    flags = [f for f in MATMUL_FLAGS if f in info.get("flags", "").split()]
    family = f"family {info['cpu family']} model {info['model']}" if "cpu family" in info and "model" in info else ""
    detail = ", ".join(filter(None, [family, " ".join(flags)]))
    return info.get("model name", "unknown CPU") + (f" ({detail})" if detail else "")


def describe() -> str:
    cpu = cpu_name()
    gpu = ""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        gpu = "; GPU " + out.stdout.strip().replace("\n", " | ") if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, Python {platform.python_version()}{gpu}"


def record(title: str, lines: list[str], path: Path = RESULTS) -> None:
    """Append a dated section to bench/RESULTS.md (or `path`) and print it."""
    body = "\n".join(lines)
    section = f"\n## {title} ({time.strftime('%Y-%m-%d')})\n\nMachine: {describe()}\n\n{body}\n"
    print(section)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(section)

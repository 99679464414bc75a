"""Where a benchmark ran, and how its results land in bench/RESULTS.md."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def describe() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
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

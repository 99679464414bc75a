"""The engine process's costs, measured side by side in one run:

* overhead: the same training through the engine subprocess against in-process (target ≤ 1%);
* startup: from the `lmcockpit --run` command to its first training step, warm token cache.

    python bench/engine.py [--pairs 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cockpit import TRAIN, cli_run, compare_training
from machine import record

IN_PROCESS = """
import sys
from lmcockpit.core.config import load_config
from lmcockpit.core.run.folder import create_run_dir
from lmcockpit.core.train.trainer import run_in_process
cfg, _ = load_config("cpu", sys.argv[2:])
run_in_process(cfg, create_run_dir(cfg, "bench", sys.argv[1]), log=lambda line: None)
"""


def overhead(pairs: int) -> list[str]:
    return compare_training("training through the engine process vs in-process",
                            ("in-process `Trainer`", lambda out: [sys.executable, "-c", IN_PROCESS, str(out), *TRAIN]),
                            ("engine subprocess under `lmcockpit --run`, piped", cli_run), pairs, 0.01)


def to_first_step(tmp: Path, i: int) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cli_run(tmp / f"start{i}") + ["--set", "training.max_steps=3"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if line.startswith("step 1/"):
            break
    elapsed = time.perf_counter() - t0
    proc.communicate()
    return elapsed


def startup(tmp: Path, runs: int) -> list[str]:
    times = [to_first_step(tmp, i) for i in range(runs)]
    return ["| startup, warm token cache, compile off | median | min–max |", "| --- | --- | --- |",
            f"| `lmcockpit --run` to its first training step | {statistics.median(times):.2f} s | "
            f"{min(times):.2f}–{max(times):.2f} s |"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="engine-bench-"))
    record("Engine process: overhead against in-process, and startup",
           overhead(args.pairs) + [""] + startup(tmp, 5))

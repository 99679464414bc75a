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
from cockpit import TRAIN, median_tokens_per_s  # noqa: E402
from machine import record  # noqa: E402

IN_PROCESS = """
import sys
from lmcockpit.core.config import load_config
from lmcockpit.core.runfolder import create_run_dir
from lmcockpit.core.trainer import run_in_process
cfg, _ = load_config("cpu", sys.argv[2:])
run_in_process(cfg, create_run_dir(cfg, "bench", sys.argv[1]), log=lambda line: None)
"""


def cli_flags() -> list[str]:
    return [a for s in TRAIN for a in ("--set", s)]


def overhead(tmp: Path, pairs: int) -> list[str]:
    ratios, engine, inproc = [], [], []
    for i in range(pairs):
        a, b = tmp / f"engine{i}", tmp / f"inproc{i}"
        subprocess.run([sys.executable, "-m", "lmcockpit.tui.cli", "--run", "cpu", *cli_flags(), "--out", str(a)],
                       check=True, capture_output=True)
        subprocess.run([sys.executable, "-c", IN_PROCESS, str(b), *TRAIN], check=True, capture_output=True)
        engine.append(median_tokens_per_s(a))
        inproc.append(median_tokens_per_s(b))
        ratios.append(engine[-1] / inproc[-1])
    r = statistics.median(ratios)
    return [f"| training through the engine process vs in-process ({pairs} pairs, alternating) | tokens/s (median) | |",
            "| --- | --- | --- |",
            f"| in-process `Trainer` | {statistics.median(inproc):,.0f} | |",
            f"| engine subprocess under `lmcockpit --run`, piped | {statistics.median(engine):,.0f} | |",
            f"| ratio engine/in-process, median of pairs | {r:.3f} | cost {100 * (1 - r):.1f}% "
            f"({'within' if r >= 0.99 else 'OVER'} the 1% target); pairs: {', '.join(f'{x:.3f}' for x in ratios)} |"]


def to_first_step(tmp: Path, i: int) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "lmcockpit.tui.cli", "--run", "cpu", *cli_flags(),
                             "--set", "training.max_steps=3", "--out", str(tmp / f"start{i}")],
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
    subprocess.run([sys.executable, "-m", "lmcockpit.tui.cli", "--run", "cpu", *cli_flags(), "--set",
                    "training.max_steps=2", "--out", str(tmp / "warm")], check=True, capture_output=True)
    record("Engine process: overhead against in-process, and startup",
           overhead(tmp, args.pairs) + [""] + startup(tmp, 5))

"""An engine's start, spawn against the forkserver (core/process/warm_start.py), side by side in one run:
from `EngineProcess.start()` to the engine's first training step, for the first engine a front-end
starts and for the ones after it (the cockpit's next run, a test suite's next engine).

    python bench/engine_start.py [--engines 4]

Each method runs in a process of its own (a forkserver lives as long as its front-end), the two in
turn; the run is the debug preset, tiny, its token cache warm (built before either is timed).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from machine import record

TINY = ["training.max_steps=2", "eval.every=0", "eval.tasks=[]", "sample.prompts=[]", 'hardware.device="cpu"']

FRONT_END = """
import json, multiprocessing as mp, sys, time
from pathlib import Path
from lmcockpit.core import protocol as P
from lmcockpit.core.config import load_config
from lmcockpit.core.process import warm_start
from lmcockpit.core.process.runner import EngineProcess
from lmcockpit.core.run.folder import create_run_dir
method, out, n, overrides = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
if method == "spawn":  # what runner did before warm_start: the same wrapper, spawned
    warm_start.context = lambda preload: mp.get_context("spawn")
cfg, _ = load_config("debug", overrides)
times = []
for i in range(n):
    engine = EngineProcess(cfg, create_run_dir(cfg, f"{method}{i}", out / f"{method}{i}"))
    t0 = time.perf_counter()
    engine.start()
    while not isinstance(ev := engine.poll(1.0), P.StepMetrics):
        assert not engine.done, engine.failure
    times.append(time.perf_counter() - t0)
    while not engine.done:
        engine.poll(1.0)
print(json.dumps(times))
"""


def starts(method: str, out: Path, n: int) -> list[float]:
    done = subprocess.run([sys.executable, "-c", FRONT_END, method, str(out), str(n), *TINY],
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{method}: {done.stderr}")
    return [float(t) for t in done.stdout.strip().splitlines()[-1].strip("[]").split(",")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", type=int, default=4, help="engines each front-end starts, one after another")
    ap.add_argument("--rounds", type=int, default=2, help="front-ends per method, in turn")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        starts("forkserver", Path(tmp) / "warm-up", 1)  # the token cache, built once before timing
        got: dict[str, list[list[float]]] = {"spawn": [], "forkserver": []}
        for r in range(args.rounds):
            for method in got:
                got[method].append(starts(method, Path(tmp) / f"{method}-{r}", args.engines))
    first = {m: statistics.median(t[0] for t in runs) for m, runs in got.items()}
    later = {m: statistics.median(x for t in runs for x in t[1:]) for m, runs in got.items()}
    lines = ["| from `start()` to the first step | spawn | forkserver | ratio |", "| --- | ---: | ---: | ---: |",
             f"| a front-end's first engine | {first['spawn']:.2f} s | {first['forkserver']:.2f} s | "
             f"{first['spawn'] / first['forkserver']:.2f}x |",
             f"| each engine after it | {later['spawn']:.2f} s | {later['forkserver']:.2f} s | "
             f"{later['spawn'] / later['forkserver']:.1f}x |"]
    record("engine start: spawn vs forkserver", lines)


if __name__ == "__main__":
    main()

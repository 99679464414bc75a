"""What task scoring costs a run, and what it says: the cpu preset trained end to end, once.

    python bench/task_cost.py [--cold] [--record] [-- --set KEY=VALUE ...]

Runs `lmcockpit --run cpu` (with `--cold`, in a fresh XDG_CACHE_HOME and inductor cache, as a new
user's first run) and reads its train.log: each scoring's `tasks: step N scored in X s` line
against the whole process's wall time, measured in the same run so that both slow down alike on a
busy machine. Prints the ratio (the issue's bound: 5%) and python-functions' accuracy at each
scoring (chance 0.25); `--record` appends them to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import record  # bench/'s own helper: a script's folder is on its path


SCORED = re.compile(r"tasks: step (\d+) scored in ([\d.]+) s: (.*)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cold", action="store_true", help="fresh token and compile caches")
    p.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    p.add_argument("sets", nargs="*", help="--set KEY=VALUE pairs passed on (after --)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="task-cost-"))
    env = dict(os.environ)
    if args.cold:
        env |= {"XDG_CACHE_HOME": str(work / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}
    run = work / "run"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "lmcockpit.tui.cli", "--run", "cpu", "--out", str(run), *args.sets],
                          env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
        return 1
    scorings = [(int(m[1]), float(m[2]), m[3]) for m in map(SCORED.search, (run / "train.log").read_text().splitlines())
                if m]
    spent = sum(seconds for _, seconds, _ in scorings)
    lines = [f"`lmcockpit --run cpu {' '.join(args.sets)}`{' from cold caches' if args.cold else ''}, torch "
             f"{__import__('torch').__version__}; wall time of the whole process, task time from its own train.log.", "",
             "| step | scoring time | scores |", "| ---: | ---: | --- |"]
    lines += [f"| {step} | {seconds:.1f} s | {scores} |" for step, seconds, scores in scorings]
    lines += ["", f"Task scoring: **{spent:.1f} s of {wall:.1f} s ({100 * spent / wall:.1f}%)** of the run's wall time."]
    if args.record:
        record("task scoring's cost on the cpu preset: `bench/task_cost.py`", lines)
    else:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

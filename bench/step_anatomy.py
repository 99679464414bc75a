"""What measuring a step's anatomy costs it (#53: at most 1 % of the step's time), side by side in one run:

* the clock's own cost per step: `StepClock` started, marked at every boundary a step of the
  preset has (data and forward+backward per micro-batch, sync, optimizer) and read, many times over
  (on a GPU, CUDA events recorded and read after a synchronisation, as the trainer does);
* the preset's step time: a short run of it through `lmcockpit --run` (warm token cache), the
  median of its step rows' `dt` after the first two, and the parts those rows hold;
* their ratio.

    python bench/step_anatomy.py [--preset cpu] [--steps 20] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from machine import record

from lmcockpit.core.config import load_config
from lmcockpit.core.run.anatomy import LABELS, pct
from lmcockpit.core.train.step_clock import StepClock


def clock_cost(device: torch.device, accum: int, rounds: int = 20_000) -> float:
    """Seconds per step that the clock adds, measured over `rounds` steps of nothing else."""
    clock = StepClock(device)
    t0 = time.perf_counter()
    for _ in range(rounds):
        clock.start()
        for _ in range(accum):
            clock.mark("data")
            clock.mark("compute")
        clock.mark("sync")
        clock.mark("optimizer")
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the trainer's own, before it reads: not the clock's cost
        clock.read()
    return (time.perf_counter() - t0) / rounds


def step_rows(preset: str, steps: int) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix="bench-anatomy-")) / "run"
    cmd = [sys.executable, "-m", "lmcockpit.tui.cli", "--run", preset, "--set", f"training.max_steps={steps}",
           "--set", "eval.every=0", "--set", "sample.prompts=[]", "--set", "checkpoint.every=0",
           "--set", "eval.tasks=[]", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-record", action="store_true", help="print only, do not append to bench/RESULTS.md")
    args = ap.parse_args()
    cfg, _ = load_config(args.preset)
    device = torch.device("cuda" if torch.cuda.is_available() and cfg.hardware.device != "cpu" else "cpu")
    rows = step_rows(args.preset, args.steps)[2:]
    step = statistics.median(r["dt"] for r in rows)
    cost = clock_cost(device, cfg.training.grad_accum_steps)
    parts = {name: statistics.median(r["parts"][name] for r in rows) for name in rows[0]["parts"]}
    covered = statistics.median(sum(r["parts"].values()) / r["dt"] for r in rows)
    lines = [
        f"Preset `{args.preset}` as shipped on {device.type} (grad_accum_steps {cfg.training.grad_accum_steps}), "
        f"{args.steps} steps through `lmcockpit --run`; medians of the steps after the first two.",
        "",
        "| what | value |",
        "| --- | ---: |",
        f"| the step's time | {step * 1e3:.1f} ms |",
        f"| the clock's cost per step ({device.type}) | {cost * 1e6:.1f} µs |",
        f"| cost / step time | {cost / step:.4%} |",
        f"| the parts' sum / the step's time | {covered:.4f} |",
        *(f"| {LABELS.get(n, n)} | {v * 1e3:.2f} ms ({pct(v / step)}) |" for n, v in parts.items()),
    ]
    if args.no_record:
        print("\n".join(lines))
    else:
        record("Step anatomy: what the clock costs a step (#53)", lines)


if __name__ == "__main__":
    main()

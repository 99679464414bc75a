"""What logging.layer_stats_every costs a step (#53), side by side in one run:

One trainer of the preset (in this process, warm token cache), its steps in blocks of `--block`
steps, the blocks taking turns at layer_stats_every 0, 10 and 1 (the first block, which compiles,
left out): a machine's drift and its other load fall on every setting alike. For each setting, the
mean step time over its blocks, and its quietest block's (other work only adds time), each against
0's; the part `layer_stats` that the step rows hold (what a record costs the step it is taken on)
over the median step without one; and, where other work loads the machine, the fastest of 20
records taken alone over the fastest of 20 steps taken in turn with them.

    python bench/layer_stats.py [--preset cpu] [--rounds 4] [--block 10] [--no-record]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from machine import record

from lmcockpit.core import protocol as P
from lmcockpit.core.config import load_config
from lmcockpit.core.run.folder import create_run_dir
from lmcockpit.core.train.trainer import Trainer

SETTINGS = (0, 10, 1)


def steps_by_setting(preset: str, rounds: int, block: int) -> tuple[dict[int, list[P.StepMetrics]], str,
                                                                      tuple[float, float]]:
    """The step rows each setting's blocks took, the run's precision, and a record's least time alone."""
    total = block * (1 + rounds * len(SETTINGS))
    cfg, _ = load_config(preset, [f"training.max_steps={total}", "eval.every=0", "sample.prompts=[]",
                                  "checkpoint.every=0", "eval.tasks=[]", "logging.layer_stats_every=1"])
    rows: list[P.StepMetrics] = []

    def emit(event) -> None:
        if isinstance(event, P.StepMetrics):
            rows.append(event)

    run_dir = create_run_dir(cfg, "bench", str(Path(tempfile.mkdtemp(prefix="bench-layers-")) / "run"))
    trainer = Trainer(cfg, run_dir, emit, lambda line: None, lambda block: None)

    def setting(step: int) -> int:
        return SETTINGS[((step - 1) // block - 1) % len(SETTINGS)]

    def due(step: int) -> bool:
        every = setting(step)
        return bool(every) and step % every == 0

    trainer.layer_stats.due = due  # the blocks' turns, instead of one setting for the run
    try:
        trainer.run()
        alone = record_alone(trainer)
    finally:
        trainer.close()
    out: dict[int, list[P.StepMetrics]] = {every: [] for every in SETTINGS}
    for row in rows:
        if row.step > block:
            out[setting(row.step)].append(row)
    return out, trainer.precision, alone


def record_alone(trainer: Trainer, times: int = 20) -> tuple[float, float]:
    """The fastest of `times` records taken alone on the trained model (gradients drawn at random,
    the weights restored after each), and the fastest of as many steps without one, each record
    right after a step: on a machine that others load too, the least time is the work's own, and
    the two are measured in the same minutes."""
    taker = trainer.layer_stats
    params = list(trainer.model.parameters())
    record, step = float("inf"), float("inf")
    for _ in range(times):
        taker.due = lambda step: False
        t0 = time.perf_counter()
        trainer.train_step()
        step = min(step, time.perf_counter() - t0)
        taker.due = lambda step: True
        kept = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p in params:
                p.grad = torch.randn_like(p)
            trainer.clock.start()
            t0 = time.perf_counter()
            taker.before_clip()
            for p in params:  # an update, as the optimizers make one
                p.add_(p.grad, alpha=-1e-3)
            taker.after_update()
            record = min(record, time.perf_counter() - t0)
            taker.values = None
            for p, k in zip(params, kept):
                p.copy_(k)
                p.grad = None
    return record, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--no-record", action="store_true", help="print only, do not append to bench/RESULTS.md")
    args = ap.parse_args()
    by_setting, precision, (alone, fastest) = steps_by_setting(args.preset, args.rounds, args.block)
    mean = {every: statistics.fmean(r.dt for r in rows) for every, rows in by_setting.items()}
    # Other work only ever adds time: each setting's least loaded block is the nearest to its own cost.
    quiet = {every: min(statistics.fmean(r.dt for r in rows[i:i + args.block])
                        for i in range(0, len(rows), args.block)) for every, rows in by_setting.items()}
    plain = statistics.median(r.dt for r in by_setting[0])
    part = statistics.median(r.parts["layer_stats"] for rows in by_setting.values() for r in rows
                             if "layer_stats" in r.parts)
    lines = [
        f"Preset `{args.preset}` as shipped ({precision}), one trainer in this process, {args.rounds} rounds of "
        f"{args.block}-step blocks at each setting in turn, the first block (compile) left out.",
        "",
        "| logging.layer_stats_every | mean step | / off | quietest block's mean step | / off |",
        "| --- | ---: | ---: | ---: | ---: |",
        *(f"| {every} | {mean[every] * 1e3:.1f} ms | {mean[every] / mean[0]:.3f} | {quiet[every] * 1e3:.1f} ms | "
          f"{quiet[every] / quiet[0]:.3f} |" for every in SETTINGS),
        "",
        f"The step rows' part `layer_stats` (a record's cost on the step that takes it): median "
        f"{part * 1e3:.2f} ms, {part / plain:.2%} of the median step without one ({plain * 1e3:.1f} ms); "
        f"so every 10 steps: {part / plain / 10:.2%} of a step, every step: {part / plain:.2%}.",
        "",
        f"Load-free figures: a record taken alone on the trained model, fastest of 20: {alone * 1e3:.2f} ms; "
        f"the fastest of 20 steps without one, each just before one of those: {fastest * 1e3:.1f} ms; so every "
        f"10 steps {alone / fastest / 10:.2%} "
        f"of a step, every step {alone / fastest:.2%}. Load average while it ran: {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} cores.",
    ]
    if args.no_record:
        print("\n".join(lines))
    else:
        record("Layer stats: what logging.layer_stats_every costs a step (#53)", lines)


if __name__ == "__main__":
    main()

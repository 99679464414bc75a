"""Where a training step's time goes: torch.profiler over a few steps of a preset's model, as the
engine trains it (compiled or not, its precision, its optimizer), the top operators by self time.

    python bench/profile_step.py [--preset cpu] [--precision fp32|bf16] [--steps 3] [--set KEY=VALUE ...]
    python bench/profile_step.py --compare [--preset cpu] [--precision fp32|bf16] [--steps 3]

`--compare` profiles bench/throughput.py's three steps instead (transformers + AdamW, lmcockpit +
AdamW, lmcockpit + Muon), built as that bench builds them, and prints each one's milliseconds per
step by kind of work side by side: it explains the ratios throughput.py measures (which work the
baseline does that we do not, and what Muon adds).

Prints the table (nothing is recorded: a profile explains a measurement, it is not one).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).parent))
from throughput import build_rows

from lmcockpit.core.config import load_config
from lmcockpit.core.model.gpt import GPT, shape_from_config
from lmcockpit.core.train.group import Group
from lmcockpit.core.train.optim import build_optimizers, clip_grad_norm

MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
# the kinds of work a step's operators fall in
MATMUL, ATTENTION, EAGER_LOSS, INDUCTOR, OTHER = ("matmuls", "attention", "loss outside the compiled graph",
                                                  "compiled kernels (inductor)", "other forward and backward")
NEWTON_SCHULZ, OPTIMIZER, CLIP = "optimizer matmuls (Newton–Schulz)", "optimizer, the rest", "clip"
SCOPES = ("step", "clip", "optimizer")  # the record_function blocks of step_of
KINDS = [MATMUL, ATTENTION, EAGER_LOSS, INDUCTOR, OTHER, NEWTON_SCHULZ, OPTIMIZER, CLIP]  # the table's order


def kind_of(name: str, scope: str) -> str:
    if scope == "optimizer":
        return NEWTON_SCHULZ if name in MATMULS else OPTIMIZER
    if scope == "clip":
        return CLIP
    if name in MATMULS:
        return MATMUL
    if "scaled_dot_product" in name:
        return ATTENTION
    if "log_softmax" in name or "nll_loss" in name or "cross_entropy" in name:
        return EAGER_LOSS
    return INDUCTOR if "CompiledFxGraph" in name else OTHER


def scope_of(event) -> str | None:
    """The record_function scope ("step", "optimizer" or "clip") an operator ran under, innermost first."""
    while event is not None:
        if event.name in SCOPES:
            return event.name
        event = event.cpu_parent
    return None


def breakdown(prof, steps: int) -> dict[str, float]:
    """Self CPU milliseconds per step by kind of work."""
    ms = defaultdict(float)
    for ev in prof.events():
        scope = scope_of(ev)
        if scope is None or ev.name in SCOPES:
            continue
        ms[kind_of(ev.name, scope)] += ev.self_cpu_time_total / 1e3 / steps
    return ms


def profiled(step, steps: int):
    for _ in range(2):  # warm-up: compiled graphs, optimizer state
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return prof


def step_of(loss_of, model, opts, amp, x, y, clip: float):
    def step():
        with record_function("step"):
            with amp:
                loss = loss_of(x, y)
            loss.backward()
        with record_function("clip"):
            clip_grad_norm(model.parameters(), clip, Group())
        with record_function("optimizer"):
            for opt in opts:
                opt.step()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
    return step


def compare(cfg, precision: str, steps: int) -> None:
    t = cfg.training
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, cfg.tokenizer.vocab_size, (t.micro_batch_size, t.seq_len), generator=gen) for _ in range(2))
    rows = build_rows(cfg, torch.device("cpu"), precision, t.compile)
    columns = [breakdown(profiled(step_of(r["loss"], r["model"], r["opts"], amp, x, y, t.grad_clip), steps), steps)
               for r in rows]
    names = [r["name"] for r in rows]
    print(f"ms per step by kind of work, {precision}, compile {'on' if t.compile else 'off'}, "
          f"{torch.get_num_threads()} threads, mean of {steps} profiled steps (self CPU time)\n")
    width = max(map(len, KINDS))
    print(f"{'':{width}}  " + "  ".join(f"{n:>38}" for n in names))
    for kind in KINDS:
        print(f"{kind:{width}}  " + "  ".join(f"{c.get(kind, 0.0):38.1f}" for c in columns))
    totals = [sum(c.values()) for c in columns]
    print(f"{'total':{width}}  " + "  ".join(f"{v:38.1f}" for v in totals))
    print(f"{'baseline total / this total':{width}}  " + "  ".join(f"{totals[0] / v:37.2f}x" for v in totals))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--compare", action="store_true", help="throughput.py's three steps, by kind of work")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()

    cfg, _ = load_config(args.preset, args.set)
    torch.use_deterministic_algorithms(True, warn_only=True)  # as the engine trains on a CPU
    if args.compare:
        compare(cfg, args.precision, args.steps)
        return
    t = cfg.training
    torch.manual_seed(0)
    model = GPT(shape_from_config(cfg))
    opts = build_optimizers(model, cfg.optimizer, torch.device("cpu"), args.precision)
    run = torch.compile(model, dynamic=False) if t.compile else model
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext()
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, cfg.tokenizer.vocab_size, (t.micro_batch_size, t.seq_len), generator=gen) for _ in range(2))
    prof = profiled(step_of(run, model, opts, amp, x, y, t.grad_clip), args.steps)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()

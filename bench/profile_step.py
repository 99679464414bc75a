"""Where a training step's time goes: torch.profiler over a few steps of a preset's model, as the
engine trains it (compiled or not, its precision, its optimizer), the top operators by self time.

    python bench/profile_step.py [--preset cpu] [--precision fp32|bf16] [--steps 3] [--set KEY=VALUE ...]

Prints the table (nothing is recorded: a profile explains a measurement, it is not one).
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from lmcockpit.core.config import load_config
from lmcockpit.core.model.gpt import GPT, shape_from_config
from lmcockpit.core.train.optim import build_optimizers, clip_grad_norm
from lmcockpit.core.train.group import Group


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()

    cfg, _ = load_config(args.preset, args.set)
    t = cfg.training
    torch.use_deterministic_algorithms(True, warn_only=True)  # as the engine trains on a CPU
    torch.manual_seed(0)
    model = GPT(shape_from_config(cfg))
    opts = build_optimizers(model, cfg.optimizer, torch.device("cpu"), args.precision)
    run = torch.compile(model, dynamic=False) if t.compile else model
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext()
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, cfg.tokenizer.vocab_size, (t.micro_batch_size, t.seq_len), generator=gen) for _ in range(2))

    def step():
        with record_function("forward+backward"):
            with amp:
                loss = run(x, y)
            loss.backward()
        with record_function("clip"):
            clip_grad_norm(model.parameters(), t.grad_clip, Group())
        for opt in opts:
            with record_function(f"optimizer {type(opt).__name__}"):
                opt.step()
        for opt in opts:
            opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()

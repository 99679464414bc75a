"""CPU precision: the cpu preset's training step in fp32 and in bf16 autocast, eager and compiled,
timed side by side in one process, beside what `precision = "auto"`'s probe (core/hardware/
cpu_precision.py) measures on the same machine: whether a one-block probe of a second or two
predicts the whole compiled step's ratio. Muon iterates in the step's precision, as in a run.

    python bench/cpu_precision.py [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from machine import record

from lmcockpit.core.config import load_config
from lmcockpit.core.hardware import cpu_precision
from lmcockpit.core.model.gpt import GPT, GPTShape
from lmcockpit.core.train.optim import build_optimizers


def step_times(cfg, precision: str, compiled: bool, steps: int) -> tuple[float, float]:
    torch.manual_seed(0)
    m = cfg.model
    model = GPT(GPTShape(cfg.tokenizer.vocab_size, m.n_layer, m.d_model, m.n_head, m.n_kv_head, cfg.head_dim,
                         cfg.mlp_hidden, cfg.max_seq_len))
    opts = build_optimizers(model, cfg.optimizer, torch.device("cpu"), precision)
    fwd = torch.compile(model) if compiled else model
    B, T = cfg.training.micro_batch_size, cfg.training.seq_len
    x = torch.randint(0, cfg.tokenizer.vocab_size, (B, T))
    times = []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = fwd(x, x)
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[2:])


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    cfg, _ = load_config("cpu")
    flags = open("/proc/cpuinfo").read()
    native = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    probe = cpu_precision.measure(cfg)
    rows = {}
    for compiled in (False, True):
        for precision in ("fp32", "bf16"):
            rows[(precision, compiled)] = step_times(cfg, precision, compiled, args.steps)
    lines = [f"cpu preset shape ({cfg.training.micro_batch_size}×{cfg.training.seq_len} tokens/step), Muon + AdamW, "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads; CPU bf16 flags: {', '.join(native) or 'none'}",
             "", "| precision | compile | first step | median step | vs fp32 same compile |", "| --- | --- | --- | --- | --- |"]
    for (precision, compiled), (first, med) in rows.items():
        ref = rows[("fp32", compiled)][1]
        lines.append(f"| {precision} | {'on' if compiled else 'off'} | {first:.1f} s | {med:.3f} s | {ref / med:.2f}× |")
    lines += ["", f"The probe, the same run ({probe.probe}): fp32 {probe.fp32_ms:.0f} ms, bf16 {probe.bf16_ms:.0f} ms, "
              f"{probe.speedup:.2f}×: precision \"auto\" would train in **{probe.precision}** (bf16 from "
              f"{cpu_precision.MARGIN:g}×)."]
    record("CPU precision: fp32 against bf16 autocast", lines)

"""MFU of the GPU presets' model shapes: tokens/s, model FLOPs utilisation, peak memory, and the
share of each step spent in the optimizers (Muon's Newton-Schulz included).

Each preset's model, batch, precision and compile setting as shipped, trained on random tokens
(the data path is not what is measured) with lmcockpit's own model, optimizers and autocast. A
step is timed whole and its optimizer part on its own, both between CUDA synchronisations, so the
optimizer share is a share of the same steps. FLOPs per token are 6·N + 12·L·H·Q·T with N the
unique parameters (the tied embedding counted once, for the head's matmul), as the issue asks; MFU
is against the detected GPU's dense bf16 peak (core/hardware/device.py's table).

    python bench/mfu.py [--presets h100 4090 ...] [--steps 30] [--warmup 10] [--device cuda]

Appends a table, with the date and the machine, to bench/RESULTS.md. On a CPU (no peak in the
table) it still runs, for checking the script, and records nothing unless --record is given.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

from lmcockpit.core.hardware import gpu_env

gpu_env.configure_allocator()  # as the engine does, before torch initialises CUDA

import torch  # noqa: E402 - below configure_allocator(), which must run before torch loads

sys.path.insert(0, str(Path(__file__).parent))
from machine import record  # noqa: E402 - below configure_allocator(), which must run before torch loads

from lmcockpit.core.config import load_config  # noqa: E402 - below configure_allocator(), which must run before torch loads
from lmcockpit.core.hardware.device import autocast_dtype, peak_flops, resolve_device, resolve_precision  # noqa: E402 - below configure_allocator(), which must run before torch loads
from lmcockpit.core.model.gpt import GPT, shape_from_config  # noqa: E402 - below configure_allocator(), which must run before torch loads
from lmcockpit.core.train.group import Group  # noqa: E402 - below configure_allocator(), which must run before torch loads
from lmcockpit.core.train.optim import build_optimizers, clip_grad_norm  # noqa: E402 - below configure_allocator(), which must run before torch loads

GPU_PRESETS = ("3060", "4070ti", "3090", "4090", "a100-40gb", "a100-80gb", "h100")


def measure(preset: str, device: torch.device, steps: int, warmup: int, overrides: list[str]) -> dict:
    cfg, _ = load_config(preset, overrides)
    t = cfg.training
    precision = resolve_precision(t.precision, device)
    amp = autocast_dtype(precision)
    torch.manual_seed(0)
    model = GPT(shape_from_config(cfg)).to(device)
    model.activation_checkpointing = t.activation_checkpointing
    opts = build_optimizers(model, cfg.optimizer, device, precision)
    run = torch.compile(model, mode=t.compile_mode, dynamic=False) if t.compile else model
    V = model.shape.vocab_size
    gen = torch.Generator().manual_seed(1)
    batch = [tuple(a.to(device) for a in torch.randint(0, V, (2, t.micro_batch_size, t.seq_len), generator=gen))
             for _ in range(t.grad_accum_steps)]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step() -> tuple[float, float]:
        sync()
        t0 = time.perf_counter()
        if device.type == "cuda" and t.compile:
            torch.compiler.cudagraph_mark_step_begin()
        for x, y in batch:
            with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                loss = run(x, y) / t.grad_accum_steps
            loss.backward()
        clip_grad_norm(model.parameters(), t.grad_clip, Group())  # the trainer's own, float64 sums
        sync()
        t1 = time.perf_counter()
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        sync()
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1

    compile_start = time.perf_counter()
    for _ in range(warmup):
        step()
    warm = time.perf_counter() - compile_start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed = [step() for _ in range(steps)]
    dt = statistics.median(s for s, _ in timed)
    opt_share = statistics.median(o / s for s, o in timed)
    tokens = t.micro_batch_size * t.seq_len * t.grad_accum_steps
    tps = tokens / dt
    peak = peak_flops(device)
    flops = model.flops_per_token(t.seq_len)
    result = {
        "preset": preset, "params": model.num_params(), "tokens": tokens, "precision": precision,
        "compile": t.compile_mode if t.compile else "off", "tps": tps, "dt": dt,
        "mfu": flops * tps / peak if peak else None, "opt_share": opt_share, "warm": warm,
        "peak_mem": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    # The next preset needs the card to itself: the compiled graphs hold this model until reset.
    run = model = opts = batch = None  # not del: step() holds them in its closure
    torch.compiler.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=list(GPU_PRESETS))
    ap.add_argument("--steps", type=int, default=30, help="timed steps per preset")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation, allocator growth)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key on every preset (to shrink them for a check on a CPU)")
    ap.add_argument("--record", action="store_true", help="record in bench/RESULTS.md even without a known peak")
    args = ap.parse_args()
    device = resolve_device(args.device)
    rows = []
    for preset in args.presets:
        r = measure(preset, device, args.steps, args.warmup, args.overrides)
        rows.append(r)
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "–"
        print(f"{preset}: {r['tps']:,.0f} tokens/s, MFU {mfu}, optimizer {r['opt_share']:.1%} of the step", flush=True)
    if device.type != "cuda" and not args.record:
        print("no GPU: nothing recorded (--record to record anyway)")
        return 0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    lines = [f"{name}, torch {torch.__version__}; each preset as shipped{' with ' + ', '.join(args.overrides) if args.overrides else ''}, "
             f"random tokens, median of {args.steps} steps after {args.warmup} warm-up steps. FLOPs per token "
             "6·N + 12·L·H·Q·T, N the unique parameters (tied embedding counted once); MFU against the "
             "card's dense bf16 peak.", "",
             "| preset | params | tokens/step | precision | compile | tokens/s | step | MFU | optimizer share | "
             "peak allocated | warm-up (compile) |",
             "| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        mem = f"{r['peak_mem'] / 2**30:.1f} GiB" if r["peak_mem"] is not None else "–"
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "–"
        lines.append(f"| {r['preset']} | {r['params'] / 1e6:.0f}M | {r['tokens']:,} | {r['precision']} | {r['compile']} | "
                     f"{r['tps']:,.0f} | {r['dt'] * 1000:.0f} ms | {mfu} | {r['opt_share']:.1%} | {mem} | {r['warm']:.0f} s |")
    record("mfu: the GPU presets' shapes", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Muon's Newton–Schulz: the fused multiply-adds lmcockpit uses against the textbook iteration.

`muon.newton_schulz` computes b·A + c·A² and a·X + B·X as one baddbmm each; the textbook form
(as in Keller Jordan's Muon and modded-nanogpt) builds each product and scaled term as a tensor of
its own before adding. Both run side by side in one process on the stacks Muon orthogonalises
for a preset's shape (one per matrix shape, every layer's matrices together), in the dtype Muon
uses there (bf16 on a GPU, fp16 on one older than Ampere, fp32 on a CPU), alternating repeats and
keeping each one's best.
Prints the times, the ratio and the largest difference between the two results, and appends
them with the date and the machine to bench/RESULTS.md.

    python bench/muon.py [--preset cpu] [--repeats 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from machine import record

from lmcockpit.core.config import load_config
from lmcockpit.core.model.muon import NS_COEFFS, device_iteration_dtype, newton_schulz, normalised


def textbook(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The same iteration with every term a tensor of its own (the form before the fused one),
    from the same normalised start."""
    a, b, c = NS_COEFFS
    X = normalised(G, device_iteration_dtype(G.device))
    transposed = X.size(-2) > X.size(-1)
    if transposed:
        X = X.mT
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.mT if transposed else X


def best_time(fn, G: torch.Tensor) -> float:
    if G.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(G)
    if G.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu", help="whose matrix shapes to orthogonalise (default cpu)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    cfg, _ = load_config(args.preset)
    m, d = cfg.model, cfg.model.d_model
    q, kv, f = m.n_head * cfg.head_dim, m.n_kv_head * cfg.head_dim, cfg.mlp_hidden
    groups = Counter([(q, d), (kv, d), (kv, d), (d, q), (f, d), (f, d), (d, f)])  # what muon.Muon stacks
    torch.manual_seed(0)
    rows, total = [], {"fused": 0.0, "textbook": 0.0}
    for (r, c), per_layer in groups.items():
        G = torch.randn(per_layer * m.n_layer, r, c, device=args.device)
        fused, plain = newton_schulz(G), textbook(G)  # also the warm-up
        diff = float((fused.float() - plain.float()).norm() / plain.float().norm())
        best = {"fused": float("inf"), "textbook": float("inf")}
        for _ in range(args.repeats):
            best["fused"] = min(best["fused"], best_time(newton_schulz, G))
            best["textbook"] = min(best["textbook"], best_time(textbook, G))
        for k in total:
            total[k] += best[k]
        rows.append(f"| {G.shape[0]} × {r}×{c} | {best['fused'] * 1e3:.1f} | {best['textbook'] * 1e3:.1f} | "
                    f"{best['textbook'] / best['fused']:.2f}x | {diff:.1e} |")

    iterate = device_iteration_dtype(torch.device(args.device))
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(iterate, "fp32")
    setup = (f"Preset `{args.preset}`: every stack Muon orthogonalises in one step, 5 iterations in {dtype} on "
             f"{args.device}, torch {torch.__version__} with {torch.get_num_threads()} threads; best of "
             f"{args.repeats}, alternating. Difference: relative Frobenius norm between the two results.")
    lines = [setup, "", "| stack | fused ms | textbook ms | speed-up | difference |", "| --- | ---: | ---: | ---: | ---: |",
             *rows, f"| all | {total['fused'] * 1e3:.1f} | {total['textbook'] * 1e3:.1f} | "
                    f"{total['textbook'] / total['fused']:.2f}x | |"]
    record("muon: fused Newton–Schulz against the textbook iteration", lines)


if __name__ == "__main__":
    main()

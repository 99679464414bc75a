"""Decode speed: tokens/s with the KV cache against recomputing the context for every token.

Both decoders run side by side in one process, on the cpu preset's model shape (random weights:
speed does not depend on them), greedy so that both must produce the same tokens, alternating
repeats and keeping each one's best. Prints a table and the speed-up, and appends them with the
date and the machine to bench/RESULTS.md.

    python bench/decode.py [--new-tokens 200] [--rows 1 8] [--repeats 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from machine import record

from lmcockpit.core.config import load_config
from lmcockpit.core.model.gpt import GPT, shape_from_config
from lmcockpit.core.model.sampling import generate


def timed(model: GPT, prompt: list[int], new_tokens: int, rows: int, use_cache: bool) -> tuple[float, list]:
    t0 = time.perf_counter()
    # Each step reads its tokens back to the host, so the clock stops after the device's work.
    out = list(generate(model, prompt, new_tokens, greedy=True, num_samples=rows, use_cache=use_cache))
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu", help="whose model shape to time (default cpu)")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    cfg, _ = load_config(args.preset)
    shape = shape_from_config(cfg)
    if args.prompt_tokens + args.new_tokens > shape.max_seq_len:
        ap.error(f"prompt + new tokens must fit the context ({shape.max_seq_len}): the cache would be rebuilt")
    torch.manual_seed(0)
    model = GPT(shape).to(args.device).eval()
    prompt = torch.randint(0, shape.vocab_size, (args.prompt_tokens,)).tolist()
    timed(model, prompt, 8, 1, True)  # warm-up: allocator, kernels
    timed(model, prompt, 8, 1, False)

    results = []
    for rows in args.rows:
        best = {True: float("inf"), False: float("inf")}
        outputs = {}
        for _ in range(args.repeats):
            for use_cache in (True, False):
                dt, outputs[use_cache] = timed(model, prompt, args.new_tokens, rows, use_cache)
                best[use_cache] = min(best[use_cache], dt)
        assert outputs[True] == outputs[False], "the cached decoder's greedy tokens differ from recomputation"
        tokens = rows * args.new_tokens
        results.append((rows, tokens / best[True], tokens / best[False]))

    setup = (f"Preset `{args.preset}` shape ({shape.n_layer} layers, d_model {shape.d_model}, "
             f"{shape.n_head}/{shape.n_kv_head} heads, vocab {shape.vocab_size}, "
             f"{model.num_params() / 1e6:.1f}M parameters), fp32 on {args.device}, torch {torch.__version__} "
             f"with {torch.get_num_threads()} threads; greedy, prompt {args.prompt_tokens} tokens, "
             f"{args.new_tokens} new tokens per row, best of {args.repeats}.")
    lines = [setup, "", "| rows | KV cache tok/s | recompute tok/s | speed-up |", "| ---: | ---: | ---: | ---: |"]
    lines += [f"| {rows} | {cached:,.0f} | {recomputed:,.0f} | {cached / recomputed:.2f}x |"
              for rows, cached, recomputed in results]
    record("decode: KV cache against recomputation", lines)


if __name__ == "__main__":
    main()

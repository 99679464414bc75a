"""Training throughput: lmcockpit's model against transformers' Qwen3ForCausalLM of the same shape.

Three rows measured side by side in one process, on the same batches: transformers'
`Qwen3ForCausalLM` (built from the config.json `lmcockpit export` would write, sdpa attention)
with AdamW, lmcockpit's GPT with AdamW, and lmcockpit's GPT with its own Muon + AdamW. Same batch,
same precision, same compile setting, the same loss (cross-entropy of float32 logits over every
position), no gradient clipping on any row. The rows run in turn, round after round, so a noisy
neighbour on a shared machine hurts all of them alike. Each row reports its best round and the
median of its rounds' ratios to the transformers row of the same round: on a shared 2-core VM the
best rounds of different rows can come from different moments, while a round's rows share one.
Prints a table with ratios against the transformers row and appends it, with the date and the
machine, to bench/RESULTS.md.

    python bench/throughput.py [--preset cpu] [--micro-batch N] [--steps 4] [--rounds 3] [--device cpu]
                               [--precision fp32,bf16] [--compile] [--results PATH]

Each precision listed gets its three rows, every model in the same precision (like with like), and
its ratios against the transformers row of that precision; Muon iterates in the row's precision on
a CPU, as a run does.

On a GPU, issue 9's case is the h100 preset's shape: three models and their optimizer state share
the card, so give a smaller micro-batch than the preset's 24, e.g.
`--device cuda --precision bf16 --compile --preset h100 --micro-batch 8 --steps 10 --warmup 3`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from convergence import baseline_model
from machine import RESULTS, record

from lmcockpit.core.config import load_config
from lmcockpit.core.model.gpt import GPT, shape_from_config
from lmcockpit.core.train.optim import build_optimizers


def hf_model(cfg, ours: GPT):
    """transformers' Qwen3ForCausalLM of the same shape (convergence.baseline_model), with our weights."""
    model = baseline_model(cfg)
    missing, unexpected = model.load_state_dict({"model." + k: v for k, v in ours.state_dict().items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


def build_rows(cfg, device: torch.device, precision: str, compile: bool) -> list[dict]:
    """The three training steps compared, from the same initial weights: each a name, its model,
    its loss of (inputs, targets) (through torch.compile when `compile`) and its optimizers."""
    shape = shape_from_config(cfg)
    torch.manual_seed(0)
    ours_adamw = GPT(shape)
    ours_muon = GPT(shape)
    ours_muon.load_state_dict(ours_adamw.state_dict())
    theirs = hf_model(cfg, ours_adamw)
    V = shape.vocab_size

    def adamw(model):
        return [torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr, betas=(cfg.optimizer.beta1, cfg.optimizer.beta2),
                                  eps=cfg.optimizer.eps, weight_decay=0.0, fused=device.type == "cuda")]

    def ours_loss(model):
        return lambda x, y: model(x, y)

    def hf_loss(model):
        # use_cache=False: a training forward builds no key/value cache, as ours builds none
        return lambda x, y: F.cross_entropy(model(input_ids=x, use_cache=False).logits.float().view(-1, V), y.view(-1))

    out = []
    for name, model, loss_of, opts_of in [
        ("transformers Qwen3ForCausalLM, AdamW", theirs, hf_loss, adamw),
        ("lmcockpit GPT, AdamW", ours_adamw, ours_loss, adamw),
        ("lmcockpit GPT, Muon + AdamW", ours_muon, ours_loss,
         lambda m: build_optimizers(m, cfg.optimizer, device, precision)),
    ]:
        model.to(device).train()
        opts = opts_of(model)
        run = torch.compile(model) if compile else model
        out.append({"name": name, "model": model, "loss": loss_of(run), "opts": opts, "best": 0.0, "ratios": []})
    return out


def speedups(seconds: list[float]) -> list[float]:
    """Each row's tokens/s over the first (transformers) row's, from one round's times for equal work."""
    return [seconds[0] / s for s in seconds]


def measure(cfg, args, device: torch.device, precision: str, B: int, T: int) -> list[dict]:
    """The three rows in `precision`, each with its best tokens/s ("best") and, round by round, its
    tokens/s over the transformers row's in the same round ("ratios")."""
    rows = build_rows(cfg, device, precision, args.compile)
    V = shape_from_config(cfg).vocab_size

    amp = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext())
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.steps):
        seq = torch.randint(0, V, (B, T + 1), generator=gen)
        batches.append((seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)))

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def steps(row, n: int) -> float:
        sync()
        t0 = time.perf_counter()
        for i in range(n):
            x, y = batches[i % len(batches)]
            with amp:
                loss = row["loss"](x, y)
            loss.backward()
            for opt in row["opts"]:
                opt.step()
            for opt in row["opts"]:
                opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0

    for row in rows:  # warm-up: allocator, optimizer state, compiled graphs
        steps(row, args.warmup)
    for _ in range(args.rounds):
        seconds = [steps(row, args.steps) for row in rows]
        for row, dt, ratio in zip(rows, seconds, speedups(seconds)):
            row["best"] = max(row["best"], args.steps * B * T / dt)
            row["ratios"].append(ratio)

    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu", help="whose model shape and batch to time (default cpu)")
    ap.add_argument("--micro-batch", type=int, help="sequences per step instead of the preset's micro-batch")
    ap.add_argument("--steps", type=int, default=4, help="timed optimizer steps per row per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32", help="fp32, bf16, or both: fp32,bf16")
    ap.add_argument("--compile", action="store_true", help="torch.compile every model (default mode)")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the entry is appended")
    args = ap.parse_args()

    cfg, _ = load_config(args.preset)
    device = torch.device(args.device)
    precisions = args.precision.split(",")
    if not set(precisions) <= {"fp32", "bf16"}:
        ap.error(f"--precision {args.precision!r}: expected fp32, bf16 or fp32,bf16")
    shape = shape_from_config(cfg)
    B, T = args.micro_batch or cfg.training.micro_batch_size, cfg.training.seq_len
    table = [(p, measure(cfg, args, device, p, B, T)) for p in precisions]
    n_params = GPT(shape).num_params()
    V = shape.vocab_size
    threads = f" with {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    setup = (f"Preset `{args.preset}` shape ({shape.n_layer} layers, d_model {shape.d_model}, "
             f"{shape.n_head}/{shape.n_kv_head} heads, head_dim {shape.head_dim}, MLP {shape.mlp_hidden}, "
             f"vocab {V}, tied, {n_params / 1e6:.2f}M parameters), batch {B}×{T} tokens, "
             f"{' and '.join(precisions)}, compile {'on' if args.compile else 'off'}, on {args.device}{threads}; "
             f"torch {torch.__version__}, transformers {__import__('transformers').__version__} (sdpa attention). "
             f"Same loss on every row (cross-entropy of float32 logits), no clipping; best of {args.rounds} rounds "
             f"of {args.steps} steps after {args.warmup} warm-up steps, rows interleaved. The last columns: the "
             f"median of each round's ratio to the transformers row of that round (a neighbour's load slows the rows "
             f"of one round alike), and the lowest and highest of them.")
    lines = [setup, "", "| precision | training step | best tokens/s | best vs transformers | median ratio of rounds "
             "| range |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for precision, rows in table:
        # the ratio of the printed (whole) tokens/s, so that a reader dividing the columns gets it
        base = round(rows[0]["best"])
        lines += [f"| {precision} | {r['name']} | {round(r['best']):,} | {round(r['best']) / base:.2f}x "
                  f"| {statistics.median(r['ratios']):.2f}x | {min(r['ratios']):.2f}–{max(r['ratios']):.2f} |"
                  for r in rows]
    record("throughput: lmcockpit against transformers' Qwen3ForCausalLM", lines, args.results)


if __name__ == "__main__":
    main()

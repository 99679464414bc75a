"""Time to quality: lmcockpit's recipe against the transformers + AdamW loop a user would write.

Every run trains side by side in one process, a step of each in turn, on the same batches of the
preset's own token cache, and is scored on the same validation windows (the engine's evaluation):

* lmcockpit's GPT with its optimizer (`optimizer.kind = "muon"`, the preset's settings);
* lmcockpit's GPT with `optimizer.kind = "adamw"` (weight decay 0.1), at each learning rate of
  `--adamw-lrs`: what Muon adds, with the model and the rest of the recipe held;
* transformers' `Qwen3ForCausalLM` of the same shape (its own initialisation, sdpa attention),
  with AdamW at weight decay 0.1 on the 2-D parameters, at each learning rate of `--lrs`: the
  baseline, its best final validation loss taken as the target.

The same batch, precision, compile setting, gradient clipping and schedule shape (the preset's
warmup and cosine) for every run; the loss is the cross-entropy of float32 logits. A run's time is
the sum of its own steps (forward, backward, clipping, the optimizer, each timed to its end), so a
busy neighbour slows every run alike; compilation is done before the clock starts (one forward and
backward of each compiled model, no update) and shown apart. Evaluations are not timed.

Recorded in bench/RESULTS.md: each run's final validation loss, the best of each kind at equal
steps and at equal wall time, and the wall time each needs to reach the baseline's best final
validation loss — lmcockpit's against the baseline's is the headline (issue 23's target: ≤ 0.4×).

`--ablation` adds lmcockpit's recipe with modded-nanogpt's techniques, cumulative and each alone
(bench/ablation.py holds the table of them; `--techniques` picks some; `--stack A+B+...` adds a
run with those together, a candidate preset's options), and their table: final
loss, loss at equal time, time to the baseline's quality and its ratio (issue 55's target: ≤ 0.2×).
A run whose rows are drawn otherwise (data.bos_aligned) gets its own batches of the same steps.

    python bench/convergence.py [--preset cpu] [--steps N] [--lrs 1e-3,3e-3,6e-3] [--adamw-lrs ...]
                                [--eval-every 25] [--device cpu|cuda] [--results PATH]
                                [--ablation [--techniques relu2,zero-init,...]] [--stack relu2+zero-init ...]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import ablation
from machine import RESULTS, record

from lmcockpit.core.config import Config, load_config
from lmcockpit.core.data import aligned_rows, batches
from lmcockpit.core.data.prepare import prepare
from lmcockpit.core.hardware import cpu_precision
from lmcockpit.core.hardware.device import autocast_dtype, expands_kv, resolve_device, resolve_precision
from lmcockpit.core.infer.export import qwen3_config
from lmcockpit.core.model.gpt import GPT, shape_from_config
from lmcockpit.core.step_schedules import Schedules
from lmcockpit.core.train.optim import build_optimizers, lr_multiplier, set_lr

WEIGHT_DECAY = 0.1  # the AdamW runs' (the baseline's, as the transformers Trainer's docs suggest)
MILESTONES = (0.25, 0.5, 0.75, 1.0)  # equal wall time: these shares of the baseline's best run


@dataclass(eq=False)  # a run is itself: compared by identity
class Run:
    name: str
    kind: str  # "baseline", "adamw" or "muon": the best of each kind is compared; "cumulative", "alone" or "stack": ablation
    lr: str
    model: torch.nn.Module
    loss: Callable  # (x, y) -> mean loss, through the compiled module when compiling
    token_losses: Callable  # (x, y) -> per-token losses, eager, for evaluation
    opts: list
    seconds: float = 0.0  # training time so far
    compile_s: float = 0.0
    evals: list[tuple[int, float, float]] = field(default_factory=list)  # (step, seconds, val loss)
    cfg: Config | None = None  # its own: the preset's, with an ablation run's overrides

    @property
    def feed(self) -> bool:
        """Which batches it trains on: the runs drawing rows alike share them."""
        return self.cfg.data.bos_aligned

    @property
    def final(self) -> float:
        return self.evals[-1][2]

    @property
    def plan(self) -> Schedules:
        """What each step takes: its micro-batches and length (a schedule's run's own)."""
        return Schedules.of(self.cfg)

    def lr_multiplier(self, step: int) -> float:
        """The share of its peak rates it steps at: its own schedule (an ablation's may differ)."""
        return lr_multiplier(step, self.cfg.training.max_steps, self.cfg.optimizer)

    @property
    def lengths(self) -> set[int]:
        """The sequence lengths its steps take: each a graph of its own when compiled."""
        return {self.plan.seq_len(step) for step in range(self.cfg.training.max_steps)}

    @property
    def tokens(self) -> int:
        """Every token its steps trained on."""
        return self.plan.tokens_before(self.cfg.training.max_steps)


def baseline_model(cfg: Config) -> torch.nn.Module:
    """The model a user would build with transformers: Qwen3ForCausalLM from the config
    `lmcockpit export` writes for this shape, with transformers' own initialisation."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    raw = qwen3_config(cfg, eos=0, dtype="float32")
    config = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type", "torch_dtype")},
                         attn_implementation="sdpa")
    return Qwen3ForCausalLM(config)


def baseline_adamw(model: torch.nn.Module, lr: float, cfg: Config, fused: bool) -> torch.optim.AdamW:
    """AdamW as transformers' Trainer sets it up: decay on all but the norms (and biases, none here)."""
    o = cfg.optimizer
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    keep = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": keep, "weight_decay": 0.0}],
                            lr=lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=fused)
    for group in opt.param_groups:
        group["peak_lr"] = lr
    return opt


def build_runs(cfg: Config, device: torch.device, precision: str, lrs: list[float], adamw_lrs: list[float],
               variants: list[tuple[ablation.Variant, Config]] = (), baseline_cfg: Config | None = None) -> list[Run]:
    """Ours from `cfg`, the baseline's Qwen3 from `baseline_cfg` (the same shape and recipe
    before the speedrun's techniques: `cfg` where not given), each variant from its own."""
    bcfg = baseline_cfg or cfg
    compile_ = cfg.training.compile
    runs = []

    def ours(name: str, kind: str, lr: str, ocfg, rcfg: Config = cfg) -> Run:
        torch.manual_seed(cfg.training.seed)
        model = GPT(shape_from_config(rcfg)).to(device).train()
        model.expand_kv = expands_kv(rcfg, device, precision)
        call = torch.compile(model, dynamic=False) if compile_ else model
        return Run(name, kind, lr, model, call, model.token_losses, build_optimizers(model, ocfg, device, precision),
                   cfg=rcfg)

    def theirs(lr: float) -> Run:
        torch.manual_seed(cfg.training.seed)
        model = baseline_model(bcfg).to(device).train()
        call = torch.compile(model, dynamic=False) if compile_ else model
        V = cfg.tokenizer.vocab_size

        def token_losses(x, y):
            logits = model(input_ids=x, use_cache=False).logits.float()
            return F.cross_entropy(logits.view(-1, V), y.reshape(-1), reduction="none").view(y.shape)

        # use_cache=False: a training forward builds no key/value cache (ours builds none)
        loss = lambda x, y: F.cross_entropy(call(input_ids=x, use_cache=False).logits.float().view(-1, V), y.reshape(-1))  # noqa: E731 - a one-line function, defined where it is used
        return Run(f"transformers Qwen3 + AdamW, lr {lr:g}", "baseline", f"{lr:g}", model, loss, token_losses,
                   [baseline_adamw(model, lr, cfg, device.type == "cuda")], cfg=bcfg)

    o = cfg.optimizer
    runs.append(ours("lmcockpit, Muon + AdamW", "muon", f"{o.muon_lr:g} / {o.lr:g}", o))
    for lr in adamw_lrs:
        runs.append(ours(f"lmcockpit, AdamW, lr {lr:g}", "adamw", f"{lr:g}",
                         dataclasses.replace(o, kind="adamw", lr=lr, weight_decay=WEIGHT_DECAY)))
    runs.extend(theirs(lr) for lr in lrs)
    for v, rcfg in variants:
        runs.append(ours(v.name, v.kind, f"{rcfg.optimizer.muon_lr:g} / {rcfg.optimizer.lr:g}", rcfg.optimizer, rcfg))
    if compile_:  # each model variant and each length a schedule adds is a graph of its own: past dynamo's
        # limit the rest would run eager, unseen
        graphs = sum(len(r.lengths) for r in runs)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, graphs + 8)
    return runs


def main(argv: list[str] | None = None) -> list[Run]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu", help="the shape, batch, schedule and data (default cpu)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override, as lmcockpit's")
    ap.add_argument("--steps", type=int, help="optimizer steps per run (default: the preset's max_steps)")
    ap.add_argument("--lrs", default="1e-3,3e-3,6e-3", help="the baseline's learning rates (its best is taken)")
    ap.add_argument("--adamw-lrs", help="lmcockpit AdamW's learning rates (default: --lrs; \"\": none)")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the entry is appended")
    ap.add_argument("--ablation", action="store_true", help="add runs with the speedrun's techniques (bench/ablation.py)")
    ap.add_argument("--techniques", help="with --ablation: these only, comma-separated (default: all)")
    ap.add_argument("--stack", action="append", default=[], metavar="A+B+...",
                    help="a run with these techniques together on the base recipe (repeatable; alone, no --ablation "
                         "runs are added)")
    args = ap.parse_args(argv)
    if args.techniques and not args.ablation:
        ap.error("--techniques picks the runs of --ablation: add --ablation")

    overrides = list(args.set) + ([f"training.max_steps={args.steps}"] if args.steps else [])
    cfg, _ = load_config(args.preset, overrides)
    picked = (ablation.variants(ablation.chosen(args.techniques)) if args.ablation else []) + ablation.stacks(args.stack)
    overrides += ablation.split([t for v in picked for t in v.techniques], cfg)  # every run alike
    plain = overrides + ablation.before(cfg)  # the recipe before the speedrun's techniques: the baseline's shape
    baseline_cfg, _ = load_config(args.preset, plain)
    # Ours: the preset as it ships; with techniques to compare, the base they are added to.
    cfg = baseline_cfg if picked else load_config(args.preset, overrides)[0]
    t = cfg.training
    device = resolve_device(args.device)
    verdict = cpu_precision.choose(cfg, print) if device.type == "cpu" and t.precision == "auto" else None
    precision = resolve_precision(t.precision, device, verdict)  # what the engine would train in
    amp_dtype = autocast_dtype(precision)
    lrs = [float(v) for v in args.lrs.split(",")]
    adamw_lrs = [float(v) for v in (args.lrs if args.adamw_lrs is None else args.adamw_lrs).split(",") if v]
    if device.type == "cpu":  # as the engine trains on a CPU (trainer.setup)
        torch.use_deterministic_algorithms(True, warn_only=True)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    variants = ablation.configs(picked, lambda extra: load_config(args.preset, plain + extra)[0])
    # Prepared unaligned once; each run's rows drawn as its own config says (a feed per way of drawing).
    data = prepare(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, bos_aligned=False)),
                   lambda line: print(line, flush=True), lambda *a: None)
    val_starts = batches.eval_windows(len(data.val), cfg.eval.batches, t.micro_batch_size, t.seq_len)
    runs = build_runs(cfg, device, precision, lrs, adamw_lrs, variants, baseline_cfg)
    feeds = feeds_for(runs, data)

    def autocast():
        return torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else nullcontext()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def batch(step: int, micro: int = 0, feed: bool = False):  # the engine's batches for one process
        g = batches.global_index(step, 0, micro, 1, t.grad_accum_steps)
        x, y = batches.get_batch(feeds[feed], t.seed, g, t.micro_batch_size, t.seq_len)
        return torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)

    x0, y0 = batch(0, 0, next(iter(feeds)))
    for run in runs:  # compile outside the clock: a forward and backward of each length it takes, no update
        sync()
        t0 = time.perf_counter()
        for length in sorted(run.lengths):
            with autocast():
                run.loss(x0[:, :length], y0[:, :length]).backward()
        for opt in run.opts:
            opt.zero_grad(set_to_none=True)
        sync()
        run.compile_s = time.perf_counter() - t0

    @torch.no_grad()
    def evaluate(run: Run) -> float:
        total, n = 0.0, 0
        for starts in val_starts:
            x, y = (torch.from_numpy(a).to(device) for a in batches.rows_at(data.val, starts, t.seq_len))
            with autocast():
                losses = run.token_losses(x, y)
            total += float(losses.float().sum())
            n += losses.numel()
        return total / n

    print(f"{len(runs)} runs of {t.max_steps} steps side by side, precision {precision}, "
          f"compile {'on' if t.compile else 'off'}, on {device}", flush=True)
    for step in range(t.max_steps):
        micro_batches = {feed: [batch(step, micro, feed) for micro in range(t.grad_accum_steps)] for feed in feeds}
        for run in runs:
            multiplier = run.lr_multiplier(step)
            rows = step_rows(run, step, micro_batches[run.feed])
            sync()
            t0 = time.perf_counter()
            set_lr(run.opts, multiplier)
            for x, y in rows:
                with autocast():
                    loss = run.loss(x, y) / len(rows)
                loss.backward()
            if t.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(run.model.parameters(), t.grad_clip)
            for opt in run.opts:
                opt.step()
            for opt in run.opts:
                opt.zero_grad(set_to_none=True)
            sync()
            run.seconds += time.perf_counter() - t0
        if (step + 1) % args.eval_every == 0 or step + 1 == t.max_steps:
            for run in runs:
                run.evals.append((step + 1, run.seconds, evaluate(run)))
            print(f"step {step + 1}: " + ", ".join(f"{r.evals[-1][2]:.3f}" for r in runs), flush=True)

    report(args, cfg, device, precision, runs, [v for v, _ in variants])
    return runs


def step_rows(run: Run, step: int, micro_batches: list) -> list:
    """The (inputs, targets) `run` trains on at `step`, of the micro-batches every run of its feed
    draws: as the engine's step plan, the first ones its batch share takes, each cut to its length."""
    plan = run.plan
    length = plan.seq_len(step)
    return [(x[:, :length], y[:, :length]) for x, y in micro_batches[:plan.accum_at(step)]]


def feeds_for(runs: list[Run], data) -> dict:
    """The token streams the runs draw their rows from, one per way of drawing (Run.feed), from
    `data` prepared unaligned."""
    first = {run.feed: run for run in reversed(runs)}  # a run of each way, its config saying which
    return {feed: aligned_rows.aligned(copy.copy(data), run.cfg).train for feed, run in first.items()}


def seconds_to_reach(run: Run, target: float) -> float | None:
    """When the validation loss first reaches `target`, interpolated linearly between evaluations
    (from the first step's, the initial loss, assumed above any target)."""
    prev_s, prev_v = 0.0, math.inf
    for _, s, v in run.evals:
        if v <= target:
            if math.isinf(prev_v):
                return s
            return prev_s + (s - prev_s) * (prev_v - target) / (prev_v - v)
        prev_s, prev_v = s, v
    return None


def loss_at(run: Run, seconds: float) -> float | None:
    """The validation loss at `seconds` of training, interpolated between evaluations; the final
    one past the run's end; None before its first evaluation."""
    prev = None
    for _, s, v in run.evals:
        if s >= seconds:
            if prev is None:
                return v if s == seconds else None
            return prev[1] + (v - prev[1]) * (seconds - prev[0]) / (s - prev[0])
        prev = (s, v)
    return run.final


def best(runs: list[Run], kind: str) -> Run:
    return min((r for r in runs if r.kind == kind), key=lambda r: r.final)


def fmt(v: float | None, spec: str = ".3f") -> str:
    return "–" if v is None else format(v, spec)


def secs(v: float | None) -> str:
    return "–" if v is None else f"{v:.{1 if v < 100 else 0}f} s"


def report(args, cfg: Config, device: torch.device, precision: str, runs: list[Run],
           variants: list[ablation.Variant] = ()) -> None:
    t, m = cfg.training, cfg.model
    base, muon = best(runs, "baseline"), best(runs, "muon")
    adamw = best(runs, "adamw") if any(r.kind == "adamw" for r in runs) else None
    target = base.final
    threads = f" with {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    lines = [
        f"Preset `{args.preset}`{' with ' + ', '.join(args.set) if args.set else ''}: {m.n_layer} layers, "
        f"d_model {m.d_model}, {m.n_head}/{m.n_kv_head} heads, vocab {cfg.tokenizer.vocab_size}, "
        f"{runs[0].model.num_params() / 1e6:.2f}M parameters"
        f"{' (' + ', '.join(on) + ')' if (on := ablation.switched_on(cfg)) else ''}; the baseline's Qwen3 "
        f"{sum(p.numel() for p in base.model.parameters()) / 1e6:.2f}M, SwiGLU of {base.cfg.mlp_hidden}; "
        f"batch {t.micro_batch_size}×{t.seq_len} tokens"
        f"{f' × {t.grad_accum_steps} micro-batches' if t.grad_accum_steps > 1 else ''}, "
        f"{t.max_steps} steps, {cfg.optimizer.schedule} schedule with {cfg.optimizer.warmup_steps} warmup steps, "
        f"grad clip {t.grad_clip:g}; {precision}, compile {'on' if t.compile else 'off'}, on {device}{threads}; "
        f"torch {torch.__version__}, transformers {__import__('transformers').__version__}. Validation: "
        f"{cfg.eval.batches} batches of held-out tokens, every {args.eval_every} steps. AdamW runs: weight decay "
        f"{WEIGHT_DECAY:g} on the 2-D parameters. Times: training steps only, every run stepped in turn "
        "(compilation apart, evaluation untimed).",
        "",
        "| run | lr | final val loss | train time | tokens/s | compile |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        star = (" **(best of its kind)**" if (r is base or r is adamw) and sum(x.kind == r.kind for x in runs) > 1
                else "")
        lines.append(f"| {r.name}{star} | {r.lr} | {r.final:.3f} | {secs(r.seconds)} | {r.tokens / r.seconds:,.0f} "
                     f"| {secs(r.compile_s)} |")
    trio = [("transformers + AdamW (best lr)", base), ("lmcockpit AdamW (best lr)", adamw),
            ("lmcockpit Muon + AdamW", muon)]
    trio = [(name, r) for name, r in trio if r is not None]
    lines += ["", "Validation loss at equal steps:", "",
              "| step | " + " | ".join(n for n, _ in trio) + " |", "| ---: |" + " ---: |" * len(trio)]
    every = args.eval_every * math.ceil(t.max_steps / 8 / args.eval_every)  # about 8 rows, each an evaluation's
    marks = sorted({s for s, _, _ in base.evals if s % every == 0} | {t.max_steps})
    for step in marks:
        vals = [next((v for s, _, v in r.evals if s == step), None) for _, r in trio]
        lines.append(f"| {step} | " + " | ".join(fmt(v) for v in vals) + " |")
    lines += ["", "Validation loss at equal wall time (shares of the baseline's best run):", "",
              "| training time | " + " | ".join(n for n, _ in trio) + " |", "| ---: |" + " ---: |" * len(trio)]
    for share in MILESTONES:
        s = share * base.seconds
        lines.append(f"| {secs(s)} ({share:.0%}) | " + " | ".join(fmt(loss_at(r, s)) for _, r in trio) + " |")
    lines += ["", f"Time to reach the baseline's best final validation loss, {target:.3f}:", "",
              "| run | training time | vs the baseline |", "| --- | ---: | ---: |"]
    base_s = seconds_to_reach(base, target)
    for name, r in trio:
        s = seconds_to_reach(r, target)
        ratio = fmt(s / base_s, ".2f") + "×" if s is not None and base_s else "not reached"
        lines.append(f"| {name} | {secs(s)} | {ratio} |")
    ours_s = seconds_to_reach(muon, target)
    verdict = (f"lmcockpit reaches it in {ours_s / base_s:.2f}× the baseline's time (targets: ≤ 0.4×, issue 23; ≤ 0.2×, issue 55)"
               if ours_s is not None and base_s else "lmcockpit does not reach it")
    lines += ["", f"**Headline: {verdict}.**"]
    if variants:
        lines += ablation_lines(variants, runs, muon, base, base_s)
    record("convergence: time to quality against transformers + AdamW"
           + (", the speedrun's techniques one by one" if variants else ""), lines, args.results)


def ablation_lines(variants: list[ablation.Variant], runs: list[Run], ours: Run, base: Run, base_s: float | None
                   ) -> list[str]:
    """The ablation's table: `ours`, the recipe with no technique; `base`, the baseline's best run,
    whose final loss is the target and whose training time is the equal time."""
    target, by_name = base.final, {r.name: r for r in runs}
    lines = ["", f"The speedrun's techniques (bench/ablation.py), cumulative (each added to the rows above it) and "
             f"alone (each on the base recipe), or stacked (`--stack`: together on the base recipe), against the baseline's best final loss {target:.3f}. Loss at equal "
             f"time: at the baseline's best run's training time, {secs(base.seconds)}. Δ: the final loss against "
             "the run it adds to (the row above for a cumulative row, the base for an alone or stacked one).", "",
             "| run | overrides | record | final val loss | Δ | loss at equal time | time to quality "
             "| vs the baseline | tokens/s |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def row(name: str, run: Run, techniques: tuple[ablation.Technique, ...] = (), before: Run | None = None) -> str:
        s = seconds_to_reach(run, target)
        ratio = fmt(s / base_s, ".2f") + "×" if s is not None and base_s else "not reached"
        what = (", ".join(f"`{o}`" for t in techniques for o in t.overrides), ", ".join(dict.fromkeys(t.record for t in techniques)))
        return (f"| {name} | {what[0]} | {what[1]} | {run.final:.3f} | {fmt(before and run.final - before.final, '+.3f')} "
                f"| {fmt(loss_at(run, base.seconds))} | {secs(s)} | {ratio} | {run.tokens / run.seconds:,.0f} |")

    lines += [row("transformers + AdamW (best lr)", base), row("base: lmcockpit Muon + AdamW", ours)]
    above = ours
    for v in variants:
        run = by_name[v.name]
        lines.append(row(v.name, run, v.techniques if v.kind == "stack" else v.techniques[-1:],
                         above if v.kind == "cumulative" else ours))
        above = run if v.kind == "cumulative" else above
    reached = [(s / base_s, v.name) for v in variants if (s := seconds_to_reach(by_name[v.name], target)) and base_s]
    fastest = (f"{min(reached)[1]} reaches it in {min(reached)[0]:.2f}× the baseline's time" if reached
               else "no run of the ablation reaches it")
    lines += ["", f"**Ablation: {fastest} (issue 55's target ≤ 0.2×).**"]
    scaled = [t for t in dict.fromkeys(t for v in variants for t in v.techniques) if t.why]
    if scaled:
        lines += ["", "Chosen for the preset's scale: " + "; ".join(f"{t.name}: {t.why}" for t in scaled) + "."]
    return lines


if __name__ == "__main__":
    main()

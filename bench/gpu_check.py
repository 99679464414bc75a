"""Issue 5's record on a real GPU, in one command, appended to bench/RESULTS.md with date and machine.

Parts, in the order they run (each appends its own section, so they can also run one at a time):

* doctor: `lmcockpit doctor`'s output and exit code;
* h100: the `h100` preset for 300 steps (compile, bf16) through the real CLI and engine process:
  tokens/s, MFU, step time, compile time, peak allocated memory against the estimate; and the
  MFU as the entry to add to compute_estimate.MEASURED_MFU (issue 42: time estimates stop being
  marked as assumed for that card);
* torchrun: issue 8's check, the same `h100` run through the multi-process launcher with
  `--nproc 1` (torchrun's elastic agent, one NCCL rank, DDP; the rank a fork of the launcher's
  forkserver since session 29, so CUDA and NCCL first start in a fork there): same table;
* memory: the estimator against measured `torch.cuda.max_memory_allocated` for the `h100`,
  `3090`, `4090` and `4070ti` presets, each in a fresh process whose allocator is capped with
  `torch.cuda.set_per_process_memory_fraction` to its card's memory (minus the CUDA context memory_estimate.py
  assumes), none allowed out of memory, each within ±15%;
* saved: what autograd keeps for backward per token, eager and compiled in bf16, measured with
  saved-tensor hooks on the GPU's own kernels (flash attention, inductor's CUDA fusions) for the
  memory part's presets at 2 layers, against memory_estimate.py's per-token counts: where the memory part's
  difference comes from, if it is the activations;
* graphs: the trainer's accumulated gradients in every `training.compile_mode` against the same
  step recomputed eagerly, four steps each (CUDA graphs record on one call and replay on the next:
  an accumulated gradient aliased to a graph's output shows up as a difference of order 1, not
  as an error);
* modes: every `training.compile_mode` with gradient accumulation 2 and evaluation plus sampling
  every 50 steps on the `4070ti` preset: no error, and reserved memory after each eval/sample round
  not above the round before.
* inference: issue 20's evaluation and sampling memory: on the `3060` and `h100` presets' shapes
  (bf16, 2 layers), one evaluation micro-batch through the blockwise loss and one sample prefilled
  at the whole context, peak allocated against memory_estimate.inference_bytes (±15%);
* resume: issue 20's device random states: a debug run on the GPU checkpoints at step 10; its
  state.json is given a second rank's GPU state (and, a second time, the old all-GPUs form with
  two entries), and each resumes on this one GPU to step 20, saying what was not exact;
* ddp: issue 20's DDP gradients: a torchrun group of one on NCCL (`--nproc 1`, as tests/
  test_gpu_paths.py does on gloo) trains 3 accumulated steps; every gradient stays a view into
  DDP's buckets, and allocated memory after steps 2 and 3 is the same;
* search: issue 20's peak reset: the `3090` preset with training.auto_micro_batch for 20 steps;
  the log gives the trials' peak, and metrics.jsonl's peak (training's own) stays under it and
  within ±15% of the estimate at the micro-batch chosen;
* attention: issue 20's grouped-query attention on the lent card, in bf16, fp16 and fp32: the
  path core/hardware/attention.py chooses, one eager forward and backward of the `4090` shape at
  2 layers with SDPA restricted to the kernels that path expects (flash or cuDNN; memory-efficient
  with K/V expanded), so a fall to the math kernel raises; the saved bytes per token against
  memory_estimate.py's count, and the pass's peak against the estimate's activations and loss;
* allocator: issue 20, PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF both set, to opposite
  `expandable_segments` values, in fresh processes: the settings torch parsed and whether its CUDA
  segments are expandable, against the variable `gpu_env` (the engine's allocator line) names;
* muon: issue 20, Newton–Schulz in bf16, fp16 (what Volta and Turing iterate in) and fp32 on this
  GPU's cuBLAS against float64, for stacks of the `h100` preset's shapes and for gradients scaled by
  1e-6 and 1e6: fp16 no further from float64 than bf16 and finite; with the times;
* nvml: issue 20's check, GPU panels on the right card: each visible CUDA device's UUID (torch's
  device properties, as RunStarted carries it) against the NVML GPU the front-end's mapping picks
  for it, and one Telemetry reading with every GPU's name and memory present;
* glance: issue 22's dashboard on the real card: the cockpit (App.run_test, real NVML telemetry)
  trains the `debug` preset on the GPU at 80x24, 100x30 and 120x40 (through a run host: since
  session 30 the engine is a plain fork of its host, itself a fork of the cockpit's forkserver, so
  CUDA first starts in such a fork here); the step line must show MFU
  and the GPU bar the card's own NVML utilisation and VRAM used/total, all on screen without
  scrolling; each size's screen is kept as an SVG beside the runs;
* data: issue 19 on the lent machine's 16 cores, where this project's machines have 2:
  `bench/data.py` (no GPU needed) prepares 500 MB and 1 GB corpora with the default worker count;
  prepare's speed against tokenizers' `encode_batch_fast` on every core, and the whole process
  tree's peak against the 1.5 GB bound. It records its own tables.
* recipe: issue 23's speed and time to quality on the GPU shapes, through the two benches that
  record their own entries: `bench/throughput.py` (the h100 preset's shape, micro-batch 8, bf16,
  compiled: lmcockpit with AdamW and with Muon + AdamW against transformers' Qwen3ForCausalLM,
  target ≥ 1.3× each) and `bench/convergence.py` (the h100 preset's shape on the standard library,
  micro-batch 8, 300 steps: Muon, AdamW and the transformers baseline at three learning rates,
  the time to the baseline's best final loss, target ≤ 0.4×);
* tasks: issue 41's task scoring at the 124M shape (the `gpt2-fineweb` preset's model, random
  weights, bf16, eager as the trainer scores): 10,042 synthetic items of HellaSwag's shape (four
  endings of 15–40 tokens after contexts of 40–110; the lent machine has no network for the real
  ones) scored under a minute; and ten rounds of 1,000 of them, the allocator's reserved memory
  after the tenth equal to the first's (nanochat's evaluation grew it every round);
* anatomy: issue 53's step anatomy against a profiler trace of the same steps: the `h100` preset
  (compiled, bf16) for 40 steps with `profile.at_step=31` (five steps recorded after a warm-up
  step); the parts the step rows hold for the recorded steps, summed, against the profiler's wall
  time of those steps (its ProfilerStep spans): within 5%; with the trace's kinds of work beside
  the parts. `--device cpu` rehearses it on the `debug` preset;
* oom: issue 53's out-of-memory message on a real one: the `3090` preset (eager, no accumulation)
  at the smallest power-of-two micro-batch the estimator puts at 1.3× this card's memory, through
  the real CLI: exit 1, one message without a traceback naming the training step, what was asked
  and free (torch's figures), the allocator's cache and training.micro_batch_size; and the same
  run in a process recording the allocator's history, whose message names the snapshot it wrote;
* gpt2: issue 23's reference run, only when named (it takes hours and needs the Hub): the
  `gpt2-fineweb` preset through the real CLI, FineWeb and GPT-2's tokenizer fetched as the preset
  says (or `--set data.source=DIR` and `--set tokenizer.kind=DIR` where they were downloaded
  elsewhere). From its metrics.jsonl: the step whose evaluation first reached validation loss 3.28
  (`--target`), the training time to it (the steps' own time, compilation included, evaluations
  not), the wall time from the first step's start to that evaluation, and the last and best
  validation loss; it passes when the target was reached. `--stop-at-target` ends the run there
  (SIGTERM: a checkpoint, exit 130) instead of training out the preset's 9.9B tokens.
* speedrun: issue 55's GPU proof, the runbook's last part, only when named (it needs the shards
  `bash bench/gpu_lease.sh prepare` fetched; one 10-minute call): the `gpt2-speedrun` preset for
  `--seconds` (default 300) after its first step, its validation loss at each evaluation against
  modded-nanogpt's record log at the same tokens, and the time to 3.28 projected by
  core/run/target.py's fit (bench/speedrun.py says what it prints).

    python bench/gpu_check.py [--part doctor h100 torchrun memory saved graphs modes inference resume ddp search
                                      attention allocator muon nvml glance data recipe tasks oom gpt2 speedrun]
                              [--steps 300] [--out DIR] [--target 3.28] [--stop-at-target] [--seconds 300]
                              [--set KEY=VALUE ...]

On the device tool's lent machine (torch there, textual and a few others not, no network):
`bash bench/gpu_lease.sh prepare` here, then `bash bench/gpu_lease.sh run PART...` there.

Exit 0 when every check passed, 1 otherwise (or without a CUDA GPU). On the lent GPU each part
but gpt2 fits one 10-minute call; the data cache built by the first run is reused by the others.
`--device cpu` rehearses the graphs, saved, attention, gpt2 and speedrun parts on a CPU (compiled, no CUDA
graphs), printing their tables without recording them; gpt2 there is the preset at the debug
preset's size on the standard library, with a BPE of its own and a target such a run reaches;
speedrun there is a 2-layer model on tiny shards and a tokenizer of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from lmcockpit.core.hardware import gpu_env

ALLOCATOR = gpu_env.configure_allocator()  # as the engine does, before torch initialises CUDA

import torch  # noqa: E402 - below configure_allocator(), which must run before torch loads

sys.path.insert(0, str(Path(__file__).parent))
from machine import record  # noqa: E402 - below configure_allocator(), which must run before torch loads
from speedrun import part_speedrun  # noqa: E402 - from bench/, put on sys.path above

from lmcockpit.core.hardware.compute_estimate import gpu_model  # noqa: E402 - below configure_allocator(), which must run before torch loads
from lmcockpit.core.hardware import memory_estimate  # noqa: E402 - below configure_allocator(), which must run before torch loads
from lmcockpit.core.config import load_config  # noqa: E402 - below configure_allocator(), which must run before torch loads
from lmcockpit.core.run.curves import load_run  # noqa: E402 - below configure_allocator(), which must run before torch loads
from lmcockpit.core.run.folder import create_run_dir, read_metrics  # noqa: E402 - below configure_allocator(), which must run before torch loads

PARTS = ("doctor", "h100", "torchrun", "memory", "saved", "graphs", "modes", "inference", "resume", "ddp", "search",
         "attention", "allocator", "muon", "nvml", "glance", "data", "recipe", "tasks", "anatomy", "oom", "gpt2",
         "speedrun")
ONLY_NAMED = ("gpt2", "speedrun")  # not in the default list: hours of training; data prepared before the lease
CPU_PARTS = ("saved", "graphs", "attention", "tasks", "anatomy", "gpt2", "speedrun")
MEMORY_PRESETS = ("h100", "3090", "4090", "4070ti")
MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
TOLERANCE = 0.15  # the issue's ±15% between estimate and measurement
SAVED_TOLERANCE = 0.05  # per-token counts: the CPU test holds them to 0 (eager) and 3% (compiled)
GRAD_TOLERANCE = 1e-3  # fp32 without TF32: kernels differ in summation order only
GiB = memory_estimate.GiB


def cli(*args: str, timeout: float = 7200) -> subprocess.CompletedProcess:
    """The real command, in the environment the user gave this script: lmcockpit sets the allocator
    variable itself, and one inherited from here would read as the user's own."""
    env = {k: v for k, v in os.environ.items() if ALLOCATOR.by_user or k != ALLOCATOR.name}
    return subprocess.run([sys.executable, "-m", "lmcockpit.tui.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


# The device machine reaches no network: the GPU presets train on the standard library here, not
# on the FineWeb-Edu sample they fetch from the Hub.
OFFLINE_DATA = 'data.source="python-stdlib"'


def sets(*overrides: str) -> list[str]:
    return [a for o in (OFFLINE_DATA, *overrides) for a in ("--set", o)]


def tail(text: str, n: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


# ------------------------------------------------------------------------------------- parts
def part_doctor() -> tuple[bool, list[str]]:
    proc = cli("doctor", timeout=900)
    return proc.returncode == 0, [f"`lmcockpit doctor` exit code {proc.returncode}:", "", "```",
                                  (proc.stdout + proc.stderr).rstrip(), "```"]


def part_h100(out: Path, steps: int, launch: tuple[str, ...] = ()) -> tuple[bool, list[str]]:
    run = out / ("h100-" + "".join(launch).strip("-") if launch else "h100")
    command = f"lmcockpit --run h100 {' '.join(launch)} --set training.max_steps={steps}".replace("  ", " ")
    proc = cli("--run", "h100", *launch, *sets(f"training.max_steps={steps}"), "--out", str(run))
    if proc.returncode != 0:
        return False, [f"`{command}` failed (exit {proc.returncode}):", "", "```", tail(proc.stderr), "```"]
    cfg, _ = load_config(run / "config.toml")
    rows = read_metrics(run, "step")
    steady = rows[10:]  # past compilation and the allocator's first growth
    dt = statistics.median(r["dt"] for r in steady)
    peak = max(r["mem"]["peak"] for r in rows)
    reserved = max(r["mem"]["reserved"] for r in rows)
    est = memory_estimate.estimate(cfg, "cuda").allocated
    ratio = peak / est
    evals = [r for r in read_metrics(run, "eval") if r.get("val_loss") is not None]  # not a tasks-only row
    val = f"{evals[-1]['val_loss']:.3f}" if evals else "–"
    ok = len(rows) >= steps and abs(ratio - 1) <= TOLERANCE
    return ok, [
        f"`{command}` (compile {cfg.training.compile_mode}, precision "
        f"auto; {memory_estimate.param_counts(cfg).total / 1e6:.1f}M parameters, {cfg.tokens_per_step:,} tokens/step):", "",
        "| steps | tokens/s | MFU | step time | compile (step 1 − median) | peak allocated | peak reserved | "
        "estimate | measured / estimate | final val loss |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {len(rows)} | {statistics.median(r['tokens_per_s'] for r in steady):,.0f} | "
        f"{statistics.median(r['mfu'] or 0 for r in steady):.1%} | {dt:.3f} s | {rows[0]['dt'] - dt:.0f} s | "
        f"{peak / GiB:.2f} GiB | {reserved / GiB:.2f} GiB | {est / GiB:.2f} GiB | {ratio:.2f} | {val} |", "",
        # The launch screen's and `lmcockpit presets`' times assume 40% MFU until a card has this entry.
        f"For core/hardware/compute_estimate.py: `MEASURED_MFU[{gpu_model(torch.cuda.get_device_name())!r}] = "
        f"{statistics.median(r['mfu'] or 0 for r in steady):.2f}`",
    ]


def part_memory(out: Path, presets: list[str]) -> tuple[bool, list[str]]:
    lines = ["Each preset in a fresh process, its allocator capped with `torch.cuda.set_per_process_memory_fraction`"
             f" to the card's memory minus the {memory_estimate.CUDA_CONTEXT_BYTES / GiB:.2f} GiB CUDA context memory_estimate.py assumes "
             f"(h100: uncapped); 20 steps; ±{TOLERANCE:.0%} wanted.", "",
             "| preset | cap | peak allocated | estimate (allocated) | measured / estimate | out of memory | "
             "estimate's parts (GiB) |", "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
    ok = True
    for name in presets:
        proc = subprocess.run([sys.executable, __file__, "--measure", name, "--out", str(out)], capture_output=True,
                              text=True, timeout=3600)
        try:
            m = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            m = {"oom": None, "error": tail(proc.stderr, 3)}
        if "peak" not in m:
            ok = False
            lines.append(f"| {name} | | | | | {'yes' if m['oom'] else 'no'}: {m['error'].replace(chr(10), ' ')} | |")
            continue
        ratio = m["peak"] / m["estimate"]
        ok &= abs(ratio - 1) <= TOLERANCE
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in m["parts"].items())
        lines.append(f"| {name} | {m['cap'] / GiB:.2f} GiB | {m['peak'] / GiB:.2f} GiB | "
                     f"{m['estimate'] / GiB:.2f} GiB | {ratio:.2f} | no | {parts} |")
    return ok, lines


def measure(name: str, out: Path) -> dict:
    """One preset under its card's memory cap (run in a process of its own by part_memory)."""
    cfg, _ = load_config(name, [OFFLINE_DATA, "training.max_steps=20", "eval.every=0", "sample.every=0",
                                "sample.prompts=[]",
                                "checkpoint.every=0", "hardware.device=\"cuda:0\""])
    total = torch.cuda.get_device_properties(0).total_memory
    cap = total if name == "h100" else int(cfg.hardware.vram_gb * GiB) - memory_estimate.CUDA_CONTEXT_BYTES
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
    from lmcockpit.core.train.memory_probe import OutOfMemory
    from lmcockpit.core.train.trainer import run_in_process

    run_dir = create_run_dir(cfg, name, str(Path(tempfile.mkdtemp(prefix=f"{name}-", dir=out))))
    try:
        trainer = run_in_process(cfg, run_dir, log=lambda line: print(line, file=sys.stderr))
    except OutOfMemory as e:
        return {"oom": True, "error": str(e)}
    est = memory_estimate.estimate(trainer.cfg, "cuda")
    parts = ("weights", "grads", "optimizer", "activations", "loss", "recompute", "muon_step", "inference", "margin")
    return {"peak": torch.cuda.max_memory_allocated(0), "cap": cap, "estimate": est.allocated,
            "parts": {k: getattr(est, k) for k in parts}}


def part_saved(presets: list[str], device: str = "cuda") -> tuple[bool, list[str]]:
    from lmcockpit.core.train.memory_probe import saved_bytes_per_token

    lines = ["Bytes per token autograd keeps for backward (saved-tensor hooks, micro-batch 2 less micro-batch 1) "
             "in one bf16 forward of each preset's shape at 2 layers and 256 tokens, against memory_estimate.py's count "
             f"(the blocks, what follows them and, compiled, the logits); within {SAVED_TOLERANCE:.0%} wanted.", "",
             "| preset | path | measured | memory_estimate.py | measured / memory_estimate.py |", "| --- | --- | ---: | ---: | ---: |"]
    ok = True
    for name in presets:
        cfg, _ = load_config(name, ["model.n_layer=2", "training.seq_len=256"])
        for compiled in (False, True):
            measured = saved_bytes_per_token(cfg, device, compiled, torch.bfloat16)
            counted = memory_estimate.saved_per_token(cfg, 2, compiled)
            ok &= abs(measured / counted - 1) <= SAVED_TOLERANCE
            lines.append(f"| {name} | {'compiled' if compiled else 'eager'} | {measured:,.0f} | {counted:,} | "
                         f"{measured / counted:.3f} |")
        torch.compiler.reset()
    return ok, lines


def graph_gradients(mode: str, device: str, out: Path, steps: int = 4) -> tuple[list[float], int]:
    """The largest relative difference, per parameter and step, between the gradients the trainer
    steps with (debug preset, compiled in `mode`, accumulation 2, fp32) and the same micro-batches
    recomputed eagerly from the same weights; and how many graphs inductor ran without CUDA graphs."""
    import copy

    from lmcockpit.core.data import batches
    from lmcockpit.core.train.trainer import Trainer

    cfg, _ = load_config("debug", [
        "training.compile=true", f"training.compile_mode=\"{mode}\"", "training.grad_accum_steps=2",
        "training.precision=\"fp32\"", "training.grad_clip=0", f"training.max_steps={steps}",
        f"hardware.device=\"{device}\"", "eval.every=0", "sample.prompts=[]", "checkpoint.every=0"])
    trainer = Trainer(cfg, create_run_dir(cfg, f"graphs-{mode}", str(out / f"graphs-{mode}-{device}")),
                      lambda event: None, lambda line: None, lambda block: None)
    trainer.setup()
    torch.backends.cuda.matmul.allow_tf32 = False  # setup turned it on; exact fp32 on both sides
    t, worst = cfg.training, []

    def compare() -> None:  # just before the optimizers step: this step's gradients, the last step's weights
        ref = copy.deepcopy(trainer.model)
        ref.zero_grad(set_to_none=True)
        for micro in range(t.grad_accum_steps):
            g = batches.global_index(trainer.step, 0, micro, 1, t.grad_accum_steps)
            x, y = (torch.from_numpy(a).to(trainer.device)
                    for a in batches.get_batch(trainer.data.train, t.seed, g, t.micro_batch_size, t.seq_len))
            (ref(x, y) / t.grad_accum_steps).backward()
        worst.append(max(float((p.grad - r.grad).norm() / r.grad.norm().clamp_min(1e-30))
                         for p, r in zip(trainer.model.parameters(), ref.parameters())))

    from torch._dynamo.utils import counters  # private, and kept: inductor counts skipped graphs nowhere public

    counters["inductor"]["cudagraph_skips"] = 0  # a skipped graph would pass without testing anything
    first = trainer.optimizers[0]
    step = first.step
    first.step = lambda *a, **k: (compare(), step(*a, **k))[1]
    try:
        for _ in range(steps):
            trainer.train_step()
    finally:
        trainer.close()
        torch.compiler.reset()
    return worst, counters["inductor"]["cudagraph_skips"]


def part_graphs(out: Path, modes: list[str], device: str = "cuda") -> tuple[bool, list[str]]:
    lines = ["The debug preset compiled in each mode, gradient accumulation 2, fp32 without TF32: the largest "
             "relative difference (over parameters) between the gradients each step applies and the same "
             f"micro-batches recomputed eagerly from the same weights; at most {GRAD_TOLERANCE:g} wanted.", "",
             "| compile_mode | keeps gradients | CUDA graphs skipped | step 1 | step 2 | step 3 | step 4 | result |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    ok = True
    for mode in modes:
        try:
            (diffs, skipped), error = graph_gradients(mode, device, out), ""
        except Exception as e:  # noqa: BLE001 - the error is the finding: record it and go on
            diffs, skipped, error = [], 0, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        graphs = mode in memory_estimate.CUDA_GRAPH_MODES and device == "cuda"
        good = len(diffs) == 4 and max(diffs) <= GRAD_TOLERANCE and not (graphs and skipped)
        ok &= good
        cells = [f"{d:.1e}" for d in diffs] + [""] * (4 - len(diffs))
        keeps = "yes" if mode in memory_estimate.CUDA_GRAPH_MODES else "no"
        lines.append(f"| {mode} | {keeps} | {skipped} | {' | '.join(cells)} | {'pass' if good else 'FAIL ' + error} |")
    return ok, lines


def part_modes(out: Path, modes: list[str]) -> tuple[bool, list[str]]:
    lines = ["The `4070ti` preset, 200 steps, gradient accumulation 2, evaluation and sampling every 50 steps; "
             "reserved memory on the step after each eval/sample round (51, 101, 151).", "",
             "| compile_mode | exit | CUDA-graph or other error | tokens/s | compile | reserved after rounds 1, 2, 3 | "
             "grows |", "| --- | ---: | --- | ---: | ---: | --- | --- |"]
    ok = True
    for mode in modes:
        run = out / f"mode-{mode}"
        proc = cli("--run", "4070ti", *sets("training.max_steps=200", "training.grad_accum_steps=2", "eval.every=50",
                                            "sample.every=50", "eval.batches=4", "checkpoint.every=0",
                                            f"training.compile_mode=\"{mode}\""), "--out", str(run))
        log = (run / "train.log").read_text() if (run / "train.log").exists() else ""
        error = next((line.strip() for line in log.splitlines()
                      if "overwritten by a subsequent run" in line or line.startswith("Traceback")), "")
        rows = {r["step"]: r for r in read_metrics(run, "step")}
        after = [rows[s]["mem"]["reserved"] for s in (51, 101, 151) if s in rows]
        grows = any(b > a for a, b in zip(after, after[1:]))
        good = proc.returncode == 0 and not error and len(after) == 3 and not grows
        ok &= good
        steady = [r for s, r in rows.items() if s > 10]
        tps = statistics.median(r["tokens_per_s"] for r in steady) if steady else 0
        dt = statistics.median(r["dt"] for r in steady) if steady else 0
        compile_s = rows[1]["dt"] - dt if 1 in rows else 0
        lines.append(f"| {mode} | {proc.returncode} | {error or 'none'} | {tps:,.0f} | {compile_s:.0f} s | "
                     f"{', '.join(f'{r / GiB:.2f}' for r in after)} GiB | {'yes' if grows else 'no'} |")
        if proc.returncode != 0:
            lines += ["", "```", tail(proc.stderr), "```", ""]
    return ok, lines


def part_inference(presets: tuple[str, ...] = ("3060", "h100")) -> tuple[bool, list[str]]:
    from lmcockpit.core.model.gpt import GPT, shape_from_config
    from lmcockpit.core.model.sampling import generate

    lines = ["Peak allocated above the weights, bf16 autocast, 2 layers of each preset: one evaluation micro-batch "
             "(GPT.token_losses) and one sample prefilled at the whole context, against memory_estimate.py (the working set "
             f"plus autocast's copies of the matrices); ±{TOLERANCE:.0%} wanted.", "",
             "| preset | what | measured | memory_estimate.py | measured / memory_estimate.py |", "| --- | --- | ---: | ---: | ---: |"]
    ok = True
    for name in presets:
        cfg, _ = load_config(name, ["model.n_layer=2"])
        model = GPT(shape_from_config(cfg)).cuda().eval()
        n = memory_estimate.param_counts(cfg)
        casts = 2 * (n.matrices + n.embedding)
        B, T, V, m = cfg.training.micro_batch_size, cfg.training.seq_len, cfg.tokenizer.vocab_size, cfg.model
        x = torch.randint(0, V, (B, T), device="cuda")
        layer = memory_estimate.inference_layer_bytes(cfg, 2)
        evaluation = max(B * T * layer, B * T * (4 * m.d_model + 4)
                         + 8 * min(B * T, memory_estimate.LOSS_BLOCK_ELEMENTS["cuda"] // V) * V)
        sampling = 2 * m.n_layer * cfg.max_seq_len * m.n_kv_head * cfg.head_dim * 2 + cfg.max_seq_len * layer
        prompt = torch.randint(0, V, (cfg.max_seq_len,)).tolist()
        for what, run, counted in (("evaluation", lambda: model.token_losses(x, x), evaluation),
                                   ("sampling", lambda: list(generate(model, prompt, 2)), sampling)):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                run()
            measured = torch.cuda.max_memory_allocated() - base
            ratio = measured / (counted + casts)
            ok &= abs(ratio - 1) <= TOLERANCE
            lines.append(f"| {name} | {what} | {measured / GiB:.3f} GiB | {(counted + casts) / GiB:.3f} GiB | "
                         f"{ratio:.2f} |")
        model = None  # freed before the next preset's
        torch.cuda.empty_cache()
    return ok, lines


def part_resume(out: Path) -> tuple[bool, list[str]]:
    run = out / "resume"
    first = cli("--run", "debug", *sets("training.max_steps=10", "checkpoint.every=10", "hardware.device=\"cuda:0\""),
                "--out", str(run))
    if first.returncode != 0:
        return False, ["the debug run on the GPU failed:", "", "```", tail(first.stderr), "```"]
    ckpt = run / "checkpoints" / "step_000010"
    saved = json.loads((ckpt / "state.json").read_text())
    lines, ok = ["A debug run's step-10 checkpoint, given two GPUs' random states, resumed on this one GPU to "
                 "step 20.", "", "| state.json holds | exit | what the resume said |", "| --- | ---: | --- |"], True
    mine = saved["rng"].get("cuda_by_rank", [None])[0]
    ok &= mine is not None  # a GPU run saves its rank's GPU state
    for form, rng in (("cuda_by_rank: 2 ranks", {"cuda_by_rank": [mine, mine]}), ("cuda: 2 GPUs (older form)",
                                                                                    {"cuda": [mine, mine]})):
        state = {**saved, "rng": {k: v for k, v in saved["rng"].items() if k not in ("cuda", "cuda_by_rank")} | rng}
        (ckpt / "state.json").write_text(json.dumps(state))
        # not sets(): a resume refuses to change data.source, which the checkpoint already holds
        proc = cli("--run", "--resume", str(ckpt), "--out", str(out / f"resumed-{len(lines)}"),
                   "--set", "training.max_steps=20")
        if proc.returncode != 0:
            lines.append(f"| {form} | {proc.returncode} | {tail(proc.stderr, 1).replace('|', '/')} |")
            ok = False
            continue
        said = next((line.split("resume: ", 1)[1] for line in proc.stdout.splitlines() if "resume: " in line), "exact")
        ok &= proc.returncode == 0
        lines.append(f"| {form} | {proc.returncode} | {said} |")
    (ckpt / "state.json").write_text(json.dumps(saved))
    return ok, lines


DDP_PROBE = Path(__file__).parents[1] / "tests" / "test_gpu_paths.py"


def part_ddp(out: Path) -> tuple[bool, list[str]]:
    """tests/test_gpu_paths.py's probe, on NCCL and the GPU: the gradients after each step."""
    sys.path.insert(0, str(DDP_PROBE.parents[1]))
    from tests.test_gpu_paths import DDP_PROBE as probe, free_port

    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           # the checkout for `tests`, after the caller's path: an installed lmcockpit must not lose to the
           # checkout's bare top folder lmcockpit/ (seen on the lent H100, 2026-11-27)
           "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(DDP_PROBE.parents[1])) if p),
           "LMCOCKPIT_PROBE_DEVICE": "cuda"}
    proc = subprocess.run([sys.executable, "-c", probe, str(out / "ddp")], capture_output=True, text=True, env=env,
                          timeout=900)
    if proc.returncode != 0:
        return False, ["the DDP probe failed:", "", "```", tail(proc.stderr), "```"]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    steps = result["steps"]
    ok = (all(s["none"] == 0 and len(s["storages"]) < result["params"] for s in steps)
          and steps[1]["storages"] == steps[2]["storages"] and steps[1]["allocated"] == steps[2]["allocated"])
    return ok, ["A torchrun group of one on NCCL, DDP, accumulation 2, 3 steps:", "",
                "| step | gradients None | distinct gradient storages (of " + str(result["params"]) + ") | allocated |",
                "| ---: | ---: | ---: | ---: |",
                *(f"| {i + 1} | {s['none']} | {len(s['storages'])} | {s['allocated'] / 2**20:.1f} MiB |"
                  for i, s in enumerate(steps))]


def part_search(out: Path) -> tuple[bool, list[str]]:
    run = out / "search"
    proc = cli("--run", "3090", *sets("training.max_steps=20", "training.auto_micro_batch=true", "eval.every=0",
                                      "checkpoint.every=0"), "--out", str(run))
    if proc.returncode != 0:
        return False, ["`lmcockpit --run 3090` with auto_micro_batch failed:", "", "```", tail(proc.stderr), "```"]
    found = next((line for line in proc.stdout.splitlines() if "the trials peaked at" in line), "")
    trial = float(found.split("the trials peaked at ")[1].split(" GiB")[0]) * GiB if found else 0.0
    cfg, _ = load_config(run / "config.toml")
    peak = max(r["mem"]["peak"] for r in read_metrics(run, "step"))
    est = memory_estimate.estimate(cfg, "cuda").allocated
    ok = bool(found) and peak <= trial and abs(peak / est - 1) <= TOLERANCE
    return ok, [f"`{found.strip()}`", "", "| trials' peak | training's peak | estimate | training / estimate |",
                "| ---: | ---: | ---: | ---: |",
                f"| {trial / GiB:.2f} GiB | {peak / GiB:.2f} GiB | {est / GiB:.2f} GiB | {peak / est:.2f} |"]


def oom_overrides() -> list[str]:
    """The `3090` preset at a micro-batch this card cannot hold: the smallest power of two whose
    estimate is 1.3× its memory, eager (so the step, not a compile, runs out), no accumulation."""
    fixed = ["training.compile=false", "training.grad_accum_steps=1", "training.auto_micro_batch=false",
             "training.max_steps=2", "eval.every=0", "eval.batches=1", "checkpoint.every=0", "sample.prompts=[]",
             'hardware.device="cuda:0"']
    cfg, _ = load_config("3090", [OFFLINE_DATA, *fixed])
    total, mb = torch.cuda.get_device_properties(0).total_memory, 1
    while memory_estimate.estimate(cfg, "cuda", mb).allocated < 1.3 * total:
        mb *= 2
    return [*fixed, f"training.micro_batch_size={mb}"]


def oom_snapshot(out: Path) -> dict:
    """The oom part's run in this process, the allocator's history recorded (as `profile.memory`
    does): the message and whether the snapshot it names is on disk (run by part_oom in a process
    of its own)."""
    from lmcockpit.core.train.memory_probe import OutOfMemory
    from lmcockpit.core.train.trainer import run_in_process

    cfg, _ = load_config("3090", [OFFLINE_DATA, *oom_overrides()])
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    run_dir = create_run_dir(cfg, "oom", str(Path(tempfile.mkdtemp(prefix="oom-snapshot-", dir=out))))
    try:
        run_in_process(cfg, run_dir, log=lambda line: print(line, file=sys.stderr))
    except OutOfMemory as e:
        message = str(e)
        named = message.split("memory snapshot: ")[1].split(" (open it")[0] if "memory snapshot: " in message else ""
        return {"message": message, "snapshot": named, "exists": bool(named) and Path(named).is_file()}
    return {"message": "", "snapshot": "", "exists": False}


def part_anatomy(out: Path, device: str = "cuda", steps: int = 40, at: int = 31) -> tuple[bool, list[str]]:
    """The step rows' parts against a profiler trace of the same steps (core/train/step_clock.py
    against core/train/profiling.py): their sum within 5% of the profiled steps' wall time."""
    preset = "h100" if device == "cuda" else "debug"
    run = out / f"anatomy-{device}"
    overrides = [f"training.max_steps={steps}", f"profile.at_step={at}", "profile.steps=5", "eval.every=0",
                 "checkpoint.every=0", "sample.prompts=[]", "eval.tasks=[]", f'hardware.device="{device}"']
    proc = cli("--run", preset, *sets(*overrides), "--out", str(run))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").is_file() else []
    profiled = next((r for r in rows if r["kind"] == "profile"), None)
    if proc.returncode != 0 or profiled is None:
        return False, [f"`lmcockpit --run {preset}`: exit {proc.returncode}, "
                       f"{'a' if profiled else 'no'} profile row", "", "```", tail(proc.stdout + proc.stderr), "```"]
    first, n = profiled["step"], profiled["steps"]
    steps_rows = [r for r in rows if r["kind"] == "step" and first <= r["step"] < first + n]
    parts = {name: sum(r["parts"].get(name, 0.0) for r in steps_rows) for name in steps_rows[0]["parts"]}
    total, wall = sum(parts.values()), profiled["seconds"]
    ratio = total / wall if wall else float("inf")
    ok = len(steps_rows) == n and abs(ratio - 1) <= 0.05
    return ok, [f"`lmcockpit --run {preset}` on {device}, {' '.join('--set ' + o for o in overrides)}: steps "
                f"{first}-{first + n - 1} profiled ({profiled['trace']}).", "",
                "| what | seconds over the profiled steps |", "| --- | ---: |",
                f"| the profiler's wall time (ProfilerStep spans) | {wall:.4f} |",
                f"| the step rows' parts, summed | {total:.4f} ({ratio:.3f}× the profiler's; within 5%: "
                f"{'yes' if ok else 'NO'}) |",
                f"| the step rows' dt, summed | {sum(r['dt'] for r in steps_rows):.4f} |",
                *(f"| part: {name} | {seconds:.4f} |" for name, seconds in parts.items()),
                *(f"| trace: {kind} | {seconds:.4f} |" for kind, seconds in profiled["kinds"].items())]


def part_oom(out: Path) -> tuple[bool, list[str]]:
    import re

    overrides = oom_overrides()
    run = out / "oom"
    proc = cli("--run", "3090", *sets(*overrides), "--out", str(run), timeout=1800)
    output = proc.stdout + proc.stderr
    said = [line for line in output.splitlines() if "out of GPU memory" in line]
    message = said[0] if said else tail(proc.stderr, 3)
    figures = re.search(r"tried to allocate (\S+ \S+) with (\S+ \S+) free of (\S+ \S+)\)", message)
    ok = (proc.returncode == 1 and "Traceback" not in output and len(said) == 1 and figures is not None
          and "in training step 1 " in message and "the allocator's cache " in message
          and "--set training.micro_batch_size=" in message)
    child = subprocess.run([sys.executable, __file__, "--oom-snapshot", "--out", str(out)], capture_output=True,
                           text=True, timeout=1800)
    try:
        snap = json.loads(child.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        snap = {"message": tail(child.stderr, 3), "snapshot": "", "exists": False}
    ok &= snap["exists"]
    return ok, [f"`lmcockpit --run 3090 {' '.join('--set ' + o for o in overrides)}`: exit {proc.returncode}, "
                f"{len(said)} out-of-memory line(s), {'a' if 'Traceback' in output else 'no'} traceback; "
                f"asked, free, capacity: {', '.join(figures.groups()) if figures else 'not found'}.", "",
                "```", message, "```", "",
                f"Recording the allocator's history, the snapshot named: {snap['snapshot'] or 'none'} "
                f"({'written' if snap['exists'] else 'NOT written'}).", "", "```", snap["message"], "```"]


GPT2_PRESET, GPT2_TARGET = "gpt2-fineweb", 3.28
# The rehearsal: the preset at the debug preset's size, on what every machine has (the Hub's FineWeb
# and GPT-2 tokenizer are not), with a target such a run passes about halfway.
GPT2_CPU = ['data.source="python-stdlib"', "data.max_bytes=1_000_000", 'tokenizer.kind="bpe"',
            "tokenizer.vocab_size=512", "tokenizer.train_bytes=300_000", "model.n_layer=2", "model.d_model=64",
            "model.n_head=4", "model.n_kv_head=4", "model.max_seq_len=64", "training.seq_len=64",
            "training.micro_batch_size=8", "training.grad_accum_steps=1", "training.max_steps=60",
            "training.compile=false", "optimizer.warmup_steps=5", "eval.every=5", "eval.batches=4",
            "checkpoint.every=0", "sample.every=0", "sample.prompts=[]", 'hardware.device="cpu"']
GPT2_CPU_TARGET = 5.0


def part_gpt2(out: Path, target: float, overrides: list[str], stop_at_target: bool) -> tuple[bool, list[str]]:
    """The reference run, and when its validation loss first reached `target`."""
    run = out / "gpt2"
    flags = [a for o in overrides for a in ("--set", o)]
    command = shlex.join(["lmcockpit", "--run", GPT2_PRESET, *flags])
    env = {k: v for k, v in os.environ.items() if ALLOCATOR.by_user or k != ALLOCATOR.name}
    # To files, not pipes: hours of progress lines would fill a pipe read only at the end, and a
    # front-end blocked on its output stops the run it reports.
    said = {name: out / f"gpt2.{name}" for name in ("stdout", "stderr")}
    out.mkdir(parents=True, exist_ok=True)
    with open(said["stdout"], "w") as stdout, open(said["stderr"], "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "lmcockpit.tui.cli", "--run", GPT2_PRESET, *flags,
                                 "--out", str(run)], stdout=stdout, stderr=stderr, text=True, env=env)
    stopped = False
    if stop_at_target:
        # Polled, not waited on: the run's own metrics are the only signal there is, and they
        # come every eval.every steps (minutes apart on the GPU).
        while proc.poll() is None:
            if not stopped and (run / "metrics.jsonl").is_file() and any(
                    r.get("val_loss") is not None and r["val_loss"] <= target for r in read_metrics(run, "eval")):
                proc.send_signal(signal.SIGTERM)  # as a user's: the step ends, a checkpoint, exit 130
                stopped = True
            time.sleep(2)
    proc.wait()
    if proc.returncode not in (0, 130) or not (run / "metrics.jsonl").is_file():
        return False, [f"`{command}` failed (exit {proc.returncode}):", "", "```",
                       tail(said["stderr"].read_text() or said["stdout"].read_text()), "```"]
    curves, steps = load_run(run), read_metrics(run, "step")
    first = next((i for i, v in enumerate(curves.val_losses) if v <= target), None)
    dt = statistics.median(r["dt"] for r in steps[10:] or steps)
    started = steps[0]["time"] - steps[0]["dt"]  # the first step's start: data preparation left out
    best = curves.best_val
    if first is None:
        step, tokens, train_s, wall_s = "not reached", "–", "–", "–"
    else:
        at = curves.val_steps[first]
        when = next(r["time"] for r in read_metrics(run, "eval") if r["step"] == at)
        step, tokens = f"{at:,}", fmt_count(at * curves.tokens_per_step)
        train_s, wall_s = fmt_s(curves.val_x("time")[first]), fmt_s(when - started)
    mfus = [r["mfu"] for r in steps[10:] or steps if r["mfu"]]
    mfu = f"{statistics.median(mfus):.1%}" if mfus else "–"  # none on a CPU
    compile_s = max(0.0, steps[0]["dt"] - dt)
    cfg, _ = load_config(run / "config.toml")
    return first is not None, [
        f"`{command}`{' --stop-at-target' if stop_at_target else ''} ({memory_estimate.param_counts(cfg).total / 1e6:.1f}M "
        f"parameters, {cfg.tokens_per_step:,} tokens/step, evaluated every {cfg.eval.every} steps on "
        f"{cfg.eval.batches * cfg.training.micro_batch_size * cfg.training.seq_len:,} held-out tokens; "
        f"{'stopped at the target' if stopped else f'exit {proc.returncode}'}):", "",
        "| target val loss | first reached at step | tokens then | training time to it | wall time to it | "
        "compile (step 1 − median) | steps run | last val loss | best val loss (step) | tokens/s | MFU |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {target:g} | {step} | {tokens} | {train_s} | {wall_s} | {compile_s:.0f} s | {len(steps):,} | "
        f"{curves.val_losses[-1]:.4f} | {best[0]:.4f} ({best[1]:,}) | {curves.median_tokens_per_s:,.0f} | "
        f"{mfu} |" if curves.val_losses else "| | no evaluation was made |",
    ]


def fmt_s(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def fmt_count(n: float) -> str:
    return next((f"{n / unit:.2f}{suffix}" for unit, suffix in ((1e9, "B"), (1e6, "M")) if n >= unit), f"{n:,.0f}")


def part_data() -> tuple[bool, list[str]]:
    """Token-cache preparation where there are many cores: bench/data.py, which records its own
    entry (throughput, ratios, peak memory by process); here, its exit code and its last lines."""
    command = ["bench/data.py", "--size-mb", "500", "--large-mb", "1000", "--rounds", "1", "--skip", "resume",
               "--raw-mb", "200"]
    proc = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=3600,
                          cwd=Path(__file__).parents[1])
    return proc.returncode == 0, [f"`python {' '.join(command)}` exit code {proc.returncode} (its tables: the "
                                  "entry it wrote above):", "", "```", tail(proc.stdout + proc.stderr), "```"]


def part_recipe() -> tuple[bool, list[str]]:
    """Issue 23 on the GPU shapes: throughput and time to quality, each bench recording its own
    entry; here, their exit codes and last lines (the headline ratios)."""
    commands = [
        ["bench/throughput.py", "--device", "cuda", "--precision", "bf16", "--compile", "--preset", "h100",
         "--micro-batch", "8", "--steps", "10", "--warmup", "3"],
        ["bench/convergence.py", "--device", "cuda", "--preset", "h100", "--steps", "300", "--eval-every", "25",
         "--adamw-lrs", "3e-3", "--set", OFFLINE_DATA, "--set", "training.micro_batch_size=8",
         "--set", "training.grad_accum_steps=1", "--set", "optimizer.warmup_steps=20", "--set", "eval.batches=8"],
    ]
    ok, lines = True, []
    for command in commands:
        proc = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=3600,
                              cwd=Path(__file__).parents[1])
        ok &= proc.returncode == 0
        lines += [f"`python {' '.join(command)}` exit code {proc.returncode} (its tables: the entry it wrote above):",
                  "", "```", tail(proc.stdout + proc.stderr, 6), "```", ""]
    return ok, lines


# The allocator part's child: a fresh process, as torch reads the variables once, when CUDA starts.
ALLOCATOR_PROBE = """
import json, torch
x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
segments = torch.cuda.memory_snapshot()
parsed = getattr(torch._C, "_accelerator_getAllocatorSettings", None)  # no public reader; absent before torch 2.12
print(json.dumps({"parsed": parsed() if parsed else None,
                  "expandable": sorted({bool(s["is_expandable"]) for s in segments})}))
"""


def part_allocator() -> tuple[bool, list[str]]:
    lines = ["Both allocator variables set, to opposite `expandable_segments` values, in a fresh process that "
             "allocates 64 MiB on the GPU: the settings torch parsed (`torch._C._accelerator_getAllocatorSettings`) "
             "and whether its segments are expandable (`torch.cuda.memory_snapshot`), against the variable "
             "`gpu_env` names (the engine's allocator line).", "",
             "| PYTORCH_CUDA_ALLOC_CONF | PYTORCH_ALLOC_CONF | gpu_env names | torch parsed | segments expandable | "
             "result |", "| --- | --- | --- | --- | --- | --- |"]
    ok, said = True, []
    for old, new in (("True", "False"), ("False", "True")):
        env = {k: v for k, v in os.environ.items() if k not in gpu_env.ALLOC_VARS}
        env |= {gpu_env.CUDA_VAR: f"expandable_segments:{old}", gpu_env.NEW_VAR: f"expandable_segments:{new}"}
        named = gpu_env.allocator_setting(env, gpu_env.torch_version())
        proc = subprocess.run([sys.executable, "-c", ALLOCATOR_PROBE], capture_output=True, text=True, timeout=300,
                              env=env)
        try:
            seen = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            seen = {"parsed": "–", "expandable": tail(proc.stderr, 1).replace("|", "/")}
        expandable = "expandable_segments:true" in named.value.lower()
        # Where torch cannot say what it parsed, its segments alone say which variable it read.
        good = seen["parsed"] in (None, named.value) and seen["expandable"] == [expandable]
        ok &= good
        parsed = "(this torch cannot say)" if seen["parsed"] is None else seen["parsed"]
        lines.append(f"| {env[gpu_env.CUDA_VAR]} | {env[gpu_env.NEW_VAR]} | {named.name} | {parsed} | "
                     f"{seen['expandable']} | {'pass' if good else 'FAIL'} |")
        said.append(f"* allocator: {named.describe()}")
    return ok, lines + ["", "The allocator lines the engine logs for these:", "", *said]


def part_muon(device: str = "cuda") -> tuple[bool, list[str]]:
    from lmcockpit.core.model.muon import device_iteration_dtype, newton_schulz

    cfg, _ = load_config("h100")
    m, d = cfg.model, cfg.model.d_model
    q, f = m.n_head * cfg.head_dim, cfg.mlp_hidden
    dev = torch.device(device)
    chosen = device_iteration_dtype(dev)
    where = (f"compute capability {torch.cuda.get_device_capability(dev)}" if dev.type == "cuda" else "CPU")
    lines = [f"Newton–Schulz (5 iterations) on 8-matrix stacks of the `h100` preset's shapes, on {device} ({where}; "
             f"Muon iterates in {chosen} here), in each dtype against the same iteration in float64: relative "
             "Frobenius difference and best of 3 times. fp16 (Volta and Turing) wanted no further from float64 "
             "than bf16, finite, and as close for gradients scaled by 1e-6 and 1e6.", "",
             "| stack | dtype | gradient scale | difference | ms |", "| --- | --- | ---: | ---: | ---: |"]
    ok = True
    torch.manual_seed(0)
    for shape in [(8, q, d), (8, f, d), (8, d, f)]:
        G = torch.randn(shape, device=dev)
        refs = {scale: newton_schulz(G.double() * scale, dtype=torch.float64) for scale in (1.0, 1e-6, 1e6)}
        diffs = {}
        for dtype, scale in [(torch.bfloat16, 1.0), (torch.float32, 1.0), (torch.float16, 1.0),
                             (torch.float16, 1e-6), (torch.float16, 1e6)]:
            out, ref = newton_schulz(G * scale, dtype=dtype), refs[scale]  # also the warm-up
            finite = bool(out.isfinite().all())
            diffs[dtype, scale] = float((out.double() - ref).norm() / ref.norm()) if finite else float("inf")
            ms = min(timed(lambda: newton_schulz(G, dtype=dtype), dev) for _ in range(3)) if scale == 1 else None
            lines.append(f"| 8 × {shape[1]}×{shape[2]} | {str(dtype).removeprefix('torch.')} | {scale:g} | "
                         f"{diffs[dtype, scale]:.1e} | {'' if ms is None else f'{ms * 1e3:.1f}'} |")
        fp16 = [diffs[torch.float16, s] for s in (1.0, 1e-6, 1e6)]
        ok &= max(fp16) <= diffs[torch.bfloat16, 1.0] and max(fp16) <= 2 * fp16[0]
    return ok, lines


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def part_nvml() -> tuple[bool, list[str]]:
    """The front-end's CUDA-to-NVML mapping on real hardware: torch's UUIDs must be found among
    NVML's (same format once normalised; a MIG instance among its GPU's instances)."""
    from lmcockpit.core.hardware.device import device_uuids
    from lmcockpit.core.hardware.telemetry import Telemetry, find_gpu, run_gpu_indices

    telemetry = Telemetry()
    reading = telemetry.read()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))
    lines = [f"NVML driver {telemetry.driver or '–'}, {len(reading.gpus)} GPU(s) {telemetry.nvml_error}".rstrip()
             + f"; CUDA_VISIBLE_DEVICES={visible!r}", "",
             "| device | torch name | torch UUID | NVML GPU picked | its UUID | by CUDA numbering alone | same GPU |",
             "| --- | --- | --- | ---: | --- | ---: | --- |"]
    ok = bool(reading.gpus) and bool(devices)
    for device, uuid in zip(devices, device_uuids(devices)):
        picked = run_gpu_indices((device,), visible, (uuid,), reading.gpus)
        by_number = run_gpu_indices((device,), visible, (), reading.gpus)  # what an engine without UUIDs gets
        gpu = find_gpu(reading, picked[0]) if picked else None
        nvml_uuids = {gpu_env.normalise_uuid(u) for u in (gpu.uuid, *gpu.mig_uuids)} if gpu else set()
        same = bool(uuid) and uuid in nvml_uuids
        ok &= same
        lines.append(f"| {device} | {torch.cuda.get_device_name(device)} | {uuid or '–'} | "
                     f"{picked[0] if picked else '–'} | {gpu.uuid if gpu else '–'} | "
                     f"{by_number[0] if by_number else '–'} | {'yes' if same else 'NO'} |")
    lines += ["", "| NVML GPU | name | memory used / total | util | MIG instances |",
              "| ---: | --- | --- | ---: | ---: |"]
    for g in reading.gpus:
        sized = g.mem_used is not None and g.mem_total is not None
        ok &= g.name != "?" and sized
        memory = f"{g.mem_used / GiB:.1f} / {g.mem_total / GiB:.1f} GiB" if sized else "–"
        util = f"{g.util:.0f}%" if g.util is not None else "–"
        lines.append(f"| {g.index} | {g.name} | {memory} | {util} | {len(g.mig_uuids)} |")
    return ok, lines
def part_glance(out: Path, device: str = "cuda", sizes=((80, 24), (100, 30), (120, 40))) -> tuple[bool, list[str]]:
    """The dashboard at a glance with real NVML readings (the tests feed it stand-ins): a short
    debug run on the GPU through the cockpit's own start, read at three terminal sizes."""
    import asyncio

    from lmcockpit.core import protocol as P
    from lmcockpit.core.hardware.telemetry import find_gpu
    from lmcockpit.tui.app import CockpitApp
    from lmcockpit.tui.runplan import RunPlan

    lines = ["| size | step line | GPU bar | NVML util / used | chart cols | side scrolls | ok |",
             "| --- | --- | --- | --- | ---: | --- | --- |"]

    async def watch(size: tuple[int, int]) -> bool:
        cfg, _ = load_config("debug", [OFFLINE_DATA, "training.max_steps=400", "eval.every=0",
                                       f'hardware.device="{device}"'])
        plan = RunPlan(cfg, create_run_dir(cfg, "debug", str(out / f"glance-{size[0]}x{size[1]}")), None, "debug")
        app = CockpitApp(plan, runs_root=out, telemetry=True)
        async with app.run_test(size=size) as pilot:
            dash = app.screen
            deadline = time.monotonic() + 300
            while dash.view.step < 50 and dash.view.state not in P.TERMINAL_STATES and time.monotonic() < deadline:
                await pilot.pause(0.2)
            before = dash.reading
            while dash.reading is before:  # a telemetry sample (1 Hz) taken while it trains
                await pilot.pause(0.1)
            dash.redraw()
            await pilot.pause()
            step = dash.query_one("#stepline").render().plain
            strip = dash.query_one("#devices")
            bar = strip.render().plain
            gpus = dash.gpu_indices()
            g = find_gpu(dash.reading, gpus[0]) if gpus else None
            seen = f"{g.util:.0f}% / {g.mem_used / GiB:.1f}G" if g and g.util is not None and g.mem_used else "–"
            chart = dash.query_one("#loss").region
            scrolls = dash.query_one("#side").max_scroll_y > 0
            good = (g is not None and "MFU" in step and f"GPU{g.index}" in bar and f"{g.mem_used / GiB:.1f}/" in bar
                    and dash.region.contains_region(strip.region) and chart.width >= size[0] / 2 and not scrolls)
            app.save_screenshot(str(out / f"glance-{size[0]}x{size[1]}.svg"))
            lines.append(f"| {size[0]}x{size[1]} | {step} | {bar.splitlines()[0] if bar else '–'} | {seen} | "
                         f"{chart.width} | {'YES' if scrolls else 'no'} | {'yes' if good else 'NO'} |")
            dash.engine.send(P.Abort(save=False))
            while not dash.engine.done:
                await pilot.pause(0.2)
        return good

    ok = all([asyncio.run(watch(size)) for size in sizes])
    return ok, [*lines, "", f"screens: {out}/glance-*.svg"]


ATTENTION_PRESET = "4090"  # 16 query heads sharing 4 K/V heads of 64
# The kernels each path of core/hardware/attention.py expects. SDPA restricted to them raises "No
# available kernel" where the math kernel would otherwise have run without a word.
ATTENTION_KERNELS = {"native-gqa": ("FLASH_ATTENTION", "CUDNN_ATTENTION"), "expand-kv": ("EFFICIENT_ATTENTION",),
                     "math": ("MATH",)}


def hellaswag_shaped(n: int, vocab: int, seed: int = 0):
    """`n` items of HellaSwag's shape as text of token numbers, and the encoder that reads them."""
    import random

    from lmcockpit.core.tasks.items import MULTIPLE_CHOICE, Item, Task

    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(str(rng.randrange(vocab)) for _ in range(k))

    items = tuple(Item((words(rng.randint(40, 110)),), tuple(" " + words(rng.randint(15, 40)) for _ in range(4)),
                       rng.randrange(4)) for _ in range(n))

    def encode(texts: list[str]) -> list[list[int]]:
        return [[int(w) for w in t.split()] for t in texts]

    return Task("hellaswag-shaped", MULTIPLE_CHOICE, items), encode


def part_tasks(device: str = "cuda", items: int = 10_042, rounds: int = 10, per_round: int = 1_000,
               ) -> tuple[bool, list[str]]:
    """Issue 41 on the GPU: HellaSwag's size at the 124M shape in under a minute, and reserved
    memory flat over rounds of scoring."""
    import contextlib

    from lmcockpit.core.model.gpt import GPT, shape_from_config
    from lmcockpit.core.tasks import scoring

    cfg, _ = load_config("gpt2-fineweb")
    dev = torch.device(device)
    torch.manual_seed(0)
    model = GPT(shape_from_config(cfg)).to(dev).eval()
    amp = torch.bfloat16 if dev.type == "cuda" else None

    def autocast():
        return torch.autocast(dev.type, dtype=amp) if amp else contextlib.nullcontext()

    task, encode = hellaswag_shaped(items, cfg.tokenizer.vocab_size)
    rows, max_len = cfg.training.micro_batch_size, cfg.training.seq_len
    t0 = time.perf_counter()
    result = scoring.score_task(task, model, encode, 0, max_len, rows, dev, autocast)
    seconds = time.perf_counter() - t0
    reserved = []
    small = type(task)(task.name, task.kind, task.items[:per_round])
    for _ in range(rounds):
        scoring.score_tasks([small], model, encode, 0, max_len, rows, dev, autocast)
        reserved.append(torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0)
    fast = seconds < 60 or dev.type != "cuda"
    flat = reserved[-1] <= reserved[0]
    return fast and flat, [
        f"{items:,} items of HellaSwag's shape ({4 * items:,} options) at the gpt2-fineweb shape "
        f"({memory_estimate.param_counts(cfg).total / 1e6:.0f}M parameters), {rows} rows of at most {max_len} tokens, "
        f"{'bf16' if amp else 'fp32'} on {device}: **{seconds:.1f} s** ({'under' if seconds < 60 else 'over'} "
        f"the minute), accuracy {result.accuracy:.3f} (random weights: about 0.25)",
        f"reserved memory after each of {rounds} rounds of {per_round:,} items: "
        + ", ".join(f"{r / 2**20:.0f} MiB" for r in reserved) + f" ({'flat' if flat else 'GROWS'})"]


def part_attention(device: str = "cuda") -> tuple[bool, list[str]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lmcockpit.core.hardware import attention
    from lmcockpit.core.hardware.device import attention_header, autocast_dtype, compute_capability
    from lmcockpit.core.train.memory_probe import saved_bytes_per_token

    dev = torch.device(device)
    cc = compute_capability(dev)
    seq, batch = (2048, 4) if device == "cuda" else (128, 2)
    lines = [f"The `{ATTENTION_PRESET}` shape, {batch} × {seq} tokens, eager, compute capability {cc or '–'}, "
             "SDPA restricted to the kernels each path expects. One block's share, 2 layers less 1 (the loss "
             f"and head cancel): its saved bytes per token (hooks) within {SAVED_TOLERANCE:.0%} of memory_estimate.py's "
             f"layer_activation_bytes, and its share of one forward and backward's peak within {TOLERANCE:.0%} "
             "of that count times the tokens; beside it, the fp32 (B, H, T, T) probabilities a math kernel "
             "would have kept per block.", "",
             "| precision | path | kernels allowed | run header | saved / token / block | memory_estimate.py | ratio | "
             "peak / block | memory_estimate.py | ratio | math's probabilities | result |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    ok = True
    for precision in ("bf16", "fp16", "fp32"):
        if device == "cuda" and precision == "bf16" and cc < attention.AMPERE:
            lines.append(f"| bf16 | | | no bf16 before Ampere (sm{cc[0]}{cc[1]}) | | | | | | | | skipped |")
            continue
        cfgs = [load_config(ATTENTION_PRESET, [f"model.n_layer={n}", f"training.seq_len={seq}",
                                               f"training.micro_batch_size={batch}", "training.compile=false",
                                               f'training.precision="{precision}"'])[0] for n in (1, 2)]
        cfg = cfgs[1]
        path = attention.path_for(cfg, device, cc)
        expand, amp, a = path != attention.NATIVE, autocast_dtype(precision), 4 if precision == "fp32" else 2
        counted = memory_estimate.layer_activation_bytes(cfg, a, False, path)
        math_bytes = 4 * cfg.model.n_head * seq * batch * seq
        cells, header, error = [""] * 6, "", ""
        try:
            with sdpa_kernel([getattr(SDPBackend, name) for name in ATTENTION_KERNELS[path]]):
                header = attention_header(cfg, dev, precision)
                one, two = (saved_bytes_per_token(c, device, False, amp, expand_kv=expand) for c in cfgs)
                cells[:3] = [f"{two - one:,.0f}", f"{counted:,}", f"{(two - one) / counted:.3f}"]
                good = abs((two - one) / counted - 1) <= SAVED_TOLERANCE and "warning" not in header
                if device == "cuda":
                    one, two = (attention_pass_peak(c, dev, amp, expand) for c in cfgs)
                    block = counted * batch * seq
                    cells[3:] = [f"{(two - one) / 2**20:,.0f} MiB", f"{block / 2**20:,.0f} MiB",
                                 f"{(two - one) / block:.2f}"]
                    good &= abs((two - one) / block - 1) <= TOLERANCE
        except Exception as e:  # noqa: BLE001 - "No available kernel" is the finding: record it and go on
            good, error = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ok &= good
        lines.append(f"| {precision} | {path} | {', '.join(ATTENTION_KERNELS[path]).lower()} | {header} | "
                     f"{' | '.join(cells)} | {math_bytes / 2**20:,.0f} MiB | {'pass' if good else 'FAIL ' + error} |")
    return ok, lines


def attention_pass_peak(cfg, dev: torch.device, amp: torch.dtype | None, expand_kv: bool) -> int:
    """The most memory one eager forward and backward allocates beyond the weights already there."""
    from lmcockpit.core.model.gpt import GPT, shape_from_config

    torch.manual_seed(0)
    model = GPT(shape_from_config(cfg)).to(dev)
    model.expand_kv = expand_kv
    x = torch.randint(0, cfg.tokenizer.vocab_size, (cfg.training.micro_batch_size, cfg.training.seq_len), device=dev)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    with torch.autocast(dev.type, dtype=amp or torch.float32, enabled=amp is not None):
        loss = model(x, x)
    loss.backward()
    torch.cuda.synchronize(dev)
    return torch.cuda.max_memory_allocated(dev) - base


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", nargs="+", choices=PARTS, default=[p for p in PARTS if p not in ONLY_NAMED])
    ap.add_argument("--steps", type=int, default=300, help="steps of the h100 run (the issue asks for at least 300)")
    ap.add_argument("--presets", nargs="+", default=list(MEMORY_PRESETS), help="the memory part's presets")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="the modes part's compile modes")
    ap.add_argument("--out", type=Path, help="where the runs go (default: a new temporary folder)")
    ap.add_argument("--measure", metavar="PRESET", help=argparse.SUPPRESS)  # part_memory's child process
    ap.add_argument("--oom-snapshot", action="store_true", help=argparse.SUPPRESS)  # part_oom's child process
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: rehearse the saved, graphs, attention and gpt2 parts without a GPU (printed, "
                         "not recorded)")
    ap.add_argument("--target", type=float, help=f"the gpt2 part's validation loss (default {GPT2_TARGET}; on the "
                                                 f"CPU {GPT2_CPU_TARGET})")
    ap.add_argument("--stop-at-target", action="store_true", help="end the gpt2 run when it reaches the target")
    ap.add_argument("--seconds", type=float, help="the speedrun part's training time after its first step "
                                                  "(default 300; on the CPU 20)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="the gpt2 run's own --set (after the rehearsal's, on the CPU)")
    args = ap.parse_args()
    if args.device == "cpu":
        out = args.out or Path(tempfile.mkdtemp(prefix="gpu_check-"))
        ok = True
        for part in (p for p in args.part if p in CPU_PARTS):
            good, lines = {"graphs": lambda: part_graphs(out, args.modes, "cpu"),
                           "saved": lambda: part_saved(args.presets, "cpu"),
                           "attention": lambda: part_attention("cpu"),
                           "tasks": lambda: part_tasks("cpu", items=40, rounds=2, per_round=8),
                           "anatomy": lambda: part_anatomy(out, "cpu"),
                           "gpt2": lambda: part_gpt2(out, args.target or GPT2_CPU_TARGET,
                                                     [*GPT2_CPU, *args.overrides], args.stop_at_target),
                           "speedrun": lambda: part_speedrun(out, args.seconds or 20, args.overrides, "cpu")}[part]()
            print("\n".join(lines) + "\n")
            ok &= good
        return 0 if ok else 1
    if not torch.cuda.is_available():
        print(f"bench/gpu_check.py needs a CUDA GPU, and torch {torch.__version__} sees none here "
              "(`lmcockpit doctor` says why); nothing was run or recorded.", file=sys.stderr)
        return 1
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu_check-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.measure:
        print(json.dumps(measure(args.measure, out)))
        return 0
    if args.oom_snapshot:
        print(json.dumps(oom_snapshot(out)))
        return 0
    results = {}
    for part in args.part:
        run_part = {"doctor": part_doctor, "h100": lambda: part_h100(out, args.steps),
                     "torchrun": lambda: part_h100(out, args.steps, ("--nproc", "1")),
                     "memory": lambda: part_memory(out, args.presets),
                     "saved": lambda: part_saved(args.presets),
                     "graphs": lambda: part_graphs(out, args.modes),
                     "modes": lambda: part_modes(out, args.modes),
                     "inference": part_inference, "resume": lambda: part_resume(out),
                     "ddp": lambda: part_ddp(out), "search": lambda: part_search(out),
                     "allocator": part_allocator, "muon": part_muon, "nvml": part_nvml, "attention": part_attention,
                     "glance": lambda: part_glance(out), "data": part_data, "recipe": part_recipe,
                     "tasks": part_tasks, "anatomy": lambda: part_anatomy(out), "oom": lambda: part_oom(out),
                     "gpt2": lambda: part_gpt2(out, args.target or GPT2_TARGET, args.overrides,
                                               args.stop_at_target),
                     "speedrun": lambda: part_speedrun(out, args.seconds or 300, args.overrides)}[part]
        try:
            ok, lines = run_part()
        except Exception:  # noqa: BLE001 - one part's defect must not cost the lease's other parts
            ok, lines = False, ["raised:", "", "```", tail(traceback.format_exc(), 25), "```"]
        record(f"gpu_check: {part} ({'pass' if ok else 'FAIL'})",
               [*lines, "", f"torch {torch.__version__}; allocator {ALLOCATOR.describe()}"])
        results[part] = ok
    print("gpu_check: " + ", ".join(f"{p} {'pass' if ok else 'FAIL'}" for p, ok in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

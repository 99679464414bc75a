"""gpu_check's `speedrun` part: the gpt2-speedrun preset for a fixed wall time, against a record's log.

Sized to one 10-minute call on one H100/H200 (the device tool's lease): the `gpt2-speedrun` preset
through the real CLI on the shards `prepare` put beside the wheels (the lent machine reaches no
network), stopped (SIGTERM: a checkpoint, exit 130) `--seconds` after its first step, evaluated
every EVAL_EVERY steps on the validation shard's first 10,485,760 tokens, the tokens every record
of modded-nanogpt reports on. It prints, and gpu_check records:

* the run's line: parameters, tokens per step, steps and tokens trained, tokens/s, MFU, the
  compile time, and how many times the run went over its training tokens (the lease carries at
  most 64 MiB, wheels and checkout included: 12M training tokens beside the 10.5M validation ones,
  while five minutes on one H200 train about 150M. Past one pass it trains on tokens seen before,
  which a record never does: up to about four passes cost a model little (Muennighoff et al.,
  "Scaling Data-Constrained Language Models", 2023), past them the comparison and the projection
  are on our side's disadvantage, an upper bound on the loss fresh tokens would give);
* a table, one row per evaluation: step, tokens, the passes over the training tokens those make,
  our validation loss, RECORD's loss at the same
  tokens (interpolated linearly in log-tokens between its evaluations; "–" before its first at
  65.5M tokens), and the difference;
* the time to 3.28 projected from the evaluations by core/run/target.py's fit (a power law in
  tokens with its range), in seconds of this card from the first step, with the record's 8×H100
  time to the same loss beside it.

    python bench/speedrun.py --prepare DIR [--train-tokens N]   # here: fetch and cut the shards
    python bench/gpu_check.py --part speedrun [--seconds 300]   # there (bench/gpu_lease.sh)
    python bench/gpu_check.py --part speedrun --device cpu      # a rehearsal: tiny model, tiny shards

`--device cpu` writes tiny shards and a word-level tokenizer of its own and trains a 2-layer model
for a few seconds: the whole path (CLI, shards, evaluations, table, fit) without a GPU, printed and
not recorded.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PRESET = "gpt2-speedrun"
TARGET = 3.28
EVAL_EVERY = 50  # steps: at ~0.5 s a step on one H200, 4-6 evaluations in the lease's minutes, enough to fit
VAL_TOKENS = 10_485_760
# Where `prepare` puts what the lease carries: beside lmcockpit's wheels (bench/gpu_lease.sh's .whl/).
DATA = Path(__file__).resolve().parents[1] / ".whl" / "speedrun"
DATASET, TOKENIZER_REPO = "kjj0/fineweb10B-gpt2", "openai-community/gpt2"
# The device tool carries 64 MiB in all: the validation tokens (21 MB) and the wheels (~10 MB) leave
# about this many training tokens (2 bytes each).
TRAIN_TOKENS = 12_000_000
MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256

# modded-nanogpt's record of 2024-12-04 (value embeddings; 3.28 in 3.28 minutes on 8×H100): its log
# records/track_1_short/2024-12-04_ValueEmbed/00008ea0-21dd-442a-82ee-d12799249d0f.txt, 8 sequences
# of 64×1024 tokens a step (524,288, the preset's own), validated on the same 10,485,760 tokens.
RECORD = "records/track_1_short/2024-12-04_ValueEmbed/00008ea0-21dd-442a-82ee-d12799249d0f.txt"
RECORD_TOKENS_PER_STEP = 524_288
# (step, val_loss, train_time ms) as its log prints them.
RECORD_EVALS = [(125, 4.3924, 18484), (250, 4.0066, 39289), (375, 3.8207, 60076), (500, 3.7002, 81423),
                (625, 3.6169, 103011), (750, 3.5601, 124536), (875, 3.5149, 146547), (1000, 3.4630, 168778),
                (1125, 3.4034, 190868), (1250, 3.3518, 213470), (1375, 3.3088, 236241), (1500, 3.2776, 258826),
                (1530, 3.2751, 264608)]


# ------------------------------------------------------------------------------------ shards
def write_shard(path: Path, tokens: np.ndarray) -> Path:
    """A shard in modded-nanogpt's format: 256 int32 of header (magic, version, count), uint16 ids."""
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = MAGIC, VERSION, len(tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())
    return path


def first_tokens(path: Path, n: int) -> np.ndarray:
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if header[0] != MAGIC or header[1] != VERSION:
        sys.exit(f"{path}: not a .bin token shard (header {header[0]}, {header[1]})")
    return np.fromfile(path, dtype=np.uint16, count=min(n, int(header[2])), offset=HEADER_INTS * 4)


def prepare(folder: Path, train_tokens: int) -> None:
    """What the lease needs, fetched here: the validation shard's first VAL_TOKENS, the first
    training shard's first `train_tokens`, each rewritten as a shard of its own, and GPT-2's
    tokenizer files."""
    from huggingface_hub import hf_hub_download

    val = first_tokens(Path(hf_hub_download(DATASET, "fineweb_val_000000.bin", repo_type="dataset")), VAL_TOKENS)
    train = first_tokens(Path(hf_hub_download(DATASET, "fineweb_train_000001.bin", repo_type="dataset")),
                         train_tokens)
    write_shard(folder / "val" / "fineweb_val_000000.bin", val)
    write_shard(folder / "train" / "fineweb_train_000001.bin", train)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        got = Path(hf_hub_download(TOKENIZER_REPO, name))
        (folder / "gpt2").mkdir(parents=True, exist_ok=True)
        (folder / "gpt2" / name).write_bytes(got.read_bytes())
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    print(f"speedrun: {len(train):,} training and {len(val):,} validation tokens, GPT-2's tokenizer: "
          f"{size / 2**20:.1f} MiB in {folder}")


def tiny_data(folder: Path) -> None:
    """The CPU rehearsal's data: a word-level tokenizer with <|endoftext|> last, as GPT-2's, and
    shards of documents in it (pairs of words that repeat: something for a loss to learn)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(40)]
    vocab = {w: i for i, w in enumerate(["[UNK]", *words, "<|endoftext|>"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (folder / "gpt2").mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "gpt2" / "tokenizer.json"))
    eot = vocab["<|endoftext|>"]

    def ids(seed: int, docs: int) -> np.ndarray:
        rng = random.Random(seed)
        out = []
        for i in range(docs):
            out += [eot] + [vocab[w] for _ in range(rng.randint(20, 60)) for w in (rng.choice(words[:8]),
                                                                                   words[8 + i % 32])]
        return np.asarray(out)

    write_shard(folder / "train" / "fineweb_train_000001.bin", ids(1, 400))
    write_shard(folder / "val" / "fineweb_val_000000.bin", ids(0, 100))


# -------------------------------------------------------------------------------- the record
def record_loss_at(tokens: float) -> float | None:
    """The record's validation loss at `tokens`, linear in log-tokens between its evaluations;
    None outside them."""
    points = [(step * RECORD_TOKENS_PER_STEP, loss) for step, loss, _ in RECORD_EVALS]
    for (t0, l0), (t1, l1) in zip(points, points[1:]):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (math.log(tokens) - math.log(t0)) / (math.log(t1) - math.log(t0))
    return None


def record_seconds_to(loss: float) -> float | None:
    """The record's training time (8×H100) to `loss`, linear between its evaluations."""
    for (_, l0, ms0), (_, l1, ms1) in zip(RECORD_EVALS, RECORD_EVALS[1:]):
        if l1 <= loss <= l0:
            return (ms0 + (ms1 - ms0) * (l0 - loss) / (l0 - l1)) / 1000
    return None


# ---------------------------------------------------------------------------------- the run
CPU_SETS = ["model.n_layer=2", "model.value_embeds=1", "model.d_model=64", "model.n_head=4", "model.n_kv_head=4",
            "model.max_seq_len=64",
            "training.seq_len=64", "training.micro_batch_size=8", "training.grad_accum_steps=1",
            "training.compile=false", "optimizer.warmup_steps=3", "eval.batches=4", "tokenizer.vocab_size=64",
            'hardware.device="cpu"', "data.val_tokens=4000", "training.log_every=5"]


def run_preset(data: Path, out: Path, seconds: float, overrides: list[str], eval_every: int
               ) -> tuple[subprocess.CompletedProcess | None, int, str]:
    """The preset through the real CLI on `data`, stopped `seconds` after its first step's row;
    (None on success, else the failed process's output), its exit code, the command."""
    from lmcockpit.core.run.folder import read_metrics

    run = out / "speedrun"
    sets = [f'data.source="{data / "train"}"', f'data.val_source="{data / "val" / "fineweb_val_000000.bin"}"',
            f'tokenizer.kind="{data / "gpt2"}"', f'data.cache_dir="{out / "cache"}"', f"eval.every={eval_every}",
            "checkpoint.every=0", *overrides]
    flags = [a for s in sets for a in ("--set", s)]
    command = shlex.join(["lmcockpit", "--run", PRESET, *flags])
    out.mkdir(parents=True, exist_ok=True)
    said = {name: out / f"speedrun.{name}" for name in ("stdout", "stderr")}
    # To files: a front-end blocked on a full pipe would stop the run it reports.
    with open(said["stdout"], "w") as stdout, open(said["stderr"], "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "lmcockpit.tui.cli", "--run", PRESET, *flags, "--out",
                                 str(run)], stdout=stdout, stderr=stderr, text=True)
    first = None
    # Polled: the run's own metrics are the only signal of its first step (compilation takes a minute).
    while proc.poll() is None:
        if first is None and (run / "metrics.jsonl").is_file() and read_metrics(run, "step"):
            first = time.monotonic()
        if first is not None and time.monotonic() - first >= seconds:
            proc.send_signal(signal.SIGTERM)  # as a user's: the step ends, a checkpoint, exit 130
            break
        time.sleep(1)
    proc.wait()
    failed = None
    if proc.returncode not in (0, 130) or not (run / "metrics.jsonl").is_file():
        failed = subprocess.CompletedProcess(proc.args, proc.returncode, said["stdout"].read_text(),
                                             said["stderr"].read_text())
    return failed, proc.returncode, command


def fmt_s(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def fmt_tokens(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M" if n >= 1e6 else f"{n:,.0f}"


def report(run: Path, train_tokens: int, command: str, seconds: float) -> tuple[bool, list[str]]:
    """The run against the record at equal tokens, and the projected time to TARGET."""
    from lmcockpit.core.config import load_config
    from lmcockpit.core.hardware import memory_estimate
    from lmcockpit.core.run.folder import read_metrics
    from lmcockpit.core.run.target import forecast

    cfg, _ = load_config(run / "config.toml")
    steps, evals = read_metrics(run, "step"), [r for r in read_metrics(run, "eval") if r.get("val_loss") is not None]
    per_step = cfg.tokens_per_step
    dt = statistics.median(r["dt"] for r in steps[10:] or steps)
    compile_s = max(0.0, steps[0]["dt"] - dt)
    trained = steps[-1]["step"] * per_step
    mfus = [r["mfu"] for r in steps[10:] or steps if r.get("mfu")]
    started = steps[0]["time"] - steps[0]["dt"]
    lines = [f"`{command}`, stopped {seconds:g} s after its first step ({memory_estimate.param_counts(cfg).total / 1e6:.1f}M "
             f"parameters, {per_step:,} tokens/step; {steps[-1]['step']:,} steps, {fmt_tokens(trained)} tokens, "
             f"{trained / max(train_tokens, 1):.2f} passes over its {fmt_tokens(train_tokens)} training tokens; "
             f"{per_step / dt:,.0f} tokens/s, MFU {statistics.median(mfus) if mfus else 0:.1%}, compile "
             f"{compile_s:.0f} s):", "",
             f"| step | tokens | passes over them | val loss | record at those tokens ({RECORD.split('/')[2]}) | "
             "difference |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for e in evals:
        tokens = e["step"] * per_step
        theirs = record_loss_at(tokens)
        lines.append(f"| {e['step']:,} | {fmt_tokens(tokens)} | {tokens / max(train_tokens, 1):.1f} | {e['val_loss']:.4f} | "
                     + (f"{theirs:.4f} | {e['val_loss'] - theirs:+.4f} |" if theirs is not None else "– | – |"))
    ahead = forecast([(e["step"], e["val_loss"]) for e in evals], TARGET, per_step, 0, dt)
    theirs = record_seconds_to(TARGET)
    if ahead.status == "expected" and ahead.seconds is not None:
        last = next(r["time"] for r in read_metrics(run, "eval") if r["step"] == ahead.at_step) - started
        total = last + ahead.seconds
        spread = "" if ahead.seconds_low is None or ahead.seconds_high is None else (
            f" (range {fmt_s(last + ahead.seconds_low)} to "
            f"{fmt_s(last + ahead.seconds_high) if math.isfinite(ahead.seconds_high) else 'never'})")
        said = (f"projected time to {TARGET} on this card: {fmt_s(total)}{spread} from the first step, at "
                f"~step {ahead.step:,.0f} ({fmt_tokens(ahead.step * per_step)} tokens)")
    else:
        said = f"projected time to {TARGET}: {ahead.short()}"
    lines += ["", said + (f"; the record: {theirs:.0f} s on 8×H100 ({8 * theirs / 60:.1f} GPU-minutes)"
                          if theirs else "") + f" (core/run/target.py's fit of {ahead.evals} evaluations)."]
    return len(evals) >= 2, lines


def part_speedrun(out: Path, seconds: float, overrides: list[str], device: str = "cuda",
                  data: Path = DATA) -> tuple[bool, list[str]]:
    """gpu_check's part: on `device` "cpu", a rehearsal on tiny data of its own."""
    if device == "cpu":
        data = out / "speedrun-data"
        tiny_data(data)
        overrides = [*CPU_SETS, *overrides]
        eval_every = 5
    else:
        eval_every = EVAL_EVERY
        if not (data / "val" / "fineweb_val_000000.bin").is_file():
            return False, [f"no shards in {data}: `bash bench/gpu_lease.sh prepare` fetches them before the lease "
                           "(`python bench/speedrun.py --prepare .whl/speedrun`)"]
    train_tokens = sum((p.stat().st_size - HEADER_INTS * 4) // 2 for p in (data / "train").glob("*.bin"))
    failed, code, command = run_preset(data, out, seconds, overrides, eval_every)
    if failed is not None:
        tail = "\n".join((failed.stderr or failed.stdout).strip().splitlines()[-15:])
        return False, [f"`{command}` failed (exit {code}):", "", "```", tail, "```"]
    return report(out / "speedrun", train_tokens, command, seconds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prepare", type=Path, metavar="DIR", help="fetch and cut the lease's shards into DIR")
    ap.add_argument("--train-tokens", type=int, default=TRAIN_TOKENS, help="training tokens to carry")
    args = ap.parse_args()
    if args.prepare is None:
        ap.error("--prepare DIR: the run itself is `python bench/gpu_check.py --part speedrun`")
    prepare(args.prepare, args.train_tokens)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

"""`lmcockpit presets`: every shipped preset, its size, its estimated peak memory, whether it fits the GPU this machine has, and how long it should train.

Torch-free like the rest of the front-end: parameter counts and memory come from
`core.hardware.memory_estimate`'s arithmetic, the GPU from NVML (`core.hardware.telemetry`). Without a GPU
each preset is judged against the card it was sized for; `--memory GB` judges them all against a
card you are thinking of buying.
"""

from __future__ import annotations

import math

from rich import box
from rich.table import Table

from ...core.config import load_config
from ...core.data import budget as data_budget
from ...core.hardware import memory_estimate
from ...core.hardware.compute_estimate import mfu_rule, training_time
from ...core.hardware.telemetry import Telemetry
from . import command_parser
from ..formatting import DASH
from ..rows import VERDICT_STYLE, preset_rows
from ..usage import Parser, error, new_console


def build_parser() -> Parser:
    parser = command_parser(__name__, description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory", metavar="GB", type=float,
                        help="judge every preset against a GPU with this much memory (GiB) instead of this machine's")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    # NaN compares false with everything and infinity has no byte count: both are refused here.
    if args.memory is not None and not (math.isfinite(args.memory) and args.memory > 0):
        return error(f"--memory {args.memory:g}: expected a positive, finite number of GiB")

    gpu_name = ""  # the GPU the times are for: this machine's, else each preset's own class
    if args.memory is not None:
        card, title = int(args.memory * memory_estimate.GiB), f"verdicts for a GPU with {args.memory:g} GiB"
    else:
        telemetry = Telemetry()
        listed = telemetry.read().gpus
        gpus = [g for g in listed if g.mem_total is not None]  # a card whose memory NVML will not say judges nothing
        if gpus:
            gpu = max(gpus, key=lambda g: g.mem_total)
            card, title = gpu.mem_total, f"verdicts for GPU {gpu.index}: {gpu.name}, {gpu.mem_total / memory_estimate.GiB:.1f} GiB"
            gpu_name = gpu.name
        else:
            card = None
            head = ("NVML will not say the GPU's memory" if listed
                    else f"no GPU found ({telemetry.nvml_error or 'NVML sees none'})")
            title = f"{head}: each preset is judged against the GPU class it was sized for"

    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("preset", "GPU class", "params", "tokens/step", "est. peak", "verdict"):
        numeric = column not in ("preset", "GPU class", "verdict")
        table.add_column(column, no_wrap=True, justify="right" if numeric else "left")
    rows = preset_rows(card)
    for *cells, verdict in rows:
        table.add_row(*cells, f"[{VERDICT_STYLE[verdict]}]{verdict}[/]" if verdict in VERDICT_STYLE else verdict)
    console = new_console()
    console.print(table)
    console.print(epochs_line([row[0] for row in rows]))
    console.print(f"Estimates are memory_estimate.py's arithmetic with a {memory_estimate.HEADROOM:.0%} headroom for \"fits\"; "
                  "`--set training.auto_micro_batch=true` finds the largest micro-batch a card takes.")
    console.print(times_line([row[0] for row in rows], gpu_name))
    for line in target_lines([row[0] for row in rows]):
        console.print(line)
    return 0


# The cards a target's time is given on: the classes the presets are sized for, and the H200.
TARGET_CARDS = ("H100", "H200", "A100 80GB", "RTX 4090", "RTX 3090")


def target_lines(names: list[str]) -> list[str]:
    """The presets with a validation-loss target: their data, token budget and target, and the time
    their steps take on each of TARGET_CARDS (at most that with stop_at_target: the run may get there
    sooner)."""
    lines = []
    for name in names:
        cfg = load_config(name)[0]
        t = cfg.training
        if not t.target_val_loss:
            continue
        kind = {"tokens": ".bin token shards", "chat": "conversations"}.get(cfg.data.format, "text")
        val = (f", validated on {cfg.data.val_tokens:,} tokens of {cfg.data.val_source}" if cfg.data.val_source
               else "")
        times = [f"{took.card_name} {took.short()}" for card in TARGET_CARDS if (took := training_time(cfg, card))]
        lines.append(f"{name}: {cfg.data.source} ({kind}{val}), {t.max_steps * cfg.tokens_per_step / 1e9:.3g}B "
                     f"tokens, target val loss {t.target_val_loss:g}{' (stops there)' if t.stop_at_target else ''}; "
                     f"its steps take {', '.join(times)}.")
    return lines


def times_line(names: list[str], gpu_name: str) -> str:
    """How long each preset's steps should take on `gpu_name`, else on the card it was sized for."""
    parts = []
    for name in names:
        cfg = load_config(name)[0]
        took = training_time(cfg, gpu_name or cfg.hardware.gpu_class)
        parts.append(f"{name} {took.short() if took else DASH}")
    where = f"on {gpu_name}" if gpu_name else "on the card each was sized for"
    return (f"Training time {where} (every step's FLOPs, 6·params + attention per token, over the card's bf16 "
            f"peak at {mfu_rule()} MFU; *: that MFU assumed, no run on the card measured yet; {DASH}: a CPU "
            f"or a card with no known peak): " + ", ".join(parts) + ".")


def epochs_line(names: list[str]) -> str:
    """How often each preset's steps go over its source's tokens, marked past MANY_EPOCHS."""
    parts = []
    for name in names:
        budget = data_budget.estimate(load_config(name)[0])
        text = DASH if budget.epochs is None else f"{budget.epochs:.2g}"
        parts.append(f"{name} [yellow]{text}[/]" if budget.warning() else f"{name} {text}")
    return (f"Epochs of its source each preset's steps make (from the text's size until its token cache exists; "
            f"{DASH}: a Hub source not fetched yet; past {data_budget.MANY_EPOCHS}, in yellow, a model learns its "
            f"corpus by heart): " + ", ".join(parts) + ".")

"""How long a run should take on a card, before it runs: FLOPs per token, the card's peak, an MFU.

The count needs no torch (the launch screen and `lmcockpit presets` never import it): 6·N for the
matmuls of forward and backward plus 12·L·H·Q·T for attention's scores, as the trainer counts its
MFU (core/model/gpt.py's flops_per_token), N from the same parameter count memory_estimate.py
uses. Divided by the card's dense bf16 peak (PEAK_BF16_TFLOPS) times an MFU, it gives seconds.

The MFU is stated, never guessed from nothing: ASSUMED_MFU, until a run of the card's class has
been measured (MEASURED_MFU, from bench/RESULTS.md's GPU runs); an estimate from the assumption is
marked as one wherever it is shown. A CPU has no peak in the table: no estimate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..config import Config
from ..step_schedules import run_tokens
from ..run.target import duration
from .memory_estimate import param_counts

# Dense bf16 tensor-core peak (fp32 accumulate, no sparsity), TFLOP/s, by GPU model: the name CUDA
# reports as `gpu_model` shortens it. Exact names only: a cut-down or laptop part shares its
# desktop sibling's name plus a word ("RTX 4090 D", "RTX 4090 Laptop GPU", "H800 PCIe") and has a
# lower peak, so any model not listed has no peak rather than a wrong one.
# GeForce cards run bf16 with fp32 accumulation at half their fp16-accumulate rate: these are the
# fp32-accumulate figures (RTX 4090: 165, not 330), the ones a training matmul gets.
PEAK_BF16_TFLOPS = {
    "nvidia b200": 2250.0, "nvidia h200": 989.0, "nvidia gh200": 989.0, "nvidia h100": 989.0,
    "nvidia h100 nvl": 835.0, "nvidia h100 pcie": 756.0, "nvidia h800": 989.0,
    "nvidia a100 sxm4": 312.0, "nvidia a100 pcie": 312.0, "nvidia a800 sxm4": 312.0, "nvidia a800 pcie": 312.0,
    "nvidia a40": 149.7, "nvidia a10": 125.0, "nvidia a10g": 70.0, "nvidia rtx a6000": 155.0,
    "nvidia rtx 6000 ada generation": 364.0, "nvidia l40s": 362.0, "nvidia l40": 181.0, "nvidia l4": 121.0,
    "nvidia geforce rtx 4090": 165.0, "nvidia geforce rtx 4080 super": 104.0, "nvidia geforce rtx 4080": 97.5,
    "nvidia geforce rtx 4070 ti super": 88.2, "nvidia geforce rtx 4070 ti": 80.0,
    "nvidia geforce rtx 4070 super": 71.0, "nvidia geforce rtx 4070": 58.0,
    "nvidia geforce rtx 4060 ti": 44.1, "nvidia geforce rtx 4060": 30.2,
    "nvidia geforce rtx 3090 ti": 80.0, "nvidia geforce rtx 3090": 71.0, "nvidia geforce rtx 3080 ti": 68.2,
    "nvidia geforce rtx 3080": 59.5, "nvidia geforce rtx 3070": 40.6, "nvidia geforce rtx 3060 ti": 32.4,
    "nvidia geforce rtx 3060": 25.6,
    # no bf16 on these: their fp16 tensor-core peak, which precision "auto" uses
    "tesla v100 sxm2": 125.0, "tesla v100 pcie": 112.0, "tesla v100s pcie": 130.0, "tesla t4": 65.0,
}


ASSUMED_MFU = 0.40  # what a compiled bf16 run of a small GPT typically reaches on one card
# Measured MFU by card model (gpu_model's names), from bench/RESULTS.md's GPU runs (`gpu_check: h100`):
# the median of a run's steps past compilation, one run per card.
MEASURED_MFU: dict[str, float] = {
    "nvidia h100": 0.49,  # the h100 preset, 100 steps, torch 2.11, compiled, bf16 (2026-11-27)
}


def gpu_model(name: str) -> str:
    """A CUDA device name without what varies within one model: case, hyphens, memory size and
    type ("NVIDIA A100-SXM4-80GB" → "nvidia a100 sxm4", "NVIDIA H100 80GB HBM3" → "nvidia h100")."""
    words = name.replace("-", " ").lower().split()
    return " ".join(w for w in words if not re.fullmatch(r"\d+gb?|hbm\d*e?", w))


def peak_tflops(name: str) -> float | None:
    """The table's dense bf16 peak for a CUDA device name, or None for a model it does not list."""
    return PEAK_BF16_TFLOPS.get(gpu_model(name))


def unknown_peak_note(name: str) -> str:
    return f"MFU: no peak FLOP/s known for {name!r}; MFU is not shown"


def card_model(name: str) -> str | None:
    """The table's model for a CUDA device name or a preset's GPU class ("RTX 4090", "A100 40GB",
    "H100"), or None for one it does not list (a CPU, an unknown card)."""
    for candidate in (name, f"nvidia {name}", f"nvidia geforce {name}", f"nvidia {name} sxm4"):
        if gpu_model(candidate) in PEAK_BF16_TFLOPS:
            return gpu_model(candidate)
    return None


def card_name(model: str) -> str:
    """A table's model as a person names it: "4090", "h100", "a100 sxm4"."""
    return re.sub(r"^(nvidia |tesla )?(geforce )?(rtx )?", "", model)


def mfu_rule() -> str:
    """Which MFU the times use: "49% on h100 (measured), else 40%" (40% alone with none measured)."""
    measured = ", ".join(f"{mfu:.0%} on {card_name(model)}" for model, mfu in sorted(MEASURED_MFU.items()))
    return f"{measured} (measured), else {ASSUMED_MFU:.0%}" if measured else f"{ASSUMED_MFU:.0%}"


def flops_per_token(cfg: Config) -> float:
    """gpt.GPT.flops_per_token from the config: 6 per matmul parameter, 12·H·Q per attended position."""
    m, T = cfg.model, cfg.training.seq_len
    n = param_counts(cfg)
    return 6 * (n.total - n.lookups) + 12 * m.n_head * cfg.head_dim * sum(min(w or T, T) for w in cfg.layer_windows)


@dataclass(frozen=True)
class TrainingTime:
    seconds: float
    card: str  # the table's model it was worked out for
    mfu: float
    measured: bool  # the MFU a run of this card measured, not the assumption

    def short(self) -> str:
        """"~1h21m*": narrow enough for a border beside the token budget (* : the MFU assumed)."""
        return f"~{duration(self.seconds).replace(' ', '')}{'' if self.measured else '*'}"

    @property
    def card_name(self) -> str:
        return card_name(self.card)

    def note(self) -> str:
        how = "measured on this card" if self.measured else "assumed: no run on this card measured yet"
        return f"at {self.mfu:.0%} MFU ({how}) of its {PEAK_BF16_TFLOPS[self.card]:g} TFLOP/s bf16 peak"


def training_time(cfg: Config, card: str) -> TrainingTime | None:
    """The time `cfg`'s steps take on `card` (a device name or a GPU class), all its processes
    together; None for a card without a known peak."""
    model = card_model(card)
    if model is None:
        return None
    measured = model in MEASURED_MFU
    mfu = MEASURED_MFU.get(model, ASSUMED_MFU)
    flops = run_tokens(cfg) * flops_per_token(cfg)  # at the longest length: shorter ones cost a little less
    return TrainingTime(flops / (PEAK_BF16_TFLOPS[model] * 1e12 * mfu * cfg.world), model, mfu, measured)

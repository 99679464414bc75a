"""Which parameters each optimizer owns, and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from ..config import OptimizerConfig
from ..model.muon import Muon
from .group import Group


def split_params(model: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Parameter]], list[tuple[str, torch.nn.Parameter]]]:
    """(Muon's, AdamW's): Muon takes the 2-D matrices inside the blocks; AdamW takes the
    embedding (which is also the tied head: Muon's orthogonal updates suit neither) and norms."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        (muon if p.ndim == 2 and name.startswith("layers.") else adamw).append((name, p))
    return muon, adamw


def build_optimizers(model: torch.nn.Module, cfg: OptimizerConfig, device: torch.device,
                     precision: str = "fp32") -> list[torch.optim.Optimizer]:
    """`precision`, the run's: on a CPU, Muon's Newton–Schulz iterates in bf16 when the run trains
    in bf16 (cpu_precision measured bf16 faster there), else in fp32; on a GPU by its capability."""
    fused = device.type == "cuda"
    if cfg.kind == "adamw":
        opts: list[torch.optim.Optimizer] = [adamw_everything(model, cfg, fused)]
    else:
        muon, adamw = split_params(model)
        opts = [torch.optim.AdamW([p for _, p in adamw], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                  weight_decay=0.0, fused=fused)]
        if muon:
            ns_dtype = torch.bfloat16 if device.type == "cpu" and precision == "bf16" else None
            opts.append(Muon([p for _, p in muon], lr=cfg.muon_lr, momentum=cfg.muon_momentum,
                             weight_decay=cfg.weight_decay, ns_dtype=ns_dtype, coefficients=cfg.muon_coefficients,
                             normuon=cfg.normuon, normuon_beta2=cfg.normuon_beta2))
    set_peak_lrs(opts, cfg)
    return opts


def adamw_everything(model: torch.nn.Module, cfg: OptimizerConfig, fused: bool) -> torch.optim.AdamW:
    """One AdamW for every parameter. Weight decay on the 2-D ones (the embedding, which is also
    the head, and the blocks' matrices), none on the norms' gains: what nanoGPT and transformers'
    Trainer do, so `kind = "adamw"` is the recipe a user would otherwise write by hand."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    keep = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": keep, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, fused=fused)


def describe(opts: list[torch.optim.Optimizer], cfg: OptimizerConfig) -> str:
    """The run header's line: which optimizer holds how many parameters, at what peak rate."""
    def count(opt):
        return sum(p.numel() for g in opt.param_groups for p in g["params"])

    parts = []
    for opt in opts:
        if isinstance(opt, Muon):
            variants = (", Polar Express" if cfg.muon_coefficients == "polar_express" else "") + (
                f", NorMuon beta2 {cfg.normuon_beta2:g}" if cfg.normuon else "")
            parts.append(f"Muon {count(opt):,} (lr {cfg.muon_lr:g}, momentum {cfg.muon_momentum:g}, "
                         f"wd {cfg.weight_decay:g}{variants})")
        else:
            wd = f", wd {cfg.weight_decay:g}" if cfg.kind == "adamw" else ""
            parts.append(f"AdamW {count(opt):,} (lr {cfg.lr:g}, betas {cfg.beta1:g}/{cfg.beta2:g}{wd})")
    return (f"optimizer: {cfg.kind}: " + " + ".join(parts) +
            f"; {cfg.schedule} schedule, warmup {cfg.warmup_steps}")


def schedule_warning(cfg: OptimizerConfig, max_steps: int) -> str | None:
    """The run header's warning for a warmup as long as the run (a preset's warmup kept through
    `--set training.max_steps=50`): the rate never reaches its peak and never decays. Not refused:
    a run of a few steps to try something out is fine, as long as it says what it trains at."""
    if cfg.warmup_steps < max_steps:
        return None
    return (f"warning: optimizer.warmup_steps = {cfg.warmup_steps} is not below training.max_steps = {max_steps}: "
            f"the learning rate rises to {lr_multiplier(max_steps - 1, max_steps, cfg):.2f} of its peak at the "
            "last step and never decays; lower optimizer.warmup_steps for a schedule")


def set_peak_lrs(opts: list[torch.optim.Optimizer], cfg: OptimizerConfig) -> None:
    """The config's peak rates into every group, which the schedule scales. Loading a checkpoint
    brings back the rates it was saved with, and a resume may have lowered them (resume.py)."""
    for opt in opts:
        for group in opt.param_groups:
            group["peak_lr"] = cfg.muon_lr if isinstance(opt, Muon) else cfg.lr


def lr_multiplier(step: int, max_steps: int, cfg: OptimizerConfig) -> float:
    """Share of the peak learning rate at `step` (0-based): linear warmup, then cosine decay to
    `min_lr_ratio`, or warmup-stable-decay with a linear decay over the last `decay_fraction`.
    The decay ends on the last step trained, max_steps - 1: spread to max_steps, it never
    reached its floor (0.111, not 0.1, at the end of 400 WSD steps)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    floor, last = cfg.min_lr_ratio, max_steps - 1
    if cfg.schedule == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * _progress(step, cfg.warmup_steps, last)))
    decay_start = max(cfg.warmup_steps, int(max_steps * (1 - cfg.decay_fraction)))
    if step < decay_start:
        return 1.0
    return floor + (1 - floor) * (1 - _progress(step, decay_start, last))


def _progress(step: int, start: int, end: int) -> float:
    """How far `step` is from `start` (0) to `end` (1); a decay of one step is already at its end."""
    return 1.0 if end <= start else min(1.0, (step - start) / (end - start))


def set_lr(opts: list[torch.optim.Optimizer], multiplier: float) -> None:
    for opt in opts:
        for group in opt.param_groups:
            group["lr"] = group["peak_lr"] * multiplier


def step_optimizers(opts: list[torch.optim.Optimizer], scaler: torch.amp.GradScaler | None, grad_norm: float) -> bool:
    """One step of every optimizer, or, with fp16's loss scaler after gradients that overflowed,
    of none; returns whether they stepped. The scaler checks each optimizer's gradients on its
    own and skips only those with an inf: where only Muon's matrices overflowed, AdamW would still
    step, on gradients the clipping had just multiplied by 1/inf = 0 (moving by its momentum alone),
    and the run's two halves would part. `grad_norm`, over every gradient, is the check for all."""
    if scaler is None:
        for opt in opts:
            opt.step()
        return True
    stepped = math.isfinite(grad_norm)
    if stepped:
        for opt in opts:
            scaler.step(opt)
    scaler.update()  # once a step, from what unscale_ found: the scale halves after an overflow
    return stepped


def clip_grad_norm(params, max_norm: float, group: Group) -> torch.Tensor:
    """Scale gradients down to `max_norm` (0: no clipping); return their total norm. The squares
    are summed in float64, so a norm summed shard by shard (FSDP) and one summed whole give the
    same clipping factor: in float32 their last bits differ, and Muon's bf16 rounding turns that
    into a different run. (Exact on CPU, as tested; CUDA's fused kernel may accumulate each
    tensor's squares in float32 before widening, so on a GPU the two agree to float32 rounding.)"""
    grads = [g.to_local() if isinstance(g, DTensor) else g for g in (p.grad for p in params) if g is not None]
    total = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).square().sum()
    norm = (group.sum(total) if group.sharded else total).sqrt()
    if max_norm > 0:
        torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0).float())
    return norm

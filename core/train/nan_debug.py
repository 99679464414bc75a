"""What a practitioner wants when a loss goes NaN: which tensors went bad first, and the batch.

Called on the step a non-finite loss or gradient norm appears, before any optimizer has touched
the weights, so the parameters it inspects are still those of the last good step. Under FSDP it
sees rank 0's shard of each tensor (no collectives: the other ranks are not taking part).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

from ..run.folder import NAN_DEBUG
from ..run.safe_files import pinned_dir, write_whole
MAX_LISTED = 12


def _counts(t: torch.Tensor) -> tuple[int, int]:
    return int(torch.isnan(t).sum()), int(torch.isinf(t).sum())


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's shard of a sharded (FSDP) tensor; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _named(model: torch.nn.Module):
    for name, p in model.named_parameters():
        yield name, _local(p.detach()), _local(p.grad)


def bad_tensors(model: torch.nn.Module) -> list[dict]:
    """Every parameter or gradient holding NaN or Inf, in the model's order (embedding first)."""
    out = []
    for name, p, grad in _named(model):
        for kind, t in (("parameter", p), ("gradient", grad)):
            if t is None:
                continue
            nans, infs = _counts(t)
            if nans or infs:
                out.append({"name": name, "kind": kind, "shape": list(t.shape), "nan": nans, "inf": infs,
                            "numel": t.numel()})
    return out


def grad_norms(model: torch.nn.Module, top: int = 5) -> list[tuple[str, float]]:
    """The largest finite gradient norms: where the blow-up was heading when it was not NaN yet."""
    norms = [(n, float(g.float().norm())) for n, _, g in _named(model) if g is not None]
    finite = [(n, v) for n, v in norms if v == v and v != float("inf")]
    return sorted(finite, key=lambda nv: -nv[1])[:top]


def param_scales(model: torch.nn.Module, top: int = 3) -> list[tuple[str, float]]:
    """The largest |parameter| values: weights that exploded yet stayed finite show up here."""
    scales = [(n, float(p.abs().max())) for n, p, _ in _named(model) if p.numel()]
    return sorted(scales, key=lambda nv: -nv[1] if nv[1] == nv[1] else float("-inf"))[:top]


def dump(run_dir: Path, step: int, model: torch.nn.Module, batch: list[tuple[torch.Tensor, torch.Tensor]],
         loss: float, grad_norm: float, lr: float) -> tuple[Path, str]:
    """Write nan_debug/step_N/ (report.txt, report.json, batch.pt); return (folder, report text)."""
    folder = Path(run_dir) / NAN_DEBUG / f"step_{step:06d}"
    bad = bad_tensors(model)
    top = grad_norms(model)
    lines = [f"non-finite values at step {step}: loss {loss}, gradient norm {grad_norm}, learning rate {lr:.3g}"]
    if bad:
        lines.append(f"{len(bad)} tensor(s) hold NaN/Inf; the first, in model order:")
        for b in bad[:MAX_LISTED]:
            lines.append(f"  {b['kind']:9s} {b['name']} {tuple(b['shape'])}: {b['nan']} NaN, {b['inf']} Inf "
                         f"of {b['numel']}")
    else:
        lines.append("no parameter or gradient holds NaN/Inf: the loss itself overflowed "
                     "(logits too large for the precision?)")
    if top:
        lines.append("largest finite gradient norms: " + ", ".join(f"{n} {v:.3g}" for n, v in top))
    lines.append("largest |parameter|: " + ", ".join(f"{n} {v:.3g}" for n, v in param_scales(model)))
    lines.append(f"the offending batch is in {folder / 'batch.pt'} (inputs and targets per micro-batch)")
    report = "\n".join(lines)
    saved = io.BytesIO()  # one batch of token ids: small
    torch.save([(x.cpu(), y.cpu()) for x, y in batch], saved)
    # Through folders checked as the user's own and files under fresh names (safe_files): a run
    # folder may be another account's to write in, and a link planted at nan_debug/ is refused.
    with pinned_dir(folder.parent) as parent, pinned_dir(parent / folder.name) as at:
        write_whole(at / "report.txt", report + "\n")
        write_whole(at / "report.json", json.dumps(dict(step=step, loss=loss, grad_norm=grad_norm, lr=lr, bad_tensors=bad,
                                                         top_grad_norms=top), indent=1))
        write_whole(at / "batch.pt", saved.getvalue())
    return folder, report

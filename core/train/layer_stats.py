"""Each block's gradient norm and update-to-weight ratio, every logging.layer_stats_every steps.

On a stats step only, three calls from the trainer's step:

* `before_clip`, once the gradients are whole (all-reduced under DDP, unscaled under fp16): each
  block's gradient norm (under FSDP each rank holds a shard of every block: the squares are summed
  across ranks), and a copy of the block's weights;
* `after_update`, once the optimizers stepped: ||W after - W before|| / ||W before|| over each
  block's parameters, the same way, then one host sync for every figure, and the copies dropped;
* `report`, after the step's row: the `layers` row (P.LayerStats), and the spike watch's word on a
  block whose update jumped (spikes.UpdateRatioWatch).

The embedding (also the head) and the final norm are one more row, `embed_*`. The first two calls'
time is the step's part "layer_stats" (step_clock): the anatomy says what the records cost. On
any other step each call is a comparison and nothing else.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .. import protocol as P
from .spikes import UpdateRatioWatch

PART = "layer_stats"  # the step's part these records take (core/run/anatomy.py labels it)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP parameter or gradient; any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of every element's square (0 for none): each tensor's norm in its own float32, the
    squares summed in float64. Norms taken in float64, as clip_grad_norm takes them, widen each
    tensor into new memory first: on a CPU that took 3.7 to 45 ms of a cpu preset model against
    float32's steady 1.6, and a figure shown to three digits needs no more.
    torch._foreach_norm is what torch.nn.utils.clip_grad_norm_ calls: torch has no public norm of a
    list of tensors in one call (a vector_norm each is a kernel launch per parameter on a GPU)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(torch._foreach_norm(tensors, 2)).double().square().sum()


def short(value: float) -> float:
    """Six significant digits: a row of a model of 48 blocks, every step, stays a few hundred bytes
    a list, and the panel shades a value by its tenth of a decade."""
    return float(f"{value:.6g}")


def row_params(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """The parameters of each block, in order, then the rest (the embedding, the final norm)."""
    blocks = [list(block.parameters()) for block in model.layers]
    inside = {id(p) for params in blocks for p in params}
    return blocks + [[p for p in model.parameters() if id(p) not in inside]]


class LayerStatsTaker:
    """The trainer's part that takes the records (see the module's docstring)."""

    def __init__(self, trainer):
        self.trainer = trainer  # the Trainer whose part this is (its module imports this one)
        self.every = trainer.cfg.logging.layer_stats_every
        self.rows: list[list[torch.nn.Parameter]] | None = None  # once the model is built
        self.taken: tuple[int, torch.Tensor, list[list[torch.Tensor]]] | None = None  # before the update
        self.values: tuple[int, list[float], list[float]] | None = None  # for `report`
        self.watch = UpdateRatioWatch()

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def before_clip(self) -> None:
        """On a stats step: the gradient norms (before clipping) and the weights' copies."""
        tr = self.trainer
        self.taken = self.values = None  # a step that was skipped or rolled back left its own
        if not self.due(tr.step + 1):
            return
        tr.clock.mark("sync")  # the step's own work since its last mark (the loss's mean, fp16's unscale)
        if self.rows is None:
            self.rows = row_params(tr.model)
        grads = torch.stack([squares([local(p.grad) for p in params if p.grad is not None], tr.device)
                             for params in self.rows])
        copies = [[local(p).detach().clone() for p in params] for params in self.rows]
        self.taken = tr.step + 1, grads, copies
        tr.clock.mark(PART)

    def after_update(self) -> None:
        """After the optimizers' step: each row's update over its weights, and every figure read."""
        if self.taken is None:
            return
        tr = self.trainer
        step, grads, copies = self.taken
        self.taken = None
        deltas, weights = [], []
        for params, before in zip(self.rows, copies):
            weights.append(squares(before, tr.device))
            if before:  # the update (negated), in the copies' own memory: new tensors cost 20x the subtraction on a CPU
                torch._foreach_sub_(before, [local(p).detach() for p in params])
            deltas.append(squares(before, tr.device))
        sums = torch.stack([grads, torch.stack(deltas), torch.stack(weights)])
        if tr.group.sharded:
            sums = tr.group.sum(sums)
        grad_sq, delta_sq, weight_sq = sums.tolist()
        ratios = [(d / w) ** 0.5 if w > 0 else 0.0 for d, w in zip(delta_sq, weight_sq)]
        self.values = step, [short(g ** 0.5) for g in grad_sq], [short(r) for r in ratios]
        tr.clock.mark(PART)

    def report(self) -> None:
        """The step's `layers` row, and a warning for a block whose update jumped (rank 0 says it)."""
        if self.values is None:
            return
        tr = self.trainer
        step, norms, ratios = self.values
        self.values = None
        tr.record(P.LayerStats(step, norms[:-1], ratios[:-1], norms[-1], ratios[-1]))
        lines = self.watch.check(step, ratios[:-1], tr.optimizers[0].param_groups[0]["lr"])
        if tr.group.is_main:
            for line in lines:
                tr.log(line)

"""Tasks scored on a model: its options batched into few shapes, their losses, each item's choice.

The options of every item (items.py) are sorted by length and run `rows` at a time, padded to a
multiple of BUCKET tokens (capped at the context) and to `rows` rows: a task costs forward passes
of a handful of shapes, whatever its items, so nothing compiles again per item. The model is the
run's own (`token_scores`, without gradients, in the run's autocast), between steps.

Under several processes each rank scores items rank, rank + world, ...; the choices are summed
across ranks, so every rank ends with every item's. Under FSDP every rank must run as many forward
passes as the others (each gathers shards with them): one short of batches runs padding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from . import items as I

BUCKET = 64  # tokens: a batch is padded to a multiple of this, so few shapes ever run


def score_tasks(tasks: list[I.Task], model: torch.nn.Module, encode: I.Encode, eos: int | None, max_len: int,
                rows: int, device: torch.device, autocast: Callable[[], contextlib.AbstractContextManager],
                group=None, at_most: int = 0) -> dict[str, I.Result]:
    """Each task's result on `model`, over at most `at_most` items of each (0: all)."""
    out = {task.name: score_task(task, model, encode, eos, max_len, rows, device, autocast, group, at_most)
           for task in tasks}
    if device.type == "cuda":  # padded shapes of their own: give their blocks back to training
        torch.cuda.empty_cache()
    return out


@torch.no_grad()
def score_task(task: I.Task, model: torch.nn.Module, encode: I.Encode, eos: int | None, max_len: int, rows: int,
               device: torch.device, autocast, group=None, at_most: int = 0) -> I.Result:
    I.check_special(task, encode)
    rank, world = (group.rank, group.world) if group is not None else (0, 1)
    chosen = I.subset(len(task.items), at_most)
    mine = chosen[rank::world]
    options = [I.sequences(I.option_texts(task, index), encode, eos, max_len) for index in mine]
    # An option met twice is run once: python-functions' neutral `def` line before a body is the
    # same text in every item that offers the body.
    unique: dict[tuple, int] = {}
    for seq in (seq for seqs in options for seq in seqs):
        unique.setdefault((tuple(seq.ids), seq.start), len(unique))
    flat = [I.Tokens(list(ids), start) for ids, start in unique]
    others = group.gather(len(batches_of(flat, rows))) if group is not None and group.sharded else None
    scored = run(flat, model, rows, eos or 0, max_len, device, autocast, max(others) if others else 0)
    picks = torch.zeros(len(chosen), dtype=torch.float64, device=device)
    for k, (index, seqs) in enumerate(zip(mine, options)):
        item_scores = [scored[unique[(tuple(seq.ids), seq.start)]] for seq in seqs]
        picks[rank + k * world] = I.choose(task, task.items[index], item_scores) + 2
    if group is not None:
        picks = group.sum(picks)
    return I.result_of(task, chosen, [int(p) - 2 for p in picks.tolist()])


def batches_of(seqs: list[I.Tokens], rows: int) -> list[list[int]]:
    """Indices of `seqs`, longest first, `rows` to a batch: lengths alike pad little."""
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i].ids))
    return [order[i:i + rows] for i in range(0, len(order), rows)]


def run(seqs: list[I.Tokens], model: torch.nn.Module, rows: int, pad: int, max_len: int, device: torch.device,
        autocast, batches_at_least: int = 0) -> list[I.Scored]:
    """Each option's continuation scored, in `seqs`' order, in at least `batches_at_least` forward
    passes (the other ranks' count, under FSDP: a batch past this rank's own is padding)."""
    scored: list[I.Scored | None] = [None] * len(seqs)
    batches = batches_of(seqs, rows)
    for b in range(max(len(batches), batches_at_least)):
        batch = batches[b] if b < len(batches) else []
        longest = max((len(seqs[i].ids) - 1 for i in batch), default=1)
        width = min(-(-longest // BUCKET) * BUCKET, max_len)
        x = torch.full((rows, width), pad, dtype=torch.long)
        y = torch.full((rows, width), pad, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.bool)
        for r, i in enumerate(batch):
            ids, start = seqs[i].ids, seqs[i].start
            x[r, :len(ids) - 1] = torch.tensor(ids[:-1])
            y[r, :len(ids) - 1] = torch.tensor(ids[1:])
            mask[r, start - 1:len(ids) - 1] = True
        x, y, mask = x.to(device), y.to(device), mask.to(device)
        with autocast():
            losses, hits = model.token_scores(x, y, mask)
        row = mask.nonzero()[:, 0]  # the row of each scored position, as token_scores lists them
        sums = torch.zeros(rows, dtype=torch.float64, device=device).index_add_(0, row, losses.double()).tolist()
        counts = mask.sum(dim=1).tolist()
        hit = torch.zeros(rows, dtype=torch.long, device=device).index_add_(0, row, hits.long()).tolist()
        all_hit = [h == c for h, c in zip(hit, counts)]
        for r, i in enumerate(batch):
            scored[i] = I.Scored(sums[r], int(counts[r]), bool(all_hit[r]))
    return scored

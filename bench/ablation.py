"""The speedrun's techniques one at a time, as runs of bench/convergence.py's one harness (`--ablation`).

Each technique is a row of TECHNIQUES: a name, the `key=value` overrides that switch it on (as
`--set` takes them), and the record of modded-nanogpt's table that brought it in
(docs/training.md, "Model options from the speedrun"). Two sets of runs come from the table, each
lmcockpit's recipe (Muon + AdamW, the preset's settings) beside the harness's other runs, on the
same batches:

* cumulative: the base recipe, then each technique added to all before it (+relu2, +zero-init,
  ...), the order of the table: what the whole stack buys and where it stops paying;
* alone: each technique on the base recipe by itself, so one that hurts is seen as hurting and not
  hidden by the others (the first cumulative run is the first technique alone: run once).

A technique may change only what the harness builds or draws for each run of its own (HONOURED):
the model, the optimizer and its schedule, and whether rows start at a document's beginning. The
rest (the batch's shape, the steps, clipping, precision, the data itself) is one for all runs, so a
technique setting any other key would train as if it were not there; it is refused before
anything trains. Muon's options (Polar Express coefficients, NorMuon) are rows like the
model's; batch and sequence-length schedules (training.*) need the harness to draw each run's
batches by its own schedule first.

The table convergence.py adds to bench/RESULTS.md for them: per run, its final validation loss,
its loss at the baseline's best run's training time (equal time), the time it takes to reach the
baseline's best final loss and that time's ratio to the baseline's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from lmcockpit.core.config import Config


@dataclass(frozen=True)
class Technique:
    name: str
    overrides: tuple[str, ...]
    record: str  # where it came from: modded-nanogpt's record (docs/training.md gives the same numbers)
    why: str = ""  # a value chosen for the cpu preset's scale rather than the record's, and why


TECHNIQUES = (
    # 4·d_model (mlp_hidden = 0), as the record: the cpu preset's SwiGLU of 768 has three matrices,
    # ReLU²'s two of 1024 hold 11 % fewer weights.
    Technique("relu2", ('model.mlp="relu2"', "model.mlp_hidden=0"), "#5",
              "hidden 4·d_model, as the record (the cpu preset's SwiGLU has 768)"),
    Technique("zero-init", ("model.zero_init_proj=true",), "#5"),
    Technique("untied head", ("model.tie_embeddings=false",), "#8"),
    # The cpu preset's model after its 300 steps has logits of at most 13 (12 at the 99th
    # percentile of positions, on stdlib code): a cap of 30 would move them by under 1; 15, the
    # record's later value (record 18), acts on them. 30 alone is in ALONE_ONLY.
    Technique("softcap 15", ("model.logit_softcap=15",), "#9 at 30, #18 at 15",
              "the cpu preset's largest logits are ~13 after its 300 steps: a cap of 30 would hardly touch them"),
    # One table for 4 layers: the first and the last layer get it, half the layers, as the
    # record's 3 tables reach 6 of its 12.
    Technique("value embeds", ("model.value_embeds=1",), "#14-#20", "1 table: half of 4 layers, as 3 of 12"),
    Technique("U-net skips", ("model.unet_skips=true",), "#11"),
    # At a context of 256 the long layers (the first and last of 4) see all of it; the short ones
    # half of it, the record's ratio of short to long.
    Technique("windows", ("model.window=0", "model.short_window=128"), "#12, #13, #16, #20",
              "long layers the whole 256, short ones 128 (the record's half)"),
    Technique("BOS-aligned", ("data.bos_aligned=true",), "later records (docs/data.md)"),
    Technique("Polar Express", ('optimizer.muon_coefficients="polar_express"',), "later records (docs/training.md)"),
    Technique("NorMuon", ("optimizer.normuon=true",), "later records (docs/training.md)"),
)

# Alone on the base only: a variant of a technique above at the record's own value.
ALONE_ONLY = (
    Technique("softcap 30", ("model.logit_softcap=30",), "#9", "the record's own value (the cumulative runs take 15)"),
)

# The keys (or sections, ending in ".") the harness reads from each run's own config.
HONOURED = ("model.", "optimizer.", "data.bos_aligned")


@dataclass(frozen=True)
class Variant:
    """One run of the ablation: its row's name, "cumulative" or "alone", the techniques it has."""
    name: str
    kind: str
    techniques: tuple[Technique, ...]

    @property
    def overrides(self) -> list[str]:
        return [o for t in self.techniques for o in t.overrides]


def chosen(names: str | None) -> list[Technique]:
    """The techniques `--techniques` names (comma-separated, in the table's order), all without it."""
    every = TECHNIQUES + ALONE_ONLY
    if not names:
        return list(every)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {t.name for t in every}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(f"--techniques: unknown {', '.join(map(repr, unknown))}; "
                         f"expected names from: {', '.join(t.name for t in every)}")
    return [t for t in every if t.name in wanted]


def stacks(specs: list[str]) -> list[Variant]:
    """`--stack` runs: each spec names techniques joined by "+", trained together on the base recipe
    (a candidate preset's options in one run, without the cumulative rows leading up to it)."""
    every = {t.name: t for t in TECHNIQUES + ALONE_ONLY}
    runs = []
    for spec in specs:
        names = [n.strip() for n in spec.split("+") if n.strip()]
        unknown = [n for n in names if n not in every]
        if unknown or not names:
            raise SystemExit(f"--stack {spec!r}: unknown {', '.join(map(repr, unknown)) or 'nothing named'}; "
                             f"expected names from: {', '.join(every)}, joined by +")
        runs.append(Variant(" + ".join(names), "stack", tuple(every[n] for n in names)))
    return runs


def variants(techniques: list[Technique]) -> list[Variant]:
    """The cumulative runs (ALONE_ONLY's left out), then the alone ones, of `techniques`."""
    stacked = [t for t in techniques if t not in ALONE_ONLY]
    runs = [Variant("+" + t.name + (" (= alone)" if i == 0 else ""), "cumulative", tuple(stacked[:i + 1]))
            for i, t in enumerate(stacked)]
    runs += [Variant(t.name + " alone", "alone", (t,)) for t in techniques if not (stacked and t is stacked[0])]
    return runs


def configs(variants_: list[Variant], configure: Callable[[list[str]], Config]) -> list[tuple[Variant, Config]]:
    """Each variant's config, `configure` given its overrides (the preset's loader, so a bad value
    is the config's own error); a key the harness would not honour is refused."""
    for v in variants_:
        for key in (o.split("=", 1)[0].strip() for o in v.overrides):
            if not any(key == k or k.endswith(".") and key.startswith(k) for k in HONOURED):
                raise SystemExit(f"--ablation: {v.name} sets {key}, which every run of the harness shares (the "
                                 f"same batches, steps, clipping and precision); a technique may set "
                                 f"{', '.join(k + '*' if k.endswith('.') else k for k in HONOURED)}")
    return [(v, configure(v.overrides)) for v in variants_]


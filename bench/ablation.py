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
model's. The batch and sequence-length schedules are honoured as the engine honours them: a step
of such a run takes the first micro-batches its share says, each cut to the step's length, of the
batches every run draws (its other shapes compiled before the clock too); a batch share of a half
needs two micro-batches, so with it every run's step is split in two (`split`).

The table convergence.py adds to bench/RESULTS.md for them: per run, its final validation loss,
its loss at the baseline's best run's training time (equal time), the time it takes to reach the
baseline's best final loss and that time's ratio to the baseline's own.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from typing import Callable

from lmcockpit.core.config import Config, ConfigError


@dataclass(frozen=True)
class Technique:
    name: str
    overrides: tuple[str, ...]
    record: str  # where it came from: modded-nanogpt's record (docs/training.md gives the same numbers)
    why: str = ""  # a value chosen for the cpu preset's scale rather than the record's, and why
    accum: int = 1  # the micro-batches a step must have for its batch shares to be whole ones


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
    # Half the step's sequences for the first half: the shares must make whole micro-batches, so
    # with it every run of the harness splits its step in two (`split`), the same rows a step.
    Technique("batch schedule", ("training.batch_schedule=[[0.0, 0.5], [0.5, 1.0]]",), "later records",
              "half the sequences for the first half of the steps (the record grows its batch in stages)", accum=2),
    Technique("seq schedule", ("training.seq_len_schedule=[[0.0, 128], [0.5, 256]]",), "later records",
              "a context of 128 for the first half of the steps, then the preset's 256"),
    # The records' learning rate where llm.c's baseline warmed up and decayed by a cosine: Muon's
    # runs start at the peak, which holds until a linear cooldown over the last 40 % to a tenth.
    Technique("no warmup", ("optimizer.warmup_steps=0",), "#4 (warmup_iters = 0)"),
    Technique("stable-decay", ('optimizer.schedule="wsd"', "optimizer.decay_fraction=0.4"),
              "#2 (trapezoidal), cooldown_frac 0.4 from 2025"),
)

# Alone on the base only (or in a --stack): a variant of a technique above.
ALONE_ONLY = (
    Technique("softcap 30", ("model.logit_softcap=30",), "#9", "the record's own value (the cumulative runs take 15)"),
    Technique("seq schedule 64", ("training.seq_len_schedule=[[0.0, 64], [0.25, 128], [0.5, 256]]",), "later records",
              "the first quarter of the steps at a context of 64, the second at 128, then 256"),
)

# The keys (or sections, ending in ".") the harness reads from each run's own config.
HONOURED = ("model.", "optimizer.", "data.bos_aligned", "training.batch_schedule", "training.seq_len_schedule")


def before(cfg: Config) -> list[str]:
    """The overrides that take `cfg` back to the recipe before the speedrun's techniques: each
    technique's key at its default, and a SwiGLU of ¾ a ReLU² preset's hidden width (the parameters
    it had: the cpu preset's 768 against ReLU²'s 1024). The baseline's shape is always this one, and
    the ablation's base run this recipe, whatever of it a preset has switched on since."""
    m = cfg.model
    off = ['model.mlp="swiglu"', f"model.mlp_hidden={round(cfg.mlp_hidden * 3 / 4 / 64) * 64}"] if m.mlp == "relu2" else []
    return off + ["model.zero_init_proj=false", "model.tie_embeddings=true", "model.logit_softcap=0",
                  "model.value_embeds=0", "model.unet_skips=false", "model.window=0", "model.short_window=0",
                  "data.bos_aligned=false", 'optimizer.muon_coefficients="quintic"', "optimizer.normuon=false",
                  "optimizer.warmup_steps=20", 'optimizer.schedule="cosine"', "optimizer.decay_fraction=0.2",
                  "training.batch_schedule=[]", "training.seq_len_schedule=[]"]


def switched_on(cfg: Config) -> list[str]:
    """The techniques `cfg` has on, as the table sets them (a width beside ReLU² aside)."""
    def holds(override: str) -> bool:
        key, value = (part.strip() for part in override.split("=", 1))
        section, name = key.split(".")
        return key == "model.mlp_hidden" or getattr(getattr(cfg, section), name) == tomllib.loads(f"v = {value}")["v"]
    return [t.name for t in TECHNIQUES if all(holds(o) for o in t.overrides)]


def split(techniques, cfg: Config) -> list[str]:
    """The overrides that give every run the micro-batches `techniques`' batch shares need (the
    same rows a step, in more micro-batches of fewer rows), or none where the preset has them."""
    need = max([t.accum for t in techniques] + [1])
    t = cfg.training
    if t.grad_accum_steps % need == 0:
        return []
    rows = t.micro_batch_size * t.grad_accum_steps
    if rows % need:
        raise SystemExit(f"--ablation: a batch schedule needs {need} micro-batches a step; the preset's "
                         f"{rows} rows a step do not split so")
    return [f"training.micro_batch_size={rows // need}", f"training.grad_accum_steps={need}"]


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
    try:
        return [(v, configure(v.overrides)) for v in variants_]
    except ConfigError as e:  # the technique's value does not suit this preset: the config's own words
        raise SystemExit(f"--ablation: {v.name}: {e}") from None


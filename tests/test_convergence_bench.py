"""bench/convergence.py runs end to end at a tiny size (so it cannot rot), with and without its
ablation (bench/ablation.py); its figures come only from the full run, recorded in bench/RESULTS.md.
Its arithmetic is checked on made-up curves."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
import ablation  # noqa: E402 - from bench/, put on sys.path above
import convergence  # noqa: E402

from lmcockpit.core.config import load_config  # noqa: E402
from lmcockpit.core.data import batches  # noqa: E402
from lmcockpit.core.data.prepare import prepare  # noqa: E402


def run_of(kind: str, evals: list[tuple[int, float, float]]) -> convergence.Run:
    return convergence.Run(kind, kind, "1e-3", None, None, None, [], seconds=evals[-1][1], evals=evals)


def test_time_to_reach_a_loss_is_interpolated_between_evaluations():
    run = run_of("muon", [(10, 2.0, 5.0), (20, 4.0, 4.0), (30, 6.0, 3.0)])
    assert convergence.seconds_to_reach(run, 3.5) == pytest.approx(5.0)
    assert convergence.seconds_to_reach(run, 4.0) == pytest.approx(4.0)
    assert convergence.seconds_to_reach(run, 6.0) == pytest.approx(2.0)  # reached by the first evaluation
    assert convergence.seconds_to_reach(run, 2.9) is None


def test_the_loss_at_a_time_is_interpolated_and_held_after_the_end():
    run = run_of("muon", [(10, 2.0, 5.0), (20, 4.0, 4.0)])
    assert convergence.loss_at(run, 1.0) is None  # before the first evaluation
    assert convergence.loss_at(run, 2.0) == 5.0
    assert convergence.loss_at(run, 3.0) == pytest.approx(4.5)
    assert convergence.loss_at(run, 9.0) == 4.0


def test_the_best_run_of_a_kind_is_the_lowest_final_loss():
    runs = [run_of("baseline", [(1, 1.0, 4.2)]), run_of("baseline", [(1, 1.0, 3.9)]), run_of("muon", [(1, 1.0, 3.0)])]
    assert convergence.best(runs, "baseline") is runs[1]


@pytest.mark.slow
def test_the_bench_runs_end_to_end_and_records_every_run(tmp_path):
    results = tmp_path / "RESULTS.md"
    proc = subprocess.run([sys.executable, str(BENCH / "convergence.py"), "--preset", "debug", "--steps", "6",
                           "--eval-every", "3", "--lrs", "0.003,0.01,0.03", "--adamw-lrs", "0.01",
                           "--results", str(results)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = results.read_text()
    assert "## convergence: time to quality against transformers + AdamW" in text
    finals = {}
    for name in ["lmcockpit, Muon + AdamW", "lmcockpit, AdamW, lr 0.01", "transformers Qwen3 + AdamW, lr 0.003",
                 "transformers Qwen3 + AdamW, lr 0.01", "transformers Qwen3 + AdamW, lr 0.03"]:
        row = re.search(rf"^\| {re.escape(name)}( \*\*\(best of its kind\)\*\*)? \| [^|]+ \| (\d+\.\d+) \|", text, re.M)
        assert row, (name, text)
        finals[name] = (float(row[2]), bool(row[1]))
    baselines = {n: v for n, v in finals.items() if n.startswith("transformers")}
    best = min(baselines, key=lambda n: baselines[n][0])
    assert [n for n, (_, starred) in baselines.items() if starred] == [best]
    # equal steps: every evaluation, the three best of their kinds; the target is the best baseline's final loss
    assert re.search(r"^\| 6 \| \d+\.\d+ \| \d+\.\d+ \| \d+\.\d+ \|$", text, re.M), text
    assert f"best final validation loss, {baselines[best][0]:.3f}:" in text
    assert re.search(r"^\| transformers \+ AdamW \(best lr\) \| [\d.]+ s \| 1\.00× \|$", text, re.M), text
    assert re.search(r"\*\*Headline: lmcockpit (reaches it in \d+\.\d+×|does not reach it)", text)


def test_the_ablation_stacks_each_technique_and_runs_each_alone_once():
    relu2, untied, cap30 = ablation.chosen("relu2,untied head,softcap 30")
    runs = ablation.variants([relu2, untied, cap30])
    assert [(v.name, v.kind, v.overrides) for v in runs] == [
        ("+relu2 (= alone)", "cumulative", ['model.mlp="relu2"', "model.mlp_hidden=0"]),
        ("+untied head", "cumulative", ['model.mlp="relu2"', "model.mlp_hidden=0", "model.tie_embeddings=false"]),
        ("untied head alone", "alone", ["model.tie_embeddings=false"]),
        ("softcap 30 alone", "alone", ["model.logit_softcap=30"]),  # a variant of softcap 15: never stacked
    ]
    assert [t.name for t in ablation.chosen(None)] == [t.name for t in ablation.TECHNIQUES + ablation.ALONE_ONLY]


def test_a_stack_trains_its_techniques_together_on_the_base_recipe():
    [both, one] = ablation.stacks(["relu2 + value embeds", "NorMuon"])
    assert (both.name, both.kind, both.overrides) == (
        "relu2 + value embeds", "stack", ['model.mlp="relu2"', "model.mlp_hidden=0", "model.value_embeds=1"])
    assert (one.name, one.overrides) == ("NorMuon", ["optimizer.normuon=true"])
    [(_, cfg)] = ablation.configs([both], lambda extra: load_config("debug", extra)[0])
    assert (cfg.model.mlp, cfg.model.value_embeds, cfg.optimizer.normuon) == ("relu2", 1, False)
    with pytest.raises(SystemExit, match=r"--stack 'relu2\+relu3': unknown 'relu3'; expected names from: relu2, "):
        ablation.stacks(["relu2+relu3"])


# The cpu preset's layers and context (the windows are sized to them), narrower, a smaller vocabulary
# and 300 steps (the schedules' stages below are counted in them).
SHRINK = ["model.d_model=64", "tokenizer.vocab_size=512", "training.compile=false", "training.max_steps=300"]


def plain_cpu(techniques=()) -> list[str]:
    """The shrunk cpu preset's overrides as main() makes them: the micro-batches `techniques` need,
    then back to the recipe before the techniques (the preset ships some of them on)."""
    shrink = SHRINK + ablation.split(techniques, load_config("cpu", SHRINK)[0])
    return shrink + ablation.before(load_config("cpu", shrink)[0])


def test_each_technique_reaches_the_model_it_trains_at_the_cpu_presets_context():
    every_technique = ablation.TECHNIQUES + ablation.ALONE_ONLY
    # The batch schedule's halves need two micro-batches: every run gets them, the same 16 rows a step.
    assert ablation.split(every_technique, load_config("cpu", SHRINK)[0]) == [
        "training.micro_batch_size=8", "training.grad_accum_steps=2"]
    shrink = plain_cpu(every_technique)
    base, _ = load_config("cpu", shrink)
    variants = ablation.configs(ablation.variants(ablation.chosen(None)),
                                lambda extra: load_config("cpu", shrink + extra)[0])
    runs = {r.name: r for r in convergence.build_runs(base, torch.device("cpu"), "fp32", [], [], variants)}

    def has(run, name: str) -> bool:  # the technique `name` is in the model (or the rows) `run` trains
        model, first = run.model, run.model.layers[0]
        muon = next(opt.param_groups[0] for opt in run.opts if "coefficients" in opt.param_groups[0])
        return {"relu2": not hasattr(first.mlp, "gate_proj"),
                "zero-init": not first.self_attn.o_proj.weight.any() and not first.mlp.down_proj.weight.any(),
                "untied head": model.lm_head is not None,
                "softcap 15": model.shape.logit_softcap == 15,
                "softcap 30": model.shape.logit_softcap == 30,
                "value embeds": model.value_embeds is not None and len(model.value_embeds) == 1,
                "U-net skips": model.skip_weights is not None,
                "windows": [layer.self_attn.window for layer in model.layers] == [0, 128, 128, 0],
                "BOS-aligned": run.feed,
                "Polar Express": muon["coefficients"] == "polar_express",
                "NorMuon": muon["normuon"],
                "batch schedule": [run.plan.accum_at(s) for s in (0, 149, 150, 299)] == [1, 1, 2, 2],
                "seq schedule": [run.plan.seq_len(s) for s in (0, 149, 150, 299)] == [128, 128, 256, 256],
                "seq schedule 64": [run.plan.seq_len(s) for s in (0, 74, 75, 149, 150)] == [64, 64, 128, 128, 256],
                # the learning rate the harness steps `run` at (of 300 steps): at the peak from the
                # first step; held at it until the last 40 % (a cosine is at 0.45 by step 179)
                "no warmup": run.lr_multiplier(0) == 1.0,
                "stable-decay": [run.lr_multiplier(s) for s in (179, 299)] == [1.0, 0.1]}[name]

    every = [t.name for t in every_technique]
    assert not any(has(runs["lmcockpit, Muon + AdamW"], name) for name in every)
    for i, name in enumerate(t.name for t in ablation.TECHNIQUES):  # each stacked run has its own and those above
        run = runs[f"+{name}" + (" (= alone)" if i == 0 else "")]
        stacked = [j <= i and t not in ablation.ALONE_ONLY for j, t in enumerate(every_technique)]
        assert [has(run, n) for n in every] == stacked, name
    for name in every[1:]:  # each alone run has its own only
        assert [has(runs[f"{name} alone"], n) for n in every] == [n == name for n in every], name


def test_the_baseline_and_the_ablations_base_are_the_recipe_before_the_techniques():
    cfg, _ = load_config("cpu", SHRINK)  # as it ships (#55)
    assert ablation.switched_on(cfg) == ["relu2", "zero-init", "value embeds", "U-net skips", "NorMuon", "seq schedule"]
    plain, _ = load_config("cpu", SHRINK + ablation.before(cfg))
    # The cpu preset as it was before them: SwiGLU of 768, the whole context from the first step.
    assert ablation.switched_on(plain) == [] and (plain.model.mlp, plain.mlp_hidden) == ("swiglu", 768)
    assert plain.training.seq_len_schedule == [] and not plain.optimizer.normuon
    assert (plain.optimizer.schedule, plain.optimizer.warmup_steps) == ("cosine", 20)  # llm.c's, as before the records
    assert (plain.data, plain.tokenizer, plain.training.max_steps) == (cfg.data, cfg.tokenizer, cfg.training.max_steps)
    ours, theirs = convergence.build_runs(cfg, torch.device("cpu"), "fp32", [1e-3], [], baseline_cfg=plain)
    assert not hasattr(ours.model.layers[0].mlp, "gate_proj")  # ours: the preset as it ships
    assert theirs.model.config.intermediate_size == 768 and theirs.cfg is plain


def test_a_scheduled_run_trains_on_its_steps_share_and_length_of_the_shared_batches():
    shrink = plain_cpu(ablation.chosen("batch schedule"))
    base, _ = load_config("cpu", shrink)
    variants = ablation.configs(ablation.stacks(["batch schedule+seq schedule"]),
                                lambda extra: load_config("cpu", shrink + extra)[0])
    plain, scheduled = convergence.build_runs(base, torch.device("cpu"), "fp32", [], [], variants)
    micro = [(torch.zeros(8, 256, dtype=torch.long) + i, torch.ones(8, 256, dtype=torch.long)) for i in range(2)]
    for step, (accum, length) in [(0, (1, 128)), (149, (1, 128)), (150, (2, 256)), (299, (2, 256))]:
        rows = convergence.step_rows(scheduled, step, micro)
        assert [(int(x[0, 0]), tuple(x.shape), tuple(y.shape)) for x, y in rows] == [
            (i, (8, length), (8, length)) for i in range(accum)]
        assert [tuple(x.shape) for x, _ in convergence.step_rows(plain, step, micro)] == [(8, 256), (8, 256)]
    # Its tokens: a quarter of the full steps' in the first half (half the rows of half the length).
    assert (plain.tokens, scheduled.tokens) == (300 * 16 * 256, 150 * 8 * 128 + 150 * 16 * 256)


def test_an_unknown_technique_or_one_the_harness_would_not_honour_is_refused():
    with pytest.raises(SystemExit, match=r"--techniques: unknown 'relu3'; expected names from: relu2, "):
        ablation.chosen("relu2,relu3")
    # Every run steps on batches of one shape: a technique's own seq_len would train as if unset.
    longer = ablation.Variant("+longer", "cumulative", (ablation.Technique("longer", ("training.seq_len=32",), "-"),))
    with pytest.raises(SystemExit, match=r"--ablation: \+longer sets training.seq_len, which every run of the "
                                         r"harness shares .*; a technique may set model.\*, optimizer.\*, "
                                         r"data.bos_aligned, training.batch_schedule, "
                                         r"training.seq_len_schedule$"):
        ablation.configs([longer], lambda extra: load_config("debug", extra)[0])
    muon = ablation.Technique("muon lr", ("optimizer.muon_lr=0.02",), "-")
    [(_, cfg)] = ablation.configs([ablation.Variant("+muon lr", "cumulative", (muon,))],
                                  lambda extra: load_config("debug", extra)[0])
    assert cfg.optimizer.muon_lr == 0.02


@pytest.mark.slow
def test_the_ablation_trains_each_technique_on_its_own_model_and_rows(tmp_path):
    results = tmp_path / "RESULTS.md"
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:  # in this process, to see the runs' models: the harness sets what the engine sets on a CPU
        runs = convergence.main(["--preset", "debug", "--steps", "4", "--eval-every", "2", "--lrs", "0.01",
                                 "--adamw-lrs", "", "--ablation", "--techniques", "relu2,BOS-aligned",
                                 "--results", str(results)])
    finally:
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
    by_name = {r.name: r for r in runs}
    text = results.read_text()
    assert "## convergence: time to quality against transformers + AdamW, the speedrun's techniques one by one" in text
    assert "| run | overrides | record | final val loss | Δ | loss at equal time | time to quality " \
           "| vs the baseline | tokens/s |" in text
    number, ratio = r"\d+\.\d+", r"(\d+\.\d+×|not reached)"
    for row_name, run_name, overrides in [
            ("base: lmcockpit Muon + AdamW", "lmcockpit, Muon + AdamW", ""),
            ("+relu2 (= alone)", "+relu2 (= alone)", '`model.mlp="relu2"`, `model.mlp_hidden=0`'),
            ("+BOS-aligned", "+BOS-aligned", "`data.bos_aligned=true`"),
            ("BOS-aligned alone", "BOS-aligned alone", "`data.bos_aligned=true`")]:
        row = re.search(rf"^\| {re.escape(row_name)} \| {re.escape(overrides)} \| [^|]* \| ({number}) \| "
                        rf"(–|[+-]{number}) \| {number} \| [^|]+ \| {ratio} \| [\d,]+ \|$", text, re.M)
        assert row, (row_name, text)
        assert row[1] == f"{by_name[run_name].final:.3f}"
    assert re.search(r"^\*\*Ablation: (.+ reaches it in \d+\.\d+×|no run of the ablation reaches it)", text, re.M)

    def mlps(run):
        return [layer.mlp for layer in run.model.layers]

    base, relu2 = by_name["lmcockpit, Muon + AdamW"], by_name["+relu2 (= alone)"]
    stacked, aligned = by_name["+BOS-aligned"], by_name["BOS-aligned alone"]
    assert all(hasattr(m, "gate_proj") for m in mlps(base) + mlps(aligned))
    assert not any(hasattr(m, "gate_proj") for m in mlps(relu2) + mlps(stacked))  # relu2 stays in the stack
    assert relu2.model.layers[0].mlp.up_proj.out_features == 4 * 64  # mlp_hidden = 0: 4·d_model
    assert (base.feed, relu2.feed, stacked.feed, aligned.feed) == (False, False, True, True)
    # The aligned runs' rows start at a document's beginning, the others' anywhere.
    cfg, _ = load_config("debug", [])
    data = prepare(cfg, lambda line: None, lambda *a: None)
    feeds = convergence.feeds_for(runs, data)
    x, _ = batches.get_batch(feeds[True], cfg.training.seed, 0, 8, cfg.training.seq_len)
    assert (x[:, 0] == data.eos_id).all()
    x, _ = batches.get_batch(feeds[False], cfg.training.seed, 0, 8, cfg.training.seq_len)
    assert not (x[:, 0] == data.eos_id).all()

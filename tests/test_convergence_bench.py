"""bench/convergence.py runs end to end at a tiny size (so it cannot rot); its figures come only
from the full run, recorded in bench/RESULTS.md. Its arithmetic is checked on made-up curves."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
import convergence  # noqa: E402 - from bench/, put on sys.path above


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

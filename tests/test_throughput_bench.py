"""bench/throughput.py and bench/profile_step.py --compare run end to end at the debug size (so
they cannot rot); their figures come only from full runs, recorded in bench/RESULTS.md."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
import throughput  # noqa: E402 - from bench/, put on sys.path above

NAMES = ["transformers Qwen3ForCausalLM, AdamW", "lmcockpit GPT, AdamW", "lmcockpit GPT, Muon + AdamW"]


def bench(*args: str) -> str:
    proc = subprocess.run([sys.executable, str(BENCH / args[0]), *args[1:]], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_round_s_ratio_is_tokens_per_second_over_the_baseline_s():
    # equal work per row: half the time is twice the tokens/s
    assert throughput.speedups([2.0, 1.0, 4.0]) == [1.0, 2.0, 0.5]


@pytest.mark.slow
def test_throughput_records_each_precision_s_three_rows_with_their_ratios(tmp_path):
    results = tmp_path / "RESULTS.md"
    bench("throughput.py", "--preset", "debug", "--precision", "fp32,bf16", "--steps", "1", "--rounds", "2",
          "--warmup", "1", "--results", str(results))
    text = results.read_text()
    assert "## throughput: lmcockpit against transformers' Qwen3ForCausalLM" in text
    row = re.compile(r"^\| (fp32|bf16) \| (.+?) \| ([\d,]+) \| (\d+\.\d\d)x \| (\d+\.\d\d)x \| (\d+\.\d\d)–(\d+\.\d\d) \|$",
                     re.M)
    rows = row.findall(text)
    assert [(p, n) for p, n, *_ in rows] == [(p, n) for p in ("fp32", "bf16") for n in NAMES], text
    for i in range(0, 6, 3):
        base = int(rows[i][2].replace(",", ""))
        for precision, name, best, best_ratio, median, lo, hi in rows[i:i + 3]:
            # the best column's ratio is the row's best tokens/s over the baseline's of its precision
            assert float(best_ratio) == round(int(best.replace(",", "")) / base, 2)
            assert float(lo) <= float(median) <= float(hi)
        assert rows[i][4:] == ("1.00", "1.00", "1.00"), rows[i]  # the baseline against itself, round by round


@pytest.mark.slow
def test_profile_compare_puts_each_step_s_work_where_it_belongs():
    out = bench("profile_step.py", "--compare", "--preset", "debug", "--steps", "2")
    columns = {}
    for line in out.splitlines():
        m = re.match(r"^(\S.*?)\s{2,}([\d.]+)\s+([\d.]+)\s+([\d.]+)$", line)
        if m:
            columns[m[1]] = [float(v) for v in m.groups()[1:]]
    assert all(v > 0 for v in columns["matmuls"]), out
    # only Muon orthogonalises; only the transformers loop leaves its loss outside a compiled graph
    # (the debug preset trains eager: ours is LinearCrossEntropy's matmuls and logsumexp)
    ns = columns["optimizer matmuls (Newton–Schulz)"]
    assert ns[0] == ns[1] == 0.0 and ns[2] > 0, out
    loss = columns["loss outside the compiled graph"]
    assert loss[0] > 0 and loss[1] == loss[2] == 0.0, out
    kinds = [v for k, v in columns.items() if k != "total"]
    for i, total in enumerate(columns["total"]):  # every operator counted once (printed to 0.1 ms)
        assert abs(total - sum(v[i] for v in kinds)) <= 0.05 * len(kinds) + 1e-9, out

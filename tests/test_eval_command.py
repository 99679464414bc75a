"""`lmcockpit eval` on a trained run, task scores while a run trains and across a resume, bad task
input refused before any run folder exists, and memory that stays flat over rounds."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from lmcockpit.core.run.curves import load_run
from lmcockpit.core.run.folder import read_metrics
from tests.helpers import SHRINK_CPU, TINY, as_flags, cli

MC_ROWS = [{"context": "def add(a, b):\n", "choices": ["    return a + b\n", "    pass\n", "    import os\n"], "gold": 0},
           {"context": "import", "choices": [" os\n", " the\n"], "gold": 0},
           {"context": "class Point:\n", "choices": ["    x = 0\n", "    return None\n"], "gold": 0}]


def write_task(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.slow
def test_eval_json_prints_only_the_scores_with_each_item_s_choice(trained_run, tmp_path):
    run_dir, proc = trained_run
    assert proc.returncode == 0, proc.stderr
    mine = write_task(tmp_path / "mine.jsonl", MC_ROWS)
    r = cli("eval", str(run_dir), "--tasks", f"python-functions,{mine}", "--max-per-task", "10", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # stdout holds the JSON alone: the log went to stderr
    assert set(out) == {"tasks"} and set(out["tasks"]) == {"python-functions", "mine"}
    pf, own = out["tasks"]["python-functions"], out["tasks"]["mine"]
    assert set(pf) == {"accuracy", "centered", "items", "indices", "predictions", "gold"}
    assert pf["items"] == 10 and len(pf["predictions"]) == 10 and all(0 <= p < 4 for p in pf["predictions"])
    # each item's right answer beside the model's choice: the accuracy checks item by item
    assert len(pf["indices"]) == len(set(pf["indices"])) == len(pf["gold"]) == 10
    assert all(0 <= g < 4 for g in pf["gold"])
    assert pf["accuracy"] == sum(p == g for p, g in zip(pf["predictions"], pf["gold"])) / 10
    assert own["items"] == 3 and len(own["predictions"]) == 3
    assert own["indices"] == [0, 1, 2] and own["gold"] == [row["gold"] for row in MC_ROWS]
    assert own["accuracy"] == sum(p == 0 for p in own["predictions"]) / 3
    assert own["centered"] == pytest.approx((own["accuracy"] - (1 / 3 + 1 / 2 + 1 / 2) / 3)
                                            / (1 - (1 / 3 + 1 / 2 + 1 / 2) / 3))
    assert "eval: mine: scoring 3 items (multiple choice, 0-shot)…" in r.stderr
    assert re.search(r"eval: mine: accuracy [\d.]+ of 3 items in [\d.]+ s", r.stderr)


@pytest.mark.slow
def test_eval_json_of_a_task_of_one_item_says_one_item(trained_run, tmp_path):
    run_dir, _ = trained_run
    one = write_task(tmp_path / "one.jsonl", MC_ROWS[1:2])
    r = cli("eval", str(run_dir), "--tasks", one, "--json")
    assert r.returncode == 0, r.stderr
    scores = json.loads(r.stdout)["tasks"]["one"]
    assert (scores["items"], scores["indices"], scores["gold"]) == (1, [0], [0])
    assert "eval: one: scoring 1 item (multiple choice, 0-shot)…" in r.stderr
    assert re.search(r"eval: one: accuracy [\d.]+ of 1 item in [\d.]+ s", r.stderr), r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--harness", "hellaswag")])
def test_eval_of_a_file_says_it_is_a_file_and_how_to_name_a_task_file(tmp_path, extra):
    """A task file where the run folder goes: not "no such run folder", which it is not missing,
    but what eval takes there, and where a task file goes."""
    task = write_task(tmp_path / "mine.jsonl", MC_ROWS)
    r = cli("eval", task, *extra)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: {task}: a file, not a folder: eval takes a run folder or a checkpoint folder; a task file is "
        f"named with --tasks {task}"], r.stderr


@pytest.mark.slow
def test_eval_prints_a_table_and_takes_the_run_s_own_tasks(trained_run):
    run_dir, _ = trained_run
    r = cli("eval", str(run_dir), "--max-per-task", "8")
    assert r.returncode == 0, r.stderr
    [row] = [line for line in r.stdout.splitlines() if line.strip().startswith("python-functions")]
    assert row.split()[1:5] == ["multiple", "choice", "8", row.split()[4]] and "0.2500" in row


def test_a_run_writes_task_scores_into_its_eval_rows(trained_run):
    run_dir, _ = trained_run
    evals = read_metrics(run_dir, "eval")
    assert [r["step"] for r in evals] == [6, 12]
    for row in evals:
        scores = row["tasks"]["python-functions"]
        assert scores["items"] >= 50 and 0 <= scores["accuracy"] <= 1 and "val_loss" in row
        assert scores["centered"] == pytest.approx((scores["accuracy"] - 0.25) / 0.75)


BAD = {
    "missing": (None, r"no such task file"),
    "malformed": (['{"context": "a", "continuation": "b"}', '{"context": "a", "continuation": '], r"bad.jsonl:2: not a JSON"),
    "empty": ([], r"bad.jsonl: holds no items"),
    "unknown": ("python-fucntions", r"no task named 'python-fucntions'; did you mean python-functions or python-functions-chat\?"),
    # the file's own spelling, JSON's, not Python's True
    "gold-boolean": (['{"context": "a", "choices": ["b", "c"], "gold": true}'],
                     r"bad\.jsonl:1: gold = true: expected the index of the right one, 0 to 1$"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_task_input_is_one_error_line_and_no_run_folder(case, tmp_path, trained_run):
    lines, expected = BAD[case]
    if isinstance(lines, str):
        name = lines
    else:
        name = str(tmp_path / "bad.jsonl")
        if lines is not None:
            (tmp_path / "bad.jsonl").write_text("".join(line + "\n" for line in lines))
    out = tmp_path / "run"
    for key, args in (("eval.tasks", ("--run", "debug", *as_flags([*TINY, f"eval.tasks=[{json.dumps(name)}]"]),
                                       "--out", str(out))),
                      ("--tasks", ("eval", str(trained_run[0]), "--tasks", name))):
        r = cli(*args)
        assert r.returncode == 2, r.stderr
        [line] = r.stderr.strip().splitlines()
        # named as the user gave it; a line of a file by the file and line alone
        assert line.startswith((f"error: {key}: ", f"error: {name}:")) and "Traceback" not in r.stderr
        assert re.search(expected, line), line
        assert not out.exists()


@pytest.mark.slow
def test_task_curves_stay_whole_across_a_resume(tmp_path):
    """Scored at steps 4 and 8 (the last), resumed to 12 scoring every 2 steps: the
    curve holds every scoring, once."""
    run = tmp_path / "run"
    tasks = ["eval.tasks=[\"python-functions\"]", "eval.max_per_task=12", "eval.tasks_every=4", "checkpoint.every=4"]
    first = cli("--run", "cpu", *as_flags([*SHRINK_CPU, *TINY, *tasks, "training.max_steps=8",
                                           "training.compile=false"]), "--out", str(run))
    assert first.returncode == 0, first.stderr
    again = cli("--run", "--resume", str(run), *as_flags(["training.max_steps=12", "eval.tasks_every=2",
                                                          "eval.references={python-functions={a=0.5}}"]))
    assert again.returncode == 0, again.stderr
    curves = load_run(run)
    assert [step for step, _ in curves.tasks["python-functions"]] == [4, 8, 10, 12]
    rows = read_metrics(run, "eval")
    assert [r["step"] for r in rows if r["tasks"]] == [4, 8, 10, 12]  # a validation's alone holds none
    assert all(r["tasks"]["python-functions"]["items"] == 12 for r in rows if r["tasks"])


@pytest.mark.slow
def test_scoring_rounds_do_not_grow_the_process_memory():
    """Ten rounds of scoring on a model in a process of its own: its resident memory after the
    tenth is within 8 MiB of the second's, where a 256 KiB tensor kept per batch (a leak of the nanochat
    kind) grows it by 48 MB. malloc moves it by a few MiB either way
    (CI runs saw 341.5 → 344.7 → 343.4 MiB over the rounds), and the first round pays what is paid
    once (arenas, kernels' workspaces)."""
    code = textwrap.dedent("""
        import contextlib, json, psutil, torch
        from lmcockpit.core.config import Config
        from lmcockpit.core.model.gpt import GPT, shape_from_config
        from lmcockpit.core.tasks import python_functions, scoring
        from tests.helpers import tiny_config
        torch.manual_seed(0)
        cfg = tiny_config("model.max_seq_len=128", "training.seq_len=128")
        model = GPT(shape_from_config(cfg)).eval()
        task = python_functions.task(Config())
        encode = lambda texts: [[b % cfg.tokenizer.vocab_size for b in t.encode()] for t in texts]
        rss = []
        for _ in range(10):
            scoring.score_tasks([task], model, encode, 0, 128, 8, torch.device("cpu"), contextlib.nullcontext)
            rss.append(psutil.Process().memory_info().rss)
        print(json.dumps(rss))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rss = json.loads(r.stdout)
    assert rss[-1] - rss[1] < 8 * 2**20, [f"{x / 2**20:.1f} MiB" for x in rss]


@pytest.mark.slow
def test_a_core_bundle_is_scored_with_its_core_mean_by_eval_and_by_a_run(trained_run, tmp_path):
    from tests.helpers import write_bundle

    bundle = f"core:{write_bundle(tmp_path / 'bundle')}"
    r = cli("eval", str(trained_run[0]), "--tasks", bundle)
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines()[1:] if line.strip()}
    assert set(rows) == {"tiny_mc", "tiny_schema", "tiny_lm", "CORE"}
    centred = [float(rows[name][-1]) for name in ("tiny_mc", "tiny_schema", "tiny_lm")]
    assert float(rows["CORE"][-1]) == pytest.approx(sum(centred) / 3, abs=1e-4)

    run = tmp_path / "run"
    done = cli("--run", "debug", *as_flags([*TINY, f"eval.tasks=[{json.dumps(bundle)}]"]), "--out", str(run))
    assert done.returncode == 0, done.stderr
    for row in read_metrics(run, "eval"):
        assert set(row["tasks"]) == {"tiny_mc", "tiny_schema", "tiny_lm"}
        assert row["core"] == pytest.approx(sum(t["centered"] for t in row["tasks"].values()) / 3)

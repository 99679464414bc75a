"""`lmcockpit eval --harness`: EleutherAI's lm-evaluation-harness scoring a trained run's export,
offline, on a task the test writes (lm-eval's local `dataset_path: json`), against the same
choices computed in `transformers` from the export's per-choice log-likelihoods; the
harness's bad input refused before anything is exported; and of a folder others can add to, the
user's task file alone read, never a YAML or Python planted beside it."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.helpers import cli
from tests.other_account import other_account, run_as_other

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

# Choices of very different lengths and likelihoods: a near tie would let batching's rounding decide.
ROWS = [
    {"context": "def add(a, b):\n   ", "choices": ["return a + b\n", "zq zq zq zq\n"], "gold": 0},
    {"context": "import", "choices": ["os\n", ")))\n", "the the the the the\n"], "gold": 0},
    {"context": "for i in", "choices": ["range(10):\n", "def def def:\n"], "gold": 1},
    {"context": "class Point:\n   ", "choices": ["x = 0\n", "return None\n", "Q\n"], "gold": 2},
    {"context": "if x", "choices": ["== 0:\n", "import sys import sys\n"], "gold": 0},
    {"context": "    return", "choices": ["None\n", "self\n", "((((\n"], "gold": 1},
]


def write_local_task(folder) -> str:
    data = folder / "items.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    yaml_file = folder / "python_bits.yaml"
    yaml_file.write_text(textwrap.dedent(f"""\
        task: python_bits
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{context}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: gold
        metric_list:
          - metric: acc
            aggregation: mean
            higher_is_better: true
          - metric: acc_norm
            aggregation: mean
            higher_is_better: true
        """))
    return str(yaml_file)


def choices_by_transformers(export_dir) -> tuple[list[int], list[int]]:
    """Each row's choice by summed log-likelihood and by it over the choice's bytes (lm-eval's acc
    and acc_norm), the continuation being the tokens `context + " " + choice` adds to `context`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(export_dir)
    by_sum, by_bytes = [], []
    for row in ROWS:
        context = tok(row["context"], add_special_tokens=False).input_ids
        scores = []
        for choice in row["choices"]:
            whole = tok(row["context"] + " " + choice, add_special_tokens=False).input_ids
            assert whole[:len(context)] == context
            with torch.no_grad():
                logp = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
            scores.append(sum(logp[i - 1, whole[i]].item() for i in range(len(context), len(whole))))
        by_sum.append(max(range(len(scores)), key=scores.__getitem__))
        lengths = [len((" " + c).encode()) for c in row["choices"]]
        by_bytes.append(max(range(len(scores)), key=lambda i: scores[i] / lengths[i]))
    return by_sum, by_bytes


@pytest.mark.slow
def test_the_harness_scores_a_local_task_on_the_export_offline(trained_run, tmp_path):
    run_dir, proc = trained_run
    assert proc.returncode == 0, proc.stderr
    task = write_local_task(tmp_path)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    r = cli("eval", str(run_dir), "--harness", task, "--tasks", "python-functions", "--max-per-task", str(len(ROWS)),
            "--json", env={**OFFLINE, "TMPDIR": str(scratch)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # the harness's own log went to stderr
    assert set(out) == {"tasks", "harness"} and set(out["harness"]) == {"python_bits"}
    assert out["tasks"]["python-functions"]["items"] == len(ROWS)  # ours scored as well, --tasks given
    scores = out["harness"]["python_bits"]
    assert scores["items"] == len(ROWS)
    assert {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"} <= set(scores)
    assert list(scratch.glob("lmcockpit-harness-*")) == []  # the export made for the harness is gone

    export_dir = tmp_path / "export"
    assert cli("export", str(run_dir), str(export_dir)).returncode == 0
    by_sum, by_bytes = choices_by_transformers(export_dir)
    gold = [row["gold"] for row in ROWS]
    assert scores["acc"] == pytest.approx(sum(p == g for p, g in zip(by_sum, gold)) / len(ROWS))
    assert scores["acc_norm"] == pytest.approx(sum(p == g for p, g in zip(by_bytes, gold)) / len(ROWS))


def test_the_harness_table_has_a_row_per_metric_with_its_standard_error(capsys):
    from lmcockpit.tui.commands.eval import print_harness

    print_harness({"python_bits": {"acc": 0.5, "acc_stderr": 0.2236, "acc_norm": 0.6667, "acc_norm_stderr": 0.2108,
                                   "items": 6.0},
                   "lambada_openai": {"perplexity": 812.5, "acc": 0.0, "acc_stderr": 0.0, "items": 5153.0}})
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert rows[0] == ["lm-eval", "task", "items", "metric", "value", "stderr"]
    assert rows[1:] == [["python_bits", "6", "acc", "0.5000", "±0.2236"], ["acc_norm", "0.6667", "±0.2108"],
                        ["lambada_openai", "5153", "perplexity", "812.5000"], ["acc", "0.0000", "±0.0000"]]


@pytest.mark.slow
@pytest.mark.parametrize("spec, expected", [
    ("hellaswagg", "error: --harness hellaswagg: not a task lm-eval knows; did you mean hellaswag"),
    ("hellaswag", "error: --harness hellaswag: its dataset could not be loaded"),
    ("missing.yaml", "error: --harness missing.yaml: no such task file"),
])
def test_harness_bad_input_is_one_error_line_before_any_export(trained_run, tmp_path, spec, expected):
    run_dir, _ = trained_run
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    r = cli("eval", str(run_dir), "--harness", spec, cwd=tmp_path, env={**OFFLINE, "TMPDIR": str(scratch)})
    assert r.returncode == 2
    [error] = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(expected), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert list(scratch.glob("lmcockpit-harness-*")) == []


@pytest.mark.slow
def test_a_missing_task_file_is_refused_before_the_harness_is_imported(tmp_path):
    """lm_eval's import takes seconds (its task index more): a task file that is not there is said
    at once, before it. A fresh interpreter, so that nothing imported lm_eval before."""
    import subprocess
    import sys

    code = ("import sys\nfrom lmcockpit.core.config import ConfigError\nfrom lmcockpit.core.infer.harness import resolve\n"
            "try:\n    resolve(['hellaswag', 'missing.yaml'])\nexcept ConfigError as e:\n    print(e)\n"
            "print('lm_eval' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.stdout.splitlines() == ["--harness missing.yaml: no such task file", "False"], r.stderr


# ------------------------------------------------------------ task files another account can reach
@pytest.fixture
def shared():
    """A folder in /tmp every account may add files to, sticky as /tmp itself is (pytest's
    tmp_path is under a 0700 folder no other account can enter)."""
    path = Path(tempfile.mkdtemp(prefix="lmcockpit-shared-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def plant(folder: str, task: str, marker: str) -> None:
    """As another account: a task YAML of the name the user's has (or a harness task's), sorted
    first, whose `!function` imports the Python planted beside it, which leaves `marker` if run."""
    Path(folder, "a0-evil.yaml").write_text(f"task: {task}\nprocess_docs: !function evil.plant\n")
    Path(folder, "evil.py").write_text(f"open({marker!r}, 'w').write('ran as the user')\n"
                                       "def plant(dataset):\n    return dataset\n")


@pytest.mark.slow
def test_python_another_account_plants_beside_the_user_s_task_never_runs(shared, tmp_path, monkeypatch):
    """The user's task in a shared folder, which another account can add files to but not change
    the user's in: the harness is given the user's file alone, and scores it. Given the folder, it
    took the planted YAML of the same `task:` (first, by name) and imported its Python as the user.
    Nor are lm-eval's own tasks indexed, when the user names none of them."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lmcockpit.core.infer import harness

    task, marker = write_local_task(shared), tmp_path / "planted-python-ran"
    run_as_other(plant, str(shared), "python_bits", str(marker))
    said = []
    try:
        tasks = harness.resolve([task], log=said.append)
    finally:
        assert not marker.exists(), "the planted Python ran"
    try:
        assert tasks.names == ["python_bits"]
        # Task files alone: lm-eval's own 14,000 tasks are not indexed (12 s of CPU), only the user's.
        assert tasks.manager.all_tasks == ["python_bits"]
        assert said == ["eval: loading python_bits's dataset…"]
        entry = tasks.manager.task_index["python_bits"]
        assert Path(entry.yaml_path).parent == Path(tasks.include[0])  # the private copy, not the shared folder
        assert sorted(p.name for p in Path(tasks.include[0]).iterdir()) == ["1-python_bits.yaml"]
        assert os.stat(tasks.include[0]).st_mode & 0o777 == 0o700
    finally:
        tasks.close()
    assert not Path(tasks.include[0]).exists()


@pytest.mark.slow
def test_a_harness_task_name_is_never_taken_from_the_user_s_task_folder(trained_run, shared, tmp_path):
    """`--harness mine.yaml,hellaswag`: hellaswag is lm-eval's own, not a `task: hellaswag` planted
    beside mine.yaml. Offline, its dataset is refused, as it is with no file beside."""
    run_dir, _ = trained_run
    task, marker = write_local_task(shared), tmp_path / "planted-python-ran"
    run_as_other(plant, str(shared), "hellaswag", str(marker))
    r = cli("eval", str(run_dir), "--harness", f"{task},hellaswag", env=OFFLINE)
    assert not marker.exists(), "the planted Python ran"
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    [error] = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith("error: --harness hellaswag: its dataset could not be loaded"), error


def write_as_other(path: str, text: str) -> None:
    Path(path).write_text(text)


def trap(folder: Path, marker: Path, how: str) -> str:
    """The user's task YAML in `folder`, left open to another account `how`; the path to name."""
    task = write_local_task(folder)
    evil = f"open({str(marker)!r}, 'w').write('ran as the user')\ndef fn(doc):\n    return doc\n"
    if how == "a folder others can write":
        folder.chmod(0o777)
        run_as_other(plant, str(folder), "python_bits", str(marker))
    elif how == "another account's task file":
        yaml_text = Path(task).read_text()
        Path(task).unlink()
        run_as_other(write_as_other, task, yaml_text)
    elif how == "another account's !function file":
        with open(task, "a") as fh:
            fh.write("process_docs: !function helpers.fn\n")
        run_as_other(write_as_other, str(folder / "helpers.py"), evil)
    else:  # what the user's file includes, planted by another account before the user wrote it
        Path(task).write_text("include: _common_yaml\n" + Path(task).read_text())
        run_as_other(write_as_other, str(folder / "_common_yaml"), "process_docs: !function helpers.fn\n")
        run_as_other(write_as_other, str(folder / "helpers.py"), evil)
    return task


TRAPS = {"a folder others can write": "is writable by other accounts (mode 777)",
         "another account's task file": "python_bits.yaml: the file is owned by uid",
         "another account's !function file": "helpers.py (named by !function helpers.fn): the file is owned by uid",
         "another account's included file": "_common_yaml (included by"}


@pytest.mark.slow
@pytest.mark.parametrize("how", TRAPS)
def test_a_task_file_another_account_can_change_is_refused_in_one_line(trained_run, shared, tmp_path, how):
    run_dir, _ = trained_run
    uid = other_account().pw_uid
    marker, scratch = tmp_path / "planted-python-ran", tmp_path / "tmp"
    scratch.mkdir()
    task = trap(shared, marker, how)
    r = cli("eval", str(run_dir), "--harness", task, env={**OFFLINE, "TMPDIR": str(scratch)})
    assert not marker.exists(), "the planted Python ran"
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == "", r.stderr
    [error] = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: --harness {task}: ") and TRAPS[how] in error, error
    assert how == "a folder others can write" or f"owned by uid {uid}, another account" in error
    assert error.endswith("so its files must be ones no other account can change: copy them into a folder of "
                          "your own"), error
    assert list(scratch.iterdir()) == []  # the private copies made before the refusal are gone


# ------------------------------------------------------------------- lm-eval's tasks, indexed once
@pytest.mark.slow
def test_a_built_in_task_is_found_by_its_folder_once_lm_eval_s_tasks_were_indexed(tmp_path, monkeypatch):
    """Naming one of lm-eval's tasks read all 14,683 of its task files, every call (seconds of
    CPU before the first item). The first call keeps each name's folder; the next ones index the
    named task's folder alone, and refuse a typo from the names kept, without the index."""
    from lmcockpit.core.config import ConfigError
    from lmcockpit.core.infer import harness, harness_index

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    said = []
    for _ in range(2):
        with pytest.raises(ConfigError, match="--harness hellaswagg: not a task lm-eval knows; did you mean hellaswag"):
            harness.resolve(["hellaswagg"], said.append)
    assert said == ["eval: indexing lm-eval's tasks…"]  # the first call alone
    manager = harness.task_manager(["hellaswag", "arc_easy"], [], said.append)
    assert said == ["eval: indexing lm-eval's tasks…"]
    assert {"hellaswag", "arc_easy", "arc_challenge"} <= set(manager.all_tasks) and len(manager.all_tasks) < 100
    root = harness_index.tasks_root()
    assert Path(manager.task_index["hellaswag"].yaml_path).parent == root / "hellaswag"
    # a group's tasks may be in other folders: it still takes the whole index
    assert "mmlu_stem" in harness.task_manager(["mmlu"], [], said.append).all_tasks
    assert said == ["eval: indexing lm-eval's tasks…"] * 2


def test_the_kept_index_is_lm_eval_s_own_as_installed_or_nothing(tmp_path, monkeypatch):
    """Kept for this install only (its fingerprint), naming only folders inside lm-eval's tasks,
    read only as the user's own: anything else is no index (and the whole one is read again)."""
    from lmcockpit.core.infer import harness_index

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "tasks"
    (root / "a").mkdir(parents=True)
    (root / "a" / "a.yaml").write_text("task: a\n")
    print_ = harness_index.fingerprint(root)

    def keep(tasks: dict, fingerprint: str = print_) -> None:
        path = harness_index.cache_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"fingerprint": fingerprint, "tasks": tasks}))

    keep({"a": ["task", "a"], "g": ["group", ""]})
    kept = harness_index.load(root, print_)
    assert kept.folder("a") == root / "a" and kept.folder("g") is None and kept.folder("b") is None
    keep({"a": ["task", "a"]}, fingerprint="lm-eval 0.0 | elsewhere")
    assert harness_index.load(root, print_) is None
    keep({"a": ["task", "../../.."]})  # a folder outside lm-eval's: its YAML could name any Python
    assert harness_index.load(root, print_) is None
    keep({"a": ["task"]})
    assert harness_index.load(root, print_) is None  # damaged
    harness_index.cache_path().unlink()
    harness_index.cache_path().symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text(json.dumps({"fingerprint": print_, "tasks": {"a": ["task", "a"]}}))
    assert harness_index.load(root, print_) is None  # a link: not the user's own file

    (root / "a" / "b.yaml").write_text("task: b\n")  # a task added by hand: another fingerprint
    assert harness_index.fingerprint(root) != print_
    again = harness_index.fingerprint(root)
    os.utime(root / "a" / "a.yaml", ns=(10**19, 10**19))  # one edited
    assert harness_index.fingerprint(root) != again

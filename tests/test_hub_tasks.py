"""Named Hub tasks (`arc_easy`, ...) against a Hub on 127.0.0.1 (fake_hub.py): fetched into the
Hub's cache by the real `huggingface_hub` when first asked (from the revision the task names, the
split's files alone, wherever in the repo they lie), read from it offline after, and refused with
the download command offline with nothing fetched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmcockpit.core.tasks import hub_tasks
from lmcockpit.core.tasks.items import Item

from .fake_hub import FakeHub
from .helpers import hub_env

ARC_FILE = "ARC-Easy/test-00000-of-00001.parquet"
ROWS = [{"id": f"q{i}", "question": f"Which number comes after {i}?",
         "choices": {"text": [str(i + 1), str(i + 7), str(i - 3), "none"], "label": ["A", "B", "C", "D"]},
         "answerKey": "A"} for i in range(7)]


def arc_repo(root: Path) -> Path:
    """allenai/ai2_arc as the Hub lays it out: a Parquet file a split under each subset."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, rows in ((ARC_FILE, ROWS), ("ARC-Challenge/test-00000-of-00001.parquet", ROWS[:2]),
                       ("ARC-Easy/train-00000-of-00001.parquet", ROWS * 3)):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), root / name)
    (root / "README.md").write_text("# a fake ARC\n")
    return root


HELLASWAG = "Rowan/hellaswag"
PARQUET_REVISION = "refs/convert/parquet"
HELLASWAG_ROWS = {name: [{"ind": i, "ctx": f"{name} context {i}", "endings": [f"e{i}{k}" for k in "abcd"],
                          "label": str(i % 4)} for i in range(3)]
                  for name in ("default/validation/0000.parquet", "default/validation/0001.parquet",
                               "default/train/0000.parquet", "default/test/0000.parquet")}

PIQA = "baber/piqa"
PIQA_ROWS = {f"data/{split}-00000-of-00001.parquet": [
    {"goal": f"{split}: how do I open jar {i}?", "sol1": f"twist lid {i}", "sol2": f"hit lid {i}",
     "label": -1 if split == "test" else i % 2} for i in range(n)]
    for split, n in (("train", 9), ("validation", 5), ("test", 4))}


def write_parquet(root: Path, files: dict[str, list[dict]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, rows in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), root / name)
    return root


def hellaswag_repo(root: Path) -> dict[str, Path]:
    """Rowan/hellaswag as the Hub holds it: a loading script on main, no data; the Parquet the Hub
    converted it to, a folder a split, on refs/convert/parquet."""
    (root / "main").mkdir(parents=True)
    (root / "main/hellaswag.py").write_text("import datasets  # a loading script, which we do not run\n")
    (root / "main/README.md").write_text("# a fake HellaSwag\n")
    return {"main": root / "main", PARQUET_REVISION: write_parquet(root / "parquet", HELLASWAG_ROWS)}


def evaluate(run: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmcockpit.tui.cli", "eval", str(run), *args],
                          capture_output=True, text=True, env=env, timeout=300)


def read_task(env: dict[str, str], name: str) -> list[Item]:
    """hub_tasks.read_task alone, in a process of its own (huggingface_hub reads HF_ENDPOINT when
    imported): the task's items, without a model to score them."""
    code = ("import dataclasses, json, sys; from lmcockpit.core.tasks.hub_tasks import read_task; "
            "print(json.dumps([dataclasses.astuple(i) for i in read_task(sys.argv[1]).items]))")
    r = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return [Item(tuple(contexts), tuple(continuations), gold, neutral)
            for contexts, continuations, gold, neutral in json.loads(r.stdout)]


def test_rows_become_items_as_each_task_asks():
    assert hub_tasks.arc(ROWS[0]) == Item(("Question: Which number comes after 0?\nAnswer:",),
                                          (" 1", " 7", " -3", " none"), 0)
    assert hub_tasks.hellaswag({"ctx": "A man sits", "endings": ["a", "b", "c", "d"], "label": "2"}) == \
        Item(("A man sits",), (" a", " b", " c", " d"), 2)
    assert hub_tasks.lambada({"text": "he said it to his friend"}) == Item(("he said it to his",), (" friend",))
    assert hub_tasks.piqa({"goal": "Open a jar", "sol1": "twist the lid", "sol2": "hit it", "label": 1}) == \
        Item(("Question: Open a jar\nAnswer:",), (" twist the lid", " hit it"), 1)


@pytest.mark.parametrize("layout", ["data/{split}-00000-of-00001.parquet", "plain_text/{split}/0000.parquet",
                                    "{split}.parquet"])
def test_a_task_finds_its_split_at_any_depth_and_no_other_split(tmp_path, layout):
    # baber/piqa's layout is not known here: the pattern must find the validation split in any
    # of the usual ones, as huggingface_hub's allow_patterns does, and never train or test.
    spec = hub_tasks.HUB["piqa"]
    for split in ("train", "validation", "test"):
        (tmp_path / layout.format(split=split)).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / layout.format(split=split)).write_bytes(b"")
    assert hub_tasks.local_files(spec, tmp_path) == [tmp_path / layout.format(split="validation")]


@pytest.mark.slow
def test_a_hub_task_is_fetched_once_then_read_offline(trained_run, tmp_path):
    run, _ = trained_run
    with FakeHub({"allenai/ai2_arc": arc_repo(tmp_path / "repo")}) as hub:
        env = hub_env(tmp_path / "hf", hub.url)
        first = evaluate(run, env, "--tasks", "arc_easy", "--json")
        assert first.returncode == 0, first.stderr
        assert hub.got("allenai/ai2_arc") == [ARC_FILE]  # the test split alone: not train, not the other subset
    scores = json.loads(first.stdout)["tasks"]["arc_easy"]
    assert scores["items"] == 7 and len(scores["predictions"]) == 7
    again = evaluate(run, {**env, "HF_HUB_OFFLINE": "1"}, "--tasks", "arc_easy", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["tasks"]["arc_easy"] == scores


@pytest.mark.slow
def test_hellaswag_is_fetched_from_the_parquet_revision_then_read_offline(tmp_path):
    with FakeHub({HELLASWAG: hellaswag_repo(tmp_path / "repo")}) as hub:
        env = hub_env(tmp_path / "hf", hub.url)
        items = read_task(env, "hellaswag")
        commit = hub.commit(HELLASWAG, PARQUET_REVISION)
        # The validation files alone, of that revision's commit (main holds no data at all).
        assert sorted(hub.got(HELLASWAG)) == ["default/validation/0000.parquet", "default/validation/0001.parquet"]
        assert {r.revision for r in hub.requests if r.file} == {commit}
    rows = HELLASWAG_ROWS["default/validation/0000.parquet"] + HELLASWAG_ROWS["default/validation/0001.parquet"]
    assert items == [Item((row["ctx"],), tuple(" " + e for e in row["endings"]), int(row["label"])) for row in rows]
    # The revision's name is kept in the Hub's cache as a ref to its commit, which serves offline.
    ref = tmp_path / "hf/hub/datasets--Rowan--hellaswag/refs" / PARQUET_REVISION
    assert ref.read_text() == commit
    assert read_task({**env, "HF_HUB_OFFLINE": "1"}, "hellaswag") == items


@pytest.mark.slow
def test_piqa_is_its_validation_split_asked_as_the_harness_asks_it(trained_run, tmp_path):
    run, _ = trained_run
    with FakeHub({PIQA: write_parquet(tmp_path / "repo", PIQA_ROWS)}) as hub:
        env = hub_env(tmp_path / "hf", hub.url)
        scored = evaluate(run, env, "--tasks", "piqa", "--json")
        assert scored.returncode == 0, scored.stderr
        assert hub.got(PIQA) == ["data/validation-00000-of-00001.parquet"]  # not train, not test
    rows = PIQA_ROWS["data/validation-00000-of-00001.parquet"]
    scores = json.loads(scored.stdout)["tasks"]["piqa"]
    assert scores["items"] == len(rows) and set(scores["predictions"]) <= {0, 1}
    items = read_task({**env, "HF_HUB_OFFLINE": "1"}, "piqa")
    assert items == [Item((f"Question: {row['goal']}\nAnswer:",), (f" {row['sol1']}", f" {row['sol2']}"),
                          row["label"]) for row in rows]


@pytest.mark.slow
@pytest.mark.parametrize("task", ["arc_challenge", "hellaswag"])
def test_offline_with_nothing_fetched_exits_2_with_the_download_command(trained_run, tmp_path, task):
    run, _ = trained_run
    r = evaluate(run, {**hub_env(tmp_path / "hf", "http://127.0.0.1:9"), "HF_HUB_OFFLINE": "1"}, "--tasks", task)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    [line, command] = r.stderr.strip().splitlines()
    assert line.startswith(f"error: --tasks: {task} is not downloaded yet, and HF_HUB_OFFLINE is set")
    assert command.strip() == hub_tasks.download_command(hub_tasks.HUB[task])
    out = tmp_path / "run"
    started = subprocess.run([sys.executable, "-m", "lmcockpit.tui.cli", "--run", "debug", "--set",
                              f'eval.tasks=["{task}"]', "--out", str(out)], capture_output=True, text=True,
                             env={**hub_env(tmp_path / "hf", "http://127.0.0.1:9"), "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert started.returncode == 2 and f"{task} is not downloaded yet" in started.stderr
    assert not out.exists()


def test_a_mistyped_hub_task_is_named_with_the_nearest():
    from lmcockpit.core.config import Config, ConfigError
    from lmcockpit.core.tasks import catalog

    with pytest.raises(ConfigError, match=r"no task named 'helaswag'; did you mean hellaswag\?"):
        catalog.load_task("helaswag", Config())

"""Named Hub tasks (`arc_easy`, ...) against a Hub on 127.0.0.1 (fake_hub.py): fetched into the
Hub's cache by the real `huggingface_hub` when first asked, read from it offline after, and
refused with the download command offline with nothing fetched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmcockpit.core.tasks import hub_tasks
from lmcockpit.core.tasks.items import Item

from .fake_hub import FakeHub
from .test_hub_fetch import hub_env

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


def evaluate(run: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmcockpit.tui.cli", "eval", str(run), *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_rows_become_items_as_each_task_asks():
    assert hub_tasks.arc(ROWS[0]) == Item(("Question: Which number comes after 0?\nAnswer:",),
                                          (" 1", " 7", " -3", " none"), 0)
    assert hub_tasks.hellaswag({"ctx": "A man sits", "endings": ["a", "b", "c", "d"], "label": "2"}) == \
        Item(("A man sits",), (" a", " b", " c", " d"), 2)
    assert hub_tasks.lambada({"text": "he said it to his friend"}) == Item(("he said it to his",), (" friend",))


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


@pytest.mark.parametrize("task", ["arc_challenge", "hellaswag"])
def test_offline_with_nothing_fetched_exits_2_with_the_download_command(trained_run, tmp_path, task):
    run, _ = trained_run
    r = evaluate(run, {**hub_env(tmp_path / "hf", "http://127.0.0.1:9"), "HF_HUB_OFFLINE": "1"}, "--tasks", task)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    [line, command] = r.stderr.strip().splitlines()
    assert line.startswith(f"error: eval.tasks: {task} is not downloaded yet, and HF_HUB_OFFLINE is set")
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

"""Downstream tasks (core/tasks): the file format, the built-in task, few-shot prompts, centring,
and each kind's choices against an independent computation with transformers on the export."""

from __future__ import annotations

import ast
import contextlib
import json
import random
from pathlib import Path

import pytest
import torch

from tests.helpers import cli, write_bundle
from lmcockpit.core.config import Config, ConfigError
from lmcockpit.core.data import sources, split
from lmcockpit.core.tasks import catalog, files, items, python_functions, scoring
from lmcockpit.core.tasks.items import LANGUAGE_MODELING, MULTIPLE_CHOICE, SCHEMA, Item, Task

transformers = pytest.importorskip("transformers")


def write_lines(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------ the file format
def test_each_kind_is_read_from_its_fields(tmp_path):
    mc = files.read_task(write_lines(tmp_path / "mc.jsonl", [
        {"context": "1 + 1 =", "choices": [" 2", " 3"], "gold": 0},
        {"context": "2 + 2 =", "choices": [" 3", " 4", " 5"], "gold": 1, "neutral": "x ="}]))
    assert (mc.name, mc.kind, mc.fewshot) == ("mc", MULTIPLE_CHOICE, 0)
    assert mc.items[1] == Item(("2 + 2 =",), (" 3", " 4", " 5"), 1, "x =")
    assert mc.chance_level() == pytest.approx((1 / 2 + 1 / 3) / 2)
    schema = files.read_task(write_lines(tmp_path / "schema.jsonl", [
        {"fewshot": 1, "delimiter": " ", "chance": 0.5},
        {"contexts": ["The cat", "The dog"], "continuation": "barked.", "gold": 1}]))
    assert (schema.kind, schema.fewshot, schema.delimiter, schema.chance_level()) == (SCHEMA, 1, " ", 0.5)
    assert schema.items[0].options() == [("The cat", "barked."), ("The dog", "barked.")]
    lm = files.read_task(write_lines(tmp_path / "lm.jsonl", [{"context": "import", "continuation": " os"}, ""]))
    assert (lm.kind, len(lm.items), lm.chance_level()) == (LANGUAGE_MODELING, 1, 0.0)


@pytest.mark.parametrize("rows, expected", [
    ([{"context": "a", "choices": ["b", "c"], "gold": 0}, "{not json"], r"bad\.jsonl:2: not a JSON object"),
    ([{"context": "a", "choices": ["b", "c"], "gold": 2}], r"bad\.jsonl:1: gold = 2: expected the index .* 0 to 1"),
    ([{"context": "a", "choices": ["b"], "gold": 0}], r"bad\.jsonl:1: choices: expected a list of two or more"),
    ([{"context": "a", "choices": ["b", ""], "gold": 0}], r'bad\.jsonl:1: choices\[1\] = "": expected non-empty'),
    ([{"context": "a", "answer": "b"}], r"bad\.jsonl:1: fields \['answer', 'context'\] match no kind"),
    ([{"context": "a", "continuation": "b"}, {"contexts": ["a", "b"], "continuation": "c", "gold": 0}],
     r"bad\.jsonl:2: a schema item in a file of language modeling items"),
    ([{"fewshot": "two"}, {"context": "a", "continuation": "b"}], r'bad\.jsonl:1: fewshot = "two": expected a whole'),
    ([{"fewshot": 1}], r"bad\.jsonl: holds no items"),
    ([], r"bad\.jsonl: holds no items"),
])
def test_a_malformed_file_is_refused_naming_the_line(tmp_path, rows, expected):
    with pytest.raises(ConfigError, match=expected):
        files.read_task(write_lines(tmp_path / "bad.jsonl", rows))


def test_names_resolve_or_are_refused_with_the_nearest(tmp_path):
    cfg = Config()
    with pytest.raises(ConfigError, match=r"no task named 'python-function'; did you mean python-functions or python-functions-chat\?"):
        catalog.load_task("python-function", cfg)
    with pytest.raises(ConfigError, match=r"eval.tasks: .*missing\.jsonl: no such task file"):
        catalog.load_task(str(tmp_path / "missing.jsonl"), cfg)
    (tmp_path / "a").mkdir()
    a = write_lines(tmp_path / "a" / "t.jsonl", [{"context": "a", "continuation": "b"}])
    b = write_lines(tmp_path / "b.jsonl", [{"context": "a", "continuation": "b"}])
    (tmp_path / "t.jsonl").write_text(b.read_text())
    assert [t.name for t in catalog.load_tasks([str(a), str(b)], cfg)] == ["t", "b"]
    with pytest.raises(ConfigError, match=r"are both named 't'"):
        catalog.load_tasks([str(a), str(tmp_path / "t.jsonl")], cfg)


# ------------------------------------------------------------------------- prompts and scores
def test_fewshot_examples_are_fixed_by_the_item_and_never_the_item_itself():
    task = Task("t", MULTIPLE_CHOICE, tuple(Item((f"q{i}",), (f" a{i}", f" b{i}"), i % 2) for i in range(20)),
                fewshot=3, delimiter=":")
    prefix = items.fewshot_prefix(task, 7)
    assert prefix == items.fewshot_prefix(task, 7)  # the same on every call, rank and run
    chosen = random.Random(1234 + 7).sample([i for i in range(20) if i != 7], 3)  # nanochat's draw
    assert prefix == "".join(f"q{i}: {'ab'[i % 2]}{i}\n\n" for i in chosen)
    assert all("q7:" not in items.fewshot_prefix(task, 7) for _ in range(3))
    assert items.fewshot_prefix(task, 8) != prefix
    assert items.option_texts(task, 7)[1] == (prefix + "q7:", " b7")


def test_centring_and_the_core_mean():
    assert items.centered(0.25, 0.25) == 0 and items.centered(1.0, 0.25) == 1
    assert items.centered(0.5, 0.25) == pytest.approx(1 / 3)
    results = {"a": items.Result(0.5, 0.2, 10), "b": items.Result(0.9, 0.6, 10)}
    core = [Task(name, MULTIPLE_CHOICE, (), group="core") for name in "ab"]
    assert items.core_score(results, core) == pytest.approx(0.4)
    assert items.core_score(results, [*core, Task("c", MULTIPLE_CHOICE, (), group="core")]) is None
    assert items.core_score(results, [Task("a", MULTIPLE_CHOICE, ())]) is None  # no CORE task: no CORE
    task = Task("t", MULTIPLE_CHOICE, (Item(("x",), ("a", "b", "c", "d"), 2),) * 4)
    r = items.result_of(task, [0, 1, 2, 3], [2, 2, 0, -1])
    assert (r.accuracy, r.items, r.centered) == (0.5, 4, pytest.approx((0.5 - 0.25) / 0.75))


def test_a_continuation_is_what_it_adds_to_its_context_and_survives_a_short_window():
    def encode(texts):  # a tokenizer that merges across the boundary: "ab" is one token
        return [[100 if t[i:i + 2] == "ab" else ord(t[i]) for i in range(len(t)) if not (i and t[i - 1:i + 1] == "ab")]
                for t in texts]

    [seq] = items.sequences([("xa", "bc")], encode, eos=0, max_len=99)
    assert seq.ids == [0, ord("x"), 100, ord("c")] and seq.start == 2  # "ab" is scored: the context's "a" changed
    [cut] = items.sequences([("0123456789", "ZY")], encode, eos=0, max_len=5)
    assert cut.ids == [ord(c) for c in "789ZY"] and cut.start == 3


def test_the_subset_is_a_fixed_spread_in_file_order():
    assert items.subset(10, 0) == list(range(10)) and items.subset(3, 5) == [0, 1, 2]
    assert items.subset(100, 10) == items.subset(100, 10) == sorted(items.subset(100, 10))
    assert len(set(items.subset(100, 10))) == 10


# ------------------------------------------------------------------------- the built-in task
@pytest.mark.slow
def test_python_functions_comes_from_held_out_files_only():
    cfg = Config()
    task = python_functions.task(cfg)
    root = sources.stdlib_root()
    selection = split.Selection(1.0, cfg.data.val_fraction)
    held_out = {doc for doc, _ in python_functions.validation_documents(cfg)}
    assert held_out and all(selection.is_val(doc) for doc in held_out)
    training_text = "".join(p.read_text(errors="replace") for p in sources.stdlib_files(root)
                            if not selection.is_val(str(p.relative_to(root))))
    assert len(task.items) >= 50
    for item in task.items:
        assert len(item.continuations) == 4 and item.neutral == python_functions.NEUTRAL
        header = ast.parse(item.contexts[0] + "    pass\n").body[0]
        assert isinstance(header, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(header)
        assert len(set(item.continuations)) == 4
    # Each item's context is held-out text the training files never show (its def line and docstring).
    unseen = sum(item.contexts[0] not in training_text for item in task.items)
    assert unseen >= 0.9 * len(task.items)


def test_python_functions_needs_the_standard_library_source():
    cfg = Config()
    cfg.data.source = "corpus.jsonl"
    with pytest.raises(ConfigError, match=r"python-functions is made from the held-out files of data.source = "
                                          r"'python-stdlib'; this run reads 'corpus.jsonl'"):
        catalog.load_task("python-functions", cfg)


# ------------------------------------------------- each kind against transformers, on the export
@pytest.fixture(scope="module")
def models(trained_run, tmp_path_factory):
    """The trained run's model as lmcockpit scores with it (fp32), and its export in transformers."""
    from lmcockpit.core.infer.load import load
    from lmcockpit.core.run.checkpoint_folder import find_checkpoint

    run_dir, proc = trained_run
    assert proc.returncode == 0, proc.stderr
    out = tmp_path_factory.mktemp("tasks-export") / "hf"
    assert cli("export", str(run_dir), str(out)).returncode == 0
    ours = load(find_checkpoint(str(run_dir)), "cpu")
    ours.model.float()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    return ours, hf, transformers.AutoTokenizer.from_pretrained(out)


def hf_option(hf, tok, eos: int, before: str, after: str) -> tuple[float, int, bool]:
    """(summed loss, token count, all greedy) of `after` following `before`, by transformers alone."""
    ctx = tok(before, add_special_tokens=False).input_ids
    whole = tok(before + after, add_special_tokens=False).input_ids
    start = next((i for i, (a, b) in enumerate(zip(ctx, whole)) if a != b), min(len(ctx), len(whole)))
    ids = torch.tensor([[eos] + whole])
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits[0, :-1].float(), dim=-1)
    targets = ids[0, 1:]
    span = range(start, len(whole))
    loss = -sum(float(logp[p, targets[p]]) for p in span)
    return loss, len(span), all(int(logp[p].argmax()) == int(targets[p]) for p in span)


def hf_choice(hf, tok, eos: int, task: Task, item: Item) -> int:
    opts = [hf_option(hf, tok, eos, c + task.delimiter, x) for c, x in item.options()]
    if task.kind == LANGUAGE_MODELING:
        return 0 if opts[0][2] else -1
    if item.neutral:
        base = [hf_option(hf, tok, eos, item.neutral + task.delimiter, x) for _, x in item.options()]
        return min(range(len(opts)), key=lambda i: opts[i][0] - base[i][0])
    return min(range(len(opts)), key=lambda i: opts[i][0] / opts[i][1])


SNIPPETS = ["def add(a, b):\n    return a + b\n", "import os\nimport sys\n", "class Point:\n    pass\n",
            "for i in range(10):\n    print(i)\n", "x = [1, 2, 3]\n", "if __name__ == '__main__':\n    main()\n",
            "with open(path) as fh:\n    data = fh.read()\n", "raise ValueError('bad value')\n",
            "self.assertEqual(a, b)\n", "return None\n", "while True:\n    break\n", "try:\n    pass\n"]


def kind_tasks() -> list[Task]:
    rng = random.Random(0)
    mc, schema, lm = [], [], []
    for i, text in enumerate(SNIPPETS):
        cut = len(text) // 2
        others = rng.sample([s[len(s) // 2:] for s in SNIPPETS if s != text], 3)
        gold = i % 4
        mc.append(Item((text[:cut],), tuple(others[:gold] + [text[cut:]] + others[gold:]), gold,
                       "x = 1\n" if i % 3 == 0 else ""))
        heads = rng.sample([s[:len(s) // 2] for s in SNIPPETS if s != text], 2)
        schema.append(Item(tuple(heads[:i % 3] + [text[:cut]] + heads[i % 3:]), (text[cut:],), i % 3))
        lm.append(Item((text[:-3],), (text[-3:],)))
    return [Task("mc", MULTIPLE_CHOICE, tuple(mc)), Task("schema", SCHEMA, tuple(schema), delimiter=""),
            Task("lm", LANGUAGE_MODELING, tuple(lm))]


@pytest.mark.slow
@pytest.mark.parametrize("rows", [3, 16])
def test_each_kind_chooses_as_transformers_does_on_the_export(models, rows):
    """Batched, padded and bucketed (3 rows: many batches of mixed lengths; 16: one), the choices
    are those a plain per-option loop over the exported model makes."""
    ours, hf, tok = models

    def encode(texts):
        return [e.ids for e in ours.tokenizer.encode_batch(texts, add_special_tokens=False)]

    tasks = kind_tasks()
    results = scoring.score_tasks(tasks, ours.model, encode, ours.eos_id, ours.cfg.training.seq_len, rows, torch.device("cpu"),
                                  contextlib.nullcontext)
    for task in tasks:
        expected = [hf_choice(hf, tok, ours.eos_id, task, item) for item in task.items]
        assert results[task.name].predictions == expected, task.name
        assert results[task.name].items == len(task.items)
    assert any(p >= 0 for p in results["lm"].predictions) or all(p == -1 for p in results["lm"].predictions)


def test_padding_and_batch_shapes_stay_few():
    """Options of many lengths run in at most one shape per BUCKET of length, `rows` rows each:
    nothing compiles again per item."""
    from lmcockpit.core.model.gpt import GPT, shape_from_config
    from tests.helpers import tiny_config

    cfg = tiny_config("model.max_seq_len=512", "training.seq_len=512")
    torch.manual_seed(0)
    model = GPT(shape_from_config(cfg)).eval()
    shapes = []

    class Recording(torch.nn.Module):
        def token_scores(self, x, y, where):
            shapes.append(tuple(x.shape))
            return model.token_scores(x, y, where)

    def encode(texts):  # bytes as tokens
        return [list(t.encode()) for t in texts]

    task = Task("long", LANGUAGE_MODELING, tuple(Item(("word " * n,), (" end",)) for n in range(1, 100, 3)))
    result = scoring.score_tasks([task], Recording(), encode, 0, 512, 4, torch.device("cpu"), contextlib.nullcontext)
    assert result["long"].items == 33
    assert all(rows == 4 and width % scoring.BUCKET == 0 for rows, width in shapes)
    assert len(shapes) == 9 and len(set(shapes)) <= 512 // scoring.BUCKET  # 33 options, 4 a batch


def test_a_core_bundle_reads_its_tasks_baselines_and_shots(tmp_path):
    tasks = catalog.load_tasks([f"core:{write_bundle(tmp_path / 'bundle')}"], Config())
    assert [(t.name, t.kind, t.fewshot, t.delimiter, t.chance_level(), t.group) for t in tasks] == [
        ("tiny_mc", MULTIPLE_CHOICE, 1, " ", 0.25, "core"), ("tiny_schema", SCHEMA, 0, " ", 0.5, "core"),
        ("tiny_lm", LANGUAGE_MODELING, 0, "", 0.0, "core")]
    assert tasks[0].items[1] == Item(("Q1:",), ("yes", "no", "maybe", "never"), 1)
    assert tasks[1].items[0].options() == [("The cat", "barked."), ("The dog", "barked.")]
    assert tasks[2].items[0].contexts == ("import os",)  # stripped, as nanochat does
    prefix = items.fewshot_prefix(tasks[0], 0)
    assert prefix.endswith("\n\n") and prefix.count("\n\n") == 1 and prefix.startswith("Q") and "Q0:" not in prefix


@pytest.mark.parametrize("change, expected", [
    ({"yaml_text": "icl_tasks: [{label: x, dataset_uri: x.jsonl, icl_task_type: ranking}]"},
     r"icl_tasks\[1\]: icl_task_type 'ranking': expected one of"),
    ({"yaml_text": "icl_tasks: [unclosed"}, r"core\.yaml: not readable as YAML"),
    ({"baselines": "Eval Task,Random baseline\ntiny_mc,25\n"}, r"no random baseline for 'tiny_schema'"),
    ({"lines": {"tiny_mc.jsonl": ['{"query": "a", "choices": ["b", "c"], "gold": 0}', "{"]}},
     r"tiny_mc\.jsonl:2: not a JSON object"),
    ({"lines": {"tiny_mc.jsonl": [{"query": "a", "choices": ["b", "c"]}]}},
     r"tiny_mc\.jsonl:1: a multiple choice item of CORE's needs choices, gold, query"),
    ({"yaml_text": "icl_tasks: [{label: tiny_mc, dataset_uri: /etc/passwd, icl_task_type: language_modeling}]"},
     r"icl_tasks\[1\]: dataset_uri '/etc/passwd': expected the path of a file under .*bundle/eval_data$"),
])
def test_a_damaged_core_bundle_is_refused_naming_where(tmp_path, change, expected):
    folder = write_bundle(tmp_path / "bundle", **change)
    with pytest.raises(ConfigError, match=expected):
        catalog.load_tasks([f"core:{folder}"], Config())


def test_a_missing_core_bundle_says_what_core_path_names(tmp_path):
    with pytest.raises(ConfigError, match=r"core\.yaml: no such file; core:PATH names a CORE bundle's folder"):
        catalog.load_tasks([f"core:{tmp_path / 'nowhere'}"], Config())


def test_ranks_that_read_different_items_are_refused_alike():
    """What every rank decides from the ranks' answers (items.agree): the same digest everywhere
    passes; another digest, or a rank that could not read its tasks, stops them all, named."""
    from lmcockpit.core.tasks.items import Digest, agree, digest

    here = [Task("t", "multiple_choice", (Item(("a",), (" b", " c"), 0),))]
    there = [Task("t", "multiple_choice", (Item(("a",), (" b", " d"), 0),))]
    assert digest(here) == digest([Task("t", "multiple_choice", (Item(("a",), (" b", " c"), 0),))])
    assert digest(here) != digest(there) and digest(here) != digest([Task("t", "multiple_choice", (), fewshot=1)])
    agree([Digest(digest(here))] * 3)
    with pytest.raises(ConfigError, match=r"rank 0 and rank 2 differ\): every machine must hold the same task files"):
        agree([Digest(digest(here)), Digest(digest(here)), Digest(digest(there))])
    with pytest.raises(ConfigError, match=r"^rank 1: eval.tasks: /data/mine.jsonl: no such task file$"):
        agree([Digest(digest(here)), "eval.tasks: /data/mine.jsonl: no such task file", Digest(digest(here))])


def test_a_bundle_s_link_may_not_lead_out_of_it_and_the_user_s_own_link_is_followed(tmp_path):
    """A bundle is a download: a link in it to a file elsewhere is refused as `../` is. A task file
    the user names through a link of their own is read."""
    folder = write_bundle(tmp_path / "bundle")
    outside = write_lines(tmp_path / "outside.jsonl", [{"context": "a", "continuation": "b"}])
    (folder / "eval_data" / "lm" / "tiny_lm.jsonl").unlink()
    (folder / "eval_data" / "lm" / "tiny_lm.jsonl").symlink_to(outside)
    with pytest.raises(ConfigError, match=r"icl_tasks\[3\]: dataset_uri 'lm/tiny_lm.jsonl': expected the path of a "
                                          r"file under"):
        catalog.load_tasks([f"core:{folder}"], Config())
    (tmp_path / "mine.jsonl").symlink_to(outside)
    assert catalog.load_task(str(tmp_path / "mine.jsonl"), Config()).items == (Item(("a",), ("b",)),)


def test_a_task_file_is_read_to_its_stated_size_and_no_further(tmp_path, monkeypatch):
    """The limit a module constant, set small here: the real one is 256 MiB, which a test would
    spend seconds writing."""
    from lmcockpit.core.tasks import reading

    monkeypatch.setattr(reading, "MAX_FILE_BYTES", 1000)
    row = json.dumps({"context": "a" * 30, "continuation": "b"}) + "\n"
    path = tmp_path / "big.jsonl"
    path.write_text(row * (1000 // len(row)) + "\n" * (1000 % len(row)))
    assert path.stat().st_size == 1000 and len(files.read_task(path).items) == 1000 // len(row)
    path.write_text(path.read_text() + "\n")
    with pytest.raises(ConfigError, match=r"^eval.tasks: .*big\.jsonl: larger than 1,000 bytes, more than lmcockpit "
                                          r"reads of a task file$"):
        files.read_task(path)

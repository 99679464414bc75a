"""Files and values made to break a parser or to be followed where they should not be, through the
real `lmcockpit` command as a user meets them: a preset nested hundreds of levels deep, a number of
thousands of digits, a source folder that links to itself, a JSON line nested thousands deep, a
cache whose source name is Rich markup, a cache entry that is a link, a link planted where a
shared cache folder's tokenizer is saved, task sources that never end, are no file, point out of
their bundle or multiply by aliases. Each is one `error:` line and exit 2, or the command
copes and says so; never a traceback, never a write or a removal through a link."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from .helpers import QUICK_BUILD, TINY, as_set, cli, one_error

pytestmark = pytest.mark.slow

def corpus(folder: Path) -> Path:
    folder.mkdir()
    for i in range(6):
        (folder / f"doc{i}.txt").write_text(f"document {i} says hello to the world, line after line.\n" * 60)
    return folder


# ---------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("nested", ["[" * 1000 + "]" * 1000, "{a = " * 1000 + "1" + "}" * 1000],
                         ids=["arrays", "inline-tables"])
def test_a_preset_nested_a_thousand_levels_deep_is_one_error_line(tmp_path, nested):
    preset = tmp_path / "deep.toml"
    preset.write_text(f"[training]\nmax_steps = 10\nx = {nested}\n")
    line = one_error(cli("--run", str(preset)), str(preset), "nested hundreds of levels deep")
    assert len(line) < 200


@pytest.mark.parametrize("override, words", [
    # More digits than Python turns into an int at all (sys.get_int_max_str_digits).
    ("training.max_steps=" + "9" * 5000, ["--set training.max_steps", "5,000 characters", "more than 4,300 digits",
                                          "expected a 64-bit integer"]),
    # An int, but none that a count can be: the token budget's float arithmetic overflowed on it.
    ("training.max_steps=" + "9" * 400, ["training.max_steps = 9999", "400 digits", "out of range",
                                         "expected a 64-bit integer"]),
    # A float key given an int beyond any float.
    ("optimizer.lr=" + "9" * 400, ["optimizer.lr = 9999", "400 digits", "beyond any float",
                                   "expected a finite number"]),
    ("sample.prompts=" + "[" * 1000 + "]" * 1000, ["--set sample.prompts", "nested hundreds of levels deep"]),
], ids=["int-of-5000-digits", "int-of-400-digits", "float-of-400-digits", "list-1000-deep"])
def test_a_value_of_thousands_of_digits_is_refused_naming_the_key_abbreviated(override, words):
    line = one_error(cli("data", "info", "debug", "--set", override), *words)
    assert len(line) < 300, line  # the value abbreviated, not printed whole


def test_a_preset_holding_an_integer_of_thousands_of_digits_names_its_line(tmp_path):
    preset = tmp_path / "big.toml"
    preset.write_text("[training]\nseq_len = 64\nmax_steps = " + "1" * 5000 + "\n")
    line = one_error(cli("data", "info", str(preset)), f"{preset}: line 3: an integer of more than 4,300 digits",
                     "expected a 64-bit integer")
    assert len(line) < 300, line


# -------------------------------------------------------------------------------- the source
def test_a_symlink_loop_in_a_source_folder_is_skipped_and_said(tmp_path):
    """A link to itself and a link to the folder it is in: neither is a document. Skipped, each
    named in one line of the log, and the rest prepared: a folder of data with one bad link still
    trains, as it does with an archive beside its files. Read, the folder link would have listed
    every file again under ever longer names until the kernel said ELOOP."""
    source = corpus(tmp_path / "corpus")
    (source / "loop").symlink_to("loop")
    (source / "again").symlink_to(".")
    proc = cli("data", "prepare", "debug", *as_set(f'data.source="{source}"', f'data.cache_dir="{tmp_path / "c"}"',
                                                   *QUICK_BUILD))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out
    assert f"data: {source / 'loop'}: a symbolic link that loops (Too many levels of symbolic links), " \
           "not a document: skipped" in proc.stdout.splitlines(), out
    assert f"data: {source / 'again'}: a link to the folder {source}, which holds it: skipped" in proc.stdout, out
    meta = json.loads(next((tmp_path / "c").glob("*/meta.json")).read_text())
    assert meta["documents"]["train"] + meta["documents"]["val"] == 6  # each file once


def test_a_source_that_is_itself_a_symlink_loop_is_one_error_line(tmp_path):
    (tmp_path / "loop").symlink_to("loop")
    one_error(cli("data", "prepare", "debug", *as_set(f'data.source="{tmp_path / "loop"}"')),
              f"data.source = '{tmp_path / 'loop'}': a symbolic link that loops, not a file or folder")


def test_a_json_line_nested_thousands_deep_is_refused_naming_file_and_line(tmp_path):
    """As any record that is no object with a text field: the build stops at it, naming where."""
    source = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": f"document {i} " * 40}) for i in range(20)]
    lines.insert(12, '{"text": "deep", "x": ' + "[" * 10_000 + "]" * 10_000 + "}")
    source.write_text("\n".join(lines) + "\n")
    line = one_error(cli("data", "prepare", "debug",
                         *as_set(f'data.source="{source}"', f'data.cache_dir="{tmp_path / "c"}"', *QUICK_BUILD)),
                     f"{source}:13: a JSON record nested too deeply to read",
                     "expected an object with a string field 'text' (data.text_field)")
    assert len(line) < 300, line


# ---------------------------------------------------------------------------------- caches
def fake_cache(folder: Path, source: str) -> Path:
    """A complete cache's meta.json, as `data info` reads it: what the listing shows."""
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"format": 2, "source": source, "vocab_size": 300,
                                                  "train_tokens": 5, "val_tokens": 1}))
    return folder


def test_a_cache_whose_source_is_rich_markup_is_listed_and_removed_as_it_is(tmp_path):
    """A source is a folder's name or whatever a meta.json says: `[/x]` is text, not a closing tag,
    and `:fire:` no emoji."""
    caches = tmp_path / "caches"
    fake_cache(caches / "aaaa", "corpus[/x]")
    fake_cache(caches / "bbbb", "[bold]b[/] :fire:")
    (caches / ".build-cccc").mkdir()
    (caches / ".build-cccc" / "plan.json").write_text(json.dumps({"source": "[/]", "pieces": 2}))
    listed = cli("data", "info", "--cache-dir", str(caches))
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    for source in ("corpus[/x]", "[bold]b[/] :fire:", ": [/]"):
        assert source in listed.stdout, listed.stdout
    removed = cli("data", "rm", "bbbb", "--cache-dir", str(caches))
    assert removed.returncode == 0, removed.stderr
    assert removed.stdout.startswith("removed token cache bbbb (0.0 MB, [bold]b[/] :fire:)"), removed.stdout


def test_rm_of_a_cache_that_is_a_link_removes_the_link_alone_and_leaves_no_lock(tmp_path):
    """A link in the cache folder (a cache moved to another disk, or a name someone else planted):
    `data rm` removes the link, as `rm` does, never what it points to, and says so."""
    caches, elsewhere = tmp_path / "caches", fake_cache(tmp_path / "precious", "s")
    (elsewhere / "thesis.tex").write_text("years of work")
    caches.mkdir()
    (caches / "dddd").symlink_to(elsewhere)
    listed = cli("data", "info", "--cache-dir", str(caches))
    assert f"dddd  complete  5 train / 1 val tokens  vocab 300  (a link to {elsewhere})" in listed.stdout
    proc = cli("data", "rm", "dddd", "--cache-dir", str(caches))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out
    assert proc.stdout.startswith(f"removed the link {caches / 'dddd'} to {elsewhere}; the token cache there "), out
    assert "was left as it is" in proc.stdout
    assert sorted(p.name for p in caches.iterdir()) == [], "the link, or a lock, was left"
    assert (elsewhere / "thesis.tex").read_text() == "years of work" and (elsewhere / "meta.json").is_file()


def test_rm_refuses_a_link_planted_where_the_cache_s_lock_belongs(tmp_path):
    caches = tmp_path / "caches"
    fake_cache(caches / "eeee", "s")
    (caches / ".build-eeee.lock").symlink_to(tmp_path / "created-through-the-link")
    one_error(cli("data", "rm", "eeee", "--cache-dir", str(caches)), str(caches / ".build-eeee.lock"),
              "a symbolic link where the lock belongs: refused")
    assert not (tmp_path / "created-through-the-link").exists()
    assert (caches / "eeee" / "meta.json").is_file()


def test_a_link_planted_where_a_mixture_s_tokenizer_is_saved_is_not_written_through(tmp_path):
    """A mixture's BPE is saved beside the caches, in the cache folder itself, which may be shared
    and writable by others. The folder it was saved into had a name anyone could guess
    (tokenizer-KEY.tmp): a link planted there had the tokenizer written wherever it pointed, and the
    link then renamed into the mixture's tokenizer."""
    from lmcockpit.core.config import load_config
    from lmcockpit.core.data import sources, store

    a, b, caches = corpus(tmp_path / "a"), corpus(tmp_path / "b"), tmp_path / "caches"
    mixture = [f'data.sources=[{{source = "{a}"}}, {{source = "{b}", weight = 2.0}}]',
               f'data.cache_dir="{caches}"', *QUICK_BUILD]
    cfg, _ = load_config("debug", mixture)
    key = store.mixture_tokenizer_key(cfg, [sources.list_source(part.data) for part in cfg.data_parts()])
    victim = tmp_path / "victim"
    victim.mkdir()
    caches.mkdir()
    (caches / f"{key}.tmp").symlink_to(victim)
    proc = cli("data", "prepare", "debug", *as_set(*mixture))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(victim.iterdir()) == [], "the tokenizer was written through the link"
    tokenizer = caches / key
    assert not tokenizer.is_symlink() and (tokenizer / "tokenizer.json").is_file()
    assert not [p.name for p in caches.iterdir() if ".tmp" in p.name or ".spool" in p.name]


# ------------------------------------------------------------------------------- run folders
def test_a_run_folder_whose_files_nest_past_reading_is_read_around(tmp_path):
    """A config.toml and a metrics.jsonl line nested thousands deep (a RecursionError from the
    parsers, which is no ValueError): the launch screen's summary, the metrics readers and
    `compare` pass over what cannot be read and show the rest."""
    from lmcockpit.core.run.folder import read_metrics, run_summary

    step = {"kind": "step", "time": 0, "step": 3, "loss": 2.5, "lr": 0.01, "grad_norm": 1.0, "tokens_per_s": 9.0,
            "dt": 0.1}
    runs = []
    for name in ("a", "b"):
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        (run / "config.toml").write_text("[training]\nmax_steps = " + "[" * 2000 + "]" * 2000 + "\n")
        (run / "metrics.jsonl").write_text(json.dumps(step) + "\n" + "[" * 20_000 + "]" * 20_000 + "\n")
        runs.append(str(run))
    summary = run_summary(Path(runs[0]))
    assert (summary["step"], summary["loss"], summary["max_steps"]) == (3, 2.5, None)
    assert [r["step"] for r in read_metrics(Path(runs[0]))] == [3]
    one_error(cli("compare", *runs), "config.toml", "nested hundreds of levels deep")
    for run in runs:  # a config compare can read: the metrics line alone is passed over
        (Path(run) / "config.toml").write_text((Path(__file__).resolve().parents[1] / "presets" / "debug.toml").read_text())
    proc = cli("compare", *runs)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "2.5" in proc.stdout, proc.stdout


# ------------------------------------------------------------------------------- task sources
# 387 million values from nine lines, as one task's label (which str() would spell out)
BILLION_LAUGHS = ("lol0: &a0 [lol]\n" + "".join(f"lol{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 10))
                  + "icl_tasks:\n- {label: *a9, dataset_uri: t.jsonl, icl_task_type: language_modeling}\n")
CORE_TASK = "icl_tasks:\n- {label: t, dataset_uri: t.jsonl, icl_task_type: language_modeling, num_fewshot: [%s]}\n"


def bundle(folder: Path, core_yaml: str, baselines: str | None = "Eval Task,Random baseline\nt,0\n") -> str:
    """A CORE bundle (core:PATH) of one language-modelling task, its core.yaml as given."""
    (folder / "eval_data").mkdir(parents=True)
    (folder / "core.yaml").write_text(core_yaml)
    if baselines is not None:
        (folder / "eval_meta_data.csv").write_text(baselines)
    (folder / "eval_data" / "t.jsonl").write_text(json.dumps({"context": "import", "continuation": " os"}) + "\n")
    return f"core:{folder}"


def task_file(folder: Path, first_line: str) -> str:
    path = folder / "bad.jsonl"
    path.write_text(first_line + "\n" + json.dumps({"context": "import", "continuation": " os"}) + "\n")
    return str(path)


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def fifo_baselines(folder: Path) -> str:
    spec = bundle(folder, CORE_TASK % 0, baselines=None)
    fifo(folder / "eval_meta_data.csv")
    return spec


# Each named by a run's eval.tasks, as a config or a copied run folder can name it. Before, each
# hung (a FIFO), read without end (/dev/zero, 5 GB for a 400 MB line), or ended in a traceback.
TASK_SOURCES = {
    "dev-zero": (lambda tmp: "/dev/zero", ["eval.tasks: /dev/zero: a character device: expected a regular file"]),
    "fifo": (lambda tmp: str(fifo(tmp / "pipe.jsonl")), ["pipe.jsonl: a named pipe: expected a regular file"]),
    "fifo-baselines": (fifo_baselines, ["eval_meta_data.csv: a named pipe: expected a regular file"]),
    "uri-leaving-the-bundle": (
        lambda tmp: bundle(tmp / "b", CORE_TASK.replace("t.jsonl", "../" * 40 + "dev/zero") % 0),
        ["core.yaml: icl_tasks[1]: dataset_uri '../../", "(128 characters)", "expected the path of a file under"]),
    "billion-laughs": (lambda tmp: bundle(tmp / "b", BILLION_LAUGHS),
                       ["core.yaml: line 6: more than 100,000 values, counting each alias as all the values it names"]),
    "nested-20000-deep": (lambda tmp: bundle(tmp / "b", "icl_tasks: " + "[" * 20_000 + "]" * 20_000 + "\n"),
                          ["core.yaml: line 1: nested more than 100 levels deep"]),
    "num_fewshot-5000-digits": (lambda tmp: bundle(tmp / "b", CORE_TASK % ("9" * 5000)),
                                ["core.yaml: line 2: an integer of more than 4,300 digits: expected a small count"]),
    "core-yaml-over-1-MiB": (lambda tmp: bundle(tmp / "b", CORE_TASK % 0 + "#" * 2**20 + "\n", baselines=None),
                             ["core.yaml: larger than 1 MiB"]),
    "gold-5000-digits": (lambda tmp: task_file(tmp, '{"context": "a", "choices": ["b", "c"], "gold": ' + "9" * 5000 + "}"),
                         ["bad.jsonl:1: an integer of more than 4,300 digits: expected a small count"]),
    "fewshot-5000-digits": (lambda tmp: task_file(tmp, '{"fewshot": ' + "9" * 5000 + "}"),
                            ["bad.jsonl:1: an integer of more than 4,300 digits"]),
    "line-over-1-MiB": (lambda tmp: task_file(tmp, "x" * (2**20 + 1)),
                        ["bad.jsonl:1: a line longer than 1 MiB; expected one item a line"]),
}


@pytest.mark.parametrize("case", TASK_SOURCES)
def test_a_hostile_task_source_is_one_error_line_before_the_run_starts(tmp_path, case):
    make, words = TASK_SOURCES[case]
    name, out = make(tmp_path), tmp_path / "run"
    proc = cli("--run", "debug", *as_set(*TINY, f"eval.tasks=[{json.dumps(name)}]"), "--out", str(out), timeout=120)
    line = one_error(proc, *words)
    assert len(line) < 400, line
    assert not out.exists()

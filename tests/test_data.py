import json

import numpy as np
import pytest

from lmcockpit.core import corpus, token_cache
from lmcockpit.core.config import ConfigError

from .conftest import tiny_config


def prepare(cfg):
    logs = []
    data = token_cache.prepare(cfg, logs.append, lambda *a: None)
    return data, logs


def test_cache_is_built_once_and_reused():
    cfg = tiny_config()
    first, _ = prepare(cfg)
    bin_mtime = (first.dir / "train.bin").stat().st_mtime_ns
    second, logs = prepare(cfg)
    assert second.reused and second.dir == first.dir
    assert any("reusing token cache" in line for line in logs)
    assert (second.dir / "train.bin").stat().st_mtime_ns == bin_mtime
    assert np.array_equal(np.asarray(first.train), np.asarray(second.train))
    # what decides the tokens is in the key: another vocabulary is another cache
    other, _ = prepare(tiny_config("tokenizer.vocab_size=600"))
    assert not other.reused and other.dir != first.dir


def test_stdlib_split_is_by_file_and_deterministic():
    cfg = tiny_config().data
    _, files = corpus.list_source_files(cfg)
    docs = list(corpus.iter_documents(cfg, files))
    train, val = corpus.split_documents(cfg, docs)
    train2, val2 = corpus.split_documents(cfg, list(reversed(docs)))
    assert [d.id for d in val] == [d.id for d in val2] and [d.id for d in train] == [d.id for d in train2]
    assert not {d.id for d in train} & {d.id for d in val}
    assert all(d.id.endswith(".py") for d in train + val)
    assert sum(len(d.text) for d in train + val) < cfg.max_bytes * 1.2


def test_tokens_decode_back_to_the_text_and_the_tokenizer_loads_in_transformers():
    from transformers import AutoTokenizer

    data, _ = prepare(tiny_config())
    tok = AutoTokenizer.from_pretrained(str(data.tokenizer_dir))
    text = "def f(x):\n    return x ** 2  # ünïcode\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == data.eos_id
    # the stream is documents separated by EOS, and token byte lengths count UTF-8 bytes
    assert data.eos_id in np.asarray(data.train[:200_000])
    assert data.token_bytes[data.eos_id] == 0
    assert sum(data.token_bytes[i] for i in ids) == len(text.encode())


def test_text_folder_and_jsonl_sources(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(6):
        (folder / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps. " * 300)
    data, _ = prepare(tiny_config(f"data.source=\"{folder}\"", "data.val_fraction=0.3",
                                  "tokenizer.vocab_size=300", "data.max_bytes=0"))
    assert len(data.train) > 1000 and len(data.val) > 65

    jl = tmp_path / "corpus.jsonl"
    jl.write_text("\n".join(json.dumps({"body": f"record {i} " + "lorem ipsum dolor " * 50}) for i in range(40)))
    data, _ = prepare(tiny_config(f"data.source=\"{jl}\"", "data.text_field=\"body\"", "data.val_fraction=0.2",
                                  "tokenizer.vocab_size=300", "data.max_bytes=0"))
    assert len(data.train) > len(data.val) > 65


@pytest.mark.parametrize("setup, message", [
    (lambda p: p / "missing", "no such file or folder"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "no text found"),
    (lambda p: (p / "tiny.txt").write_text("just a few words\n") and p / "tiny.txt", "need at least two"),
])
def test_bad_sources_are_config_errors(tmp_path, setup, message):
    path = setup(tmp_path)
    with pytest.raises(ConfigError, match=message):
        prepare(tiny_config(f"data.source=\"{path}\"", "data.max_bytes=0"))


def test_corpus_too_small_for_one_sequence(tmp_path):
    folder = tmp_path / "small"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.txt").write_text("short text " * 3)
    with pytest.raises(ConfigError, match="fewer than one sequence"):
        prepare(tiny_config(f"data.source=\"{folder}\"", "data.max_bytes=0", "data.val_fraction=0.4",
                            "tokenizer.vocab_size=300"))


def test_malformed_jsonl_names_the_line(tmp_path):
    jl = tmp_path / "bad.jsonl"
    jl.write_text('{"text": "fine"}\n{"content": "no text field"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: expected an object with a string field 'text'"):
        prepare(tiny_config(f"data.source=\"{jl}\"", "data.max_bytes=0"))

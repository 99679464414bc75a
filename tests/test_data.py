import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from lmcockpit.core.config import ConfigError
from lmcockpit.core.data import prepare as data_prepare

from .helpers import tiny_config


def prepare(cfg):
    logs = []
    data = data_prepare.prepare(cfg, logs.append, lambda *a: None)
    return data, logs


@pytest.mark.slow
def test_cache_is_built_once_and_reused():
    cfg = tiny_config()
    first, _ = prepare(cfg)
    bin_mtime = (first.dir / "shards" / "00000.train.bin").stat().st_mtime_ns
    second, logs = prepare(cfg)
    assert second.reused and second.dir == first.dir
    assert any("reusing token cache" in line for line in logs)
    assert (second.dir / "shards" / "00000.train.bin").stat().st_mtime_ns == bin_mtime
    assert np.array_equal(np.asarray(first.train), np.asarray(second.train))
    # what decides the tokens is in the key: another vocabulary is another cache
    other, _ = prepare(tiny_config("tokenizer.vocab_size=600"))
    assert not other.reused and other.dir != first.dir


def test_stdlib_split_is_by_file_and_deterministic():
    """Each stdlib file is one document (or, past 128 KB, a few cut at line ends), on one side."""
    from lmcockpit.core.data import readers, sources, split

    cfg = tiny_config().data
    source = sources.list_source(cfg)
    text_bytes = sum(readers.text_bytes(f, cfg.text_field) for f in source.files)
    sel = split.Selection(split.keep_share(cfg.max_bytes, text_bytes), cfg.val_fraction)
    docs = [d for p in sources.plan_pieces(source, cfg, sel.keep) for d in readers.read_piece(p, cfg.text_field, sel.kept)]
    val = {d.id for d in docs if sel.is_val(d.id)}
    assert len(val) < len(docs)
    assert all(d.id.endswith(".py") or "@" in d.id for d in docs)
    assert 0.8 * cfg.max_bytes < sum(len(d.text) for d in docs) < cfg.max_bytes * 1.2


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


@pytest.mark.slow
def test_text_folder_and_jsonl_sources(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(6):
        (folder / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps. " * 300)
    data, _ = prepare(tiny_config(f"data.source=\"{folder}\"", "data.val_fraction=0.3",
                                  "tokenizer.vocab_size=300", "data.max_bytes=0"))
    assert len(data.train) > 1000 and len(data.val) > 65

    jl = tmp_path / "sources.jsonl"
    jl.write_text("\n".join(json.dumps({"body": f"record {i} " + "lorem ipsum dolor " * 50}) for i in range(40)))
    data, _ = prepare(tiny_config(f"data.source=\"{jl}\"", "data.text_field=\"body\"", "data.val_fraction=0.2",
                                  "tokenizer.vocab_size=300", "data.max_bytes=0"))
    assert len(data.train) > len(data.val) > 65


@pytest.mark.slow
@pytest.mark.parametrize("setup, message", [
    (lambda p: p / "missing", "no such file or folder"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "no text found"),
    (lambda p: (p / "tiny.txt").write_text("just a few words\n") and p / "tiny.txt", "need at least two"),
])
def test_bad_sources_are_config_errors(tmp_path, setup, message):
    path = setup(tmp_path)
    with pytest.raises(ConfigError, match=message):
        prepare(tiny_config(f"data.source=\"{path}\"", "data.max_bytes=0"))


@pytest.mark.slow
def test_corpus_too_small_for_one_sequence(tmp_path):
    folder = tmp_path / "small"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.txt").write_text("short text " * 3)
    with pytest.raises(ConfigError, match="fewer than one sequence"):
        prepare(tiny_config(f"data.source=\"{folder}\"", "data.max_bytes=0", "data.val_fraction=0.4",
                            "tokenizer.vocab_size=300"))


@pytest.mark.slow
def test_malformed_jsonl_names_the_line(tmp_path):
    jl = tmp_path / "bad.jsonl"
    jl.write_text('{"text": "fine"}\n{"content": "no text field"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: expected an object with a string field 'text'"):
        prepare(tiny_config(f"data.source=\"{jl}\"", "data.max_bytes=0"))
    jl.write_text('{"text": "fine"}\n\n{text: "no quotes"}\n')  # a blank line is skipped, still counted
    with pytest.raises(ConfigError, match=rf"^{jl}:3: not valid JSON \(Expecting property name enclosed in double"):
        prepare(tiny_config(f"data.source=\"{jl}\"", "data.max_bytes=0"))


@pytest.mark.slow
def test_a_single_text_file_is_cut_into_documents_at_line_ends(tmp_path):
    """One big file would be one document, all train or all validation: it is cut at line ends
    into documents of about CHUNK_BYTES, which split as a folder's files do."""
    from lmcockpit.core.data import readers, sources, split

    text = "".join(f"line {i}: {'the quick brown fox jumps over the lazy dog ' * (i % 5 + 1)}\n" for i in range(4000))
    assert len(text) > 6 * readers.CHUNK_BYTES
    book = tmp_path / "book.txt"
    book.write_text(text)
    cfg = tiny_config(f"data.source=\"{book}\"", "data.max_bytes=0", "data.val_fraction=0.2",
                      "tokenizer.vocab_size=300")
    source = sources.list_source(cfg.data)
    docs = [d for p in sources.plan_pieces(source, cfg.data, 1.0) for d in readers.read_piece(p, "text", lambda _: True)]
    offsets = [0]
    for d in docs[:-1]:
        offsets.append(offsets[-1] + len(d.text.encode()))
    assert [d.id for d in docs] == [f"book.txt@{o}" for o in offsets] and len(docs) >= 6  # ids: byte offsets
    assert "".join(d.text for d in docs) == text  # nothing lost, nothing repeated, in order
    assert all(d.text.endswith("\n") for d in docs)
    assert all(readers.CHUNK_BYTES <= len(d.text) < readers.CHUNK_BYTES + 400 for d in docs[:-1])
    sel = split.Selection(1.0, cfg.data.val_fraction)
    train = [d for d in docs if not sel.is_val(d.id)]
    val = [d for d in docs if sel.is_val(d.id)]
    assert train and val
    data, _ = prepare(cfg)
    assert len(data.train) > len(data.val) > 65
    tok = Tokenizer.from_file(str(data.tokenizer_dir / "tokenizer.json"))
    trained_on = tok.decode(np.asarray(data.train).tolist())
    assert all(d.text[:200] in trained_on for d in train) and not any(d.text[:200] in trained_on for d in val)


def sentencepiece_style_folder(folder):
    """A tokenizer folder shaped like Llama 2's: Metaspace, byte-fallback tokens in the ordinary
    vocabulary, and `</s>` named as end-of-text by tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581"] + [chr(c) for c in range(33, 127)] + ["é"]
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = [("\u2581", "d"), ("e", "f")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}, "bos_token": "<s>"}))
    return tok


@pytest.mark.slow
def test_a_sentencepiece_style_tokenizer_counts_bytes_and_finds_its_end_token(tmp_path):
    from transformers import AutoTokenizer

    from lmcockpit.core.data.tokenizer import eos_id, token_byte_lengths

    tok = sentencepiece_style_folder(tmp_path / "spm")
    # "✓" and "😀" are not in the vocabulary: they fall back to their 3 and 4 UTF-8 bytes
    text = " def café(x): ✓ 😀\n"
    enc = tok.encode(text, add_special_tokens=False)
    assert {"<0xE2>", "<0xF0>", "\u2581d", "ef", "é"} <= set(enc.tokens)
    lengths = token_byte_lengths(tok, 512)
    assert sum(lengths[i] for i in enc.ids) == len(text.encode())
    assert eos_id(tok, tmp_path / "spm") == tok.token_to_id("</s>") == 2

    data, logs = prepare(tiny_config(f"tokenizer.kind=\"{tmp_path / 'spm'}\"", "tokenizer.vocab_size=512"))
    assert data.eos_id == 2 and data.eos_id in np.asarray(data.train[:100_000])  # documents end with </s>
    assert data.token_bytes[2] == 0 and not any("end-of-text" in line for line in logs)
    assert AutoTokenizer.from_pretrained(str(data.tokenizer_dir)).eos_token == "</s>"


@pytest.mark.slow
def test_a_tokenizer_without_an_end_token_is_said_once(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "noeos"
    folder.mkdir()
    vocab = {chr(c): i for i, c in enumerate([10, *range(32, 127)])} | {"[UNK]": 96}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.save(str(folder / "tokenizer.json"))
    data, logs = prepare(tiny_config(f"tokenizer.kind=\"{folder}\"", "tokenizer.vocab_size=128"))
    assert data.eos_id is None
    assert [line for line in logs if "no end-of-text token" in line]


@pytest.mark.slow
def test_a_resumed_run_keeps_its_own_tokenizer_when_the_data_changed(tmp_path):
    """A BPE trained again on changed data gives other ids; the checkpoint's weights know the old ones."""
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(6):
        (folder / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps. " * 300)
    cfg = tiny_config(f"data.source=\"{folder}\"", "data.val_fraction=0.3", "tokenizer.vocab_size=300",
                      "data.max_bytes=0")
    first, _ = prepare(cfg)
    run_tokenizer = tmp_path / "run-tokenizer.json"  # what a run folder keeps of it
    run_tokenizer.write_bytes((first.tokenizer_dir / "tokenizer.json").read_bytes())

    # unchanged data: the data's own cache serves
    logs: list[str] = []
    same = data_prepare.prepare(cfg, logs.append, lambda *a: None, run_tokenizer)
    assert same.reused and same.dir == first.dir

    (folder / "doc6.txt").write_text("zebra quartz jukebox vexing " * 400)
    changed, _ = prepare(cfg)
    assert (changed.tokenizer_dir / "tokenizer.json").read_bytes() != run_tokenizer.read_bytes()  # a new BPE
    logs = []
    kept = data_prepare.prepare(cfg, logs.append, lambda *a: None, run_tokenizer)
    assert kept.dir not in (first.dir, changed.dir)
    assert any("tokenising with the run's own tokenizer" in line for line in logs)
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(run_tokenizer))
    assert Tokenizer.from_file(str(kept.tokenizer_dir / "tokenizer.json")).get_vocab() == ours.get_vocab()
    decoded = ours.decode(np.asarray(kept.train[:2000]).tolist())
    assert decoded.startswith("document") or decoded.startswith("zebra")  # the tokens are the run's ids
    # and it is a cache like any other: the next resume reuses it
    again = data_prepare.prepare(cfg, lambda line: None, lambda *a: None, run_tokenizer)
    assert again.reused and again.dir == kept.dir


@pytest.mark.slow
def test_a_killed_cache_build_is_cleaned_up_by_the_next(tmp_path):
    import os
    import socket
    import subprocess

    root = tmp_path / "root"
    root.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()  # a process that has ended: its build was killed
    host = socket.gethostname()
    abandoned = root / f".tmp-0123abcd-{host}-{gone.pid}-k1ll3d"
    running = root / f".tmp-0123abcd-{host}-{os.getpid()}-bu1ld1"  # a build still under way
    elsewhere = root / f".tmp-0123abcd-not-{host}-{gone.pid}-sh4red"  # another machine's, in a shared folder
    for p in (abandoned, running, elsewhere):
        (p / "train.bin").parent.mkdir()
        (p / "train.bin").write_bytes(b"\0" * 1024)
    prepare(tiny_config(f"data.cache_dir=\"{root}\""))
    assert not abandoned.exists() and running.exists() and elsewhere.exists()


def test_the_stdlib_source_is_its_py_files_without_site_packages(tmp_path):
    """python-stdlib's files, listed at every run's start to find its token cache: no walk into
    what is installed under the stdlib (site-packages), links to folders not followed (as
    Path.rglob, which listed them before), a link to a file taken like the file."""
    from lmcockpit.core.data import sources

    root, elsewhere = tmp_path / "lib", tmp_path / "elsewhere"
    for rel in ["a.py", "pkg/b.py", "pkg/notes.txt", "pkg/__pycache__/b.cpython-311.pyc",
                "site-packages/numpy/c.py", "pkg/site-packages/d.py", "g.py/h.txt"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    (elsewhere / "e.py").parent.mkdir(parents=True)
    (elsewhere / "e.py").write_text("x = 1\n")
    (root / "linked").symlink_to(elsewhere, target_is_directory=True)
    (root / "f.py").symlink_to(elsewhere / "e.py")
    assert sorted(p.relative_to(root).as_posix() for p in sources.stdlib_files(root)) == ["a.py", "f.py", "pkg/b.py"]

    real = sources.stdlib_root()
    listed = sources.stdlib_files(real)
    assert real / "os.py" in listed and real / "json" / "decoder.py" in listed
    assert not [p for p in listed if "site-packages" in p.parts]

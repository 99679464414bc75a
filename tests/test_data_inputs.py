"""Inputs a user may point data.source at that are not what they seem: formats this does not
read, damaged files, odd bytes and odd layouts. Each is read, skipped or refused by name; none
is tokenised as noise, ends in a traceback, or hangs a build."""

from __future__ import annotations

import bz2
import io
import pickle
import random
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
import zstandard

from lmcockpit.core.config import ConfigError, DataConfig
from lmcockpit.core.data import readers, sources

from .helpers import WORDS, documents, records, texts_of, write_jsonl


# ------------------------------------------------------------------------------------- formats
def test_bz2_zstd_and_lzma_json_lines_read_like_their_plain_twin(tmp_path):
    import lzma

    texts = records(50)
    raw = write_jsonl(tmp_path / "twin.jsonl", texts).read_bytes()
    (tmp_path / "data.jsonl.bz2").write_bytes(bz2.compress(raw))
    (tmp_path / "c4.json.zstd").write_bytes(zstandard.ZstdCompressor().compress(raw))
    (tmp_path / "old.jsonl.lzma").write_bytes(lzma.compress(raw, format=lzma.FORMAT_ALONE))
    (tmp_path / "notes.txt.bz2").write_bytes(bz2.compress(b"a line of text\n"))
    for name in ("data.jsonl.bz2", "c4.json.zstd", "old.jsonl.lzma"):
        assert texts_of(tmp_path / name) == texts, name
    assert texts_of(tmp_path / "notes.txt.bz2") == ["a line of text\n"]


def zip_bytes() -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("corpus.jsonl", '{"text": "inside"}\n')
    return out.getvalue()


# Real bytes of each format: what a reader would have tokenised as text.
UNREAD = {
    "corpus.tgz": lambda: bz2.compress(b"not really tar, but named so"),
    "dump.7z": lambda: b"7z\xbc\xaf\x27\x1c\x00\x04" + bytes(range(256)),
    "x.zip": zip_bytes,
    "data.tar.gz": lambda: bz2.compress(b"archive"),
    "shard.jsonl.lz4": lambda: b"\x04\x22\x4d\x18" + bytes(range(256)),
    "page.txt.br": lambda: bytes(range(256)),
}


ARCHIVES = [("corpus.tgz", "a tar archive"), ("dump.7z", "a 7-Zip archive"), ("x.zip", "a ZIP archive"),
            ("data.tar.gz", "a tar archive")]
COMPRESSED = [("shard.jsonl.lz4", "LZ4-compressed"), ("page.txt.br", "Brotli-compressed")]


def refused(source: Path, name: str, what: str):
    with pytest.raises(ConfigError, match=rf"{name}: {what}, which lmcockpit does not read: .*it reads text, "
                                          r"JSON lines .*\.bz2\), \.parquet"):
        sources.list_source(DataConfig(source=str(source)))


@pytest.mark.parametrize("name, what", COMPRESSED)
def test_an_unread_compression_is_refused_by_name_alone_or_in_a_folder(tmp_path, name, what):
    write_jsonl(tmp_path / "fine.jsonl", records(5))
    (tmp_path / name).write_bytes(UNREAD[name]())
    refused(tmp_path / name, name, what)
    refused(tmp_path, name, what)


@pytest.mark.parametrize("name, what", ARCHIVES)
def test_an_archive_is_refused_as_the_source_and_skipped_beside_its_unpacked_files(tmp_path, name, what):
    texts = records(5)
    write_jsonl(tmp_path / "fine.jsonl", texts)
    (tmp_path / name).write_bytes(UNREAD[name]())
    refused(tmp_path / name, name, what)
    assert [f.rel for f in sources.list_source(DataConfig(source=str(tmp_path))).files] == ["fine.jsonl"]
    assert texts_of(tmp_path) == texts


BINARY = {
    "x.npz": lambda p: np.savez(p, a=np.arange(1000)),
    "data.pkl": lambda p: p.write_bytes(pickle.dumps({"weights": list(range(1000))})),
    "model.gguf": lambda p: p.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 4),
    "vectors.npy.gz": lambda p: p.write_bytes(bz2.compress(bytes(range(256)))),
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_a_binary_file_is_skipped_in_a_folder_and_refused_as_the_source(tmp_path, name):
    texts = records(5)
    write_jsonl(tmp_path / "fine.jsonl", texts)
    BINARY[name](tmp_path / name)
    assert (tmp_path / name).is_file()
    listed = sources.list_source(DataConfig(source=str(tmp_path)))
    assert [f.rel for f in listed.files] == ["fine.jsonl"]
    assert texts_of(tmp_path) == texts
    with pytest.raises(ConfigError, match=rf"{name}'?: not a format lmcockpit reads \(it reads text, JSON lines"):
        sources.list_source(DataConfig(source=str(tmp_path / name)))


def test_a_folder_is_listed_in_path_order_with_each_file_named_from_the_folder(tmp_path):
    """The order of a source's files decides its documents' order and its cache key: a folder
    sorts before a sibling file that extends its name ("a/" before "a.txt", though "." < "/" as
    characters); hidden files, __pycache__ and links to files and folders as rglob took them."""
    names = ["a.txt", "a/b/c.txt", "a/x.txt", "a-b/y.txt", "a0.txt", "Z/q.md", "A.txt", "é.txt", "sp ace.txt",
             ".hidden.txt", "__pycache__/k.txt", ".git/config"]
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"text of {name}\n")
    (tmp_path / "link").symlink_to(tmp_path / "a")
    (tmp_path / "l.txt").symlink_to(tmp_path / "a.txt")
    listed = sources.list_source(DataConfig(source=str(tmp_path))).files
    assert [f.rel for f in listed] == ["A.txt", "Z/q.md", "a/b/c.txt", "a/x.txt", "a-b/y.txt", "a.txt", "a0.txt",
                                       "l.txt", "link/b/c.txt", "link/x.txt", "sp ace.txt", "é.txt"]
    assert [f.path for f in listed] == sorted(f.path for f in listed)
    assert all(f.size == len(f"text of {f.rel.replace('link/', 'a/').replace('l.txt', 'a.txt')}\n".encode())
               for f in listed)


def test_a_file_of_an_unknown_suffix_is_still_text(tmp_path):
    (tmp_path / "wiki.train.tokens").write_text("plain text\n")
    assert texts_of(tmp_path / "wiki.train.tokens") == ["plain text\n"]


# ------------------------------------------------------------------------------ damaged files
def compressed(name: str, raw: bytes) -> bytes:
    import gzip
    import lzma

    if name.endswith(".gz"):
        return gzip.compress(raw)
    if name.endswith(".xz"):
        return lzma.compress(raw)
    if name.endswith(".bz2"):
        return bz2.compress(raw)
    return zstandard.ZstdCompressor().compress(raw)


def damage(name: str, how: str, raw: bytes) -> bytes:
    packed = compressed(name, raw)
    if how == "truncated":  # a download that stopped half way
        return packed[:len(packed) // 2]
    if how == "not compressed":  # a plain file given the suffix
        return raw
    flipped = bytearray(packed)  # bytes changed in the middle
    for i in range(len(flipped) // 2, len(flipped) // 2 + 16):
        flipped[i] ^= 0xFF
    return bytes(flipped)


@pytest.mark.parametrize("name, how", [
    ("a.jsonl.gz", "truncated"), ("a.jsonl.gz", "not compressed"),
    ("a.jsonl.xz", "truncated"), ("a.jsonl.xz", "corrupt"), ("a.jsonl.bz2", "truncated"),
    ("a.jsonl.bz2", "not compressed"), ("a.jsonl.zst", "not compressed"), ("a.jsonl.zst", "corrupt"),
    ("a.txt.gz", "truncated"),
    # zstandard's own reader stopped at a cut file's last whole block and said nothing: a text read short
    ("a.jsonl.zst", "truncated"), ("a.txt.zst", "truncated"),
])
def test_a_damaged_compressed_file_is_named_where_it_is_planned_and_where_it_is_read(tmp_path, name, how):
    from lmcockpit.core.data import budget, build, readers

    from .helpers import tiny_config

    path = tmp_path / name
    path.write_bytes(damage(name, how, write_jsonl(tmp_path / "twin", records(300)).read_bytes()))
    said = rf"{name}: damaged or truncated (gzip|xz|bzip2|zstd) file \(an interrupted download\? fetch it again\)"
    cfg = DataConfig(source=str(path))
    listed = sources.list_source(cfg)
    with pytest.raises(ConfigError, match=said):  # planning reads a compressed file's start for its size
        build.plan(cfg, listed)
    with pytest.raises(ConfigError, match=said):  # a worker reads it all
        [d for p in sources.plan_pieces(listed, cfg, 1.0) for d in readers.read_piece(p, "text", lambda _: True)]
    # The launch screen's budget says it as the source's problem rather than raise it.
    [part] = budget.parts(tiny_config(f"data.source=\"{path}\""))
    assert part.budget.epochs is None and re.search(said, part.problem)


def test_a_truncated_parquet_file_is_named_when_the_build_is_planned(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmcockpit.core.data import budget, build

    from .helpers import tiny_config

    whole = tmp_path / "whole.parquet"
    pq.write_table(pa.table({"text": records(300)}), whole, row_group_size=100)
    path = tmp_path / "train-00000.parquet"
    path.write_bytes(whole.read_bytes()[:whole.stat().st_size * 2 // 3])
    said = r"train-00000.parquet: not a readable Parquet file, damaged or truncated \(an interrupted download\?"
    cfg = DataConfig(source=str(path))
    with pytest.raises(ConfigError, match=said):
        build.plan(cfg, sources.list_source(cfg))
    [part] = budget.parts(tiny_config(f"data.source=\"{path}\""))
    assert re.search(said, part.problem)


def test_json_lines_cut_inside_a_record_say_the_file_looks_truncated(tmp_path):
    name = "a.jsonl"
    raw = write_jsonl(tmp_path / "twin", records(3000)).read_bytes()
    (tmp_path / name).write_bytes(raw[:len(raw) // 2])
    with pytest.raises(ConfigError, match=rf"{name}:\d+: not valid JSON \(.*\), and the file ends inside it: "
                                          r"truncated\? \(an interrupted download"):
        texts_of(tmp_path / name)


def test_a_damaged_file_stops_a_build_with_its_name_not_a_traceback(tmp_path):
    from lmcockpit.core.data.prepare import prepare

    from .helpers import tiny_config

    write_jsonl(tmp_path / "fine.jsonl", records(100))
    (tmp_path / "part.jsonl.gz").write_bytes(damage("x.gz", "truncated", (tmp_path / "fine.jsonl").read_bytes()))
    cfg = tiny_config(f"data.source=\"{tmp_path}\"", f"data.cache_dir=\"{tmp_path / 'cache'}\"")
    with pytest.raises(ConfigError, match=r"part.jsonl.gz: damaged or truncated gzip file"):
        prepare(cfg, lambda line: None, lambda *a: None)


# ----------------------------------------------------------------------------------- odd bytes
def test_raw_surrogate_bytes_in_a_json_line_are_mended_like_escaped_ones(tmp_path):
    """CESU-8 / WTF-8 writes a surrogate as three bytes (ED A0..BF xx): json.loads takes them in,
    and the str they make has no UTF-8."""
    lone, pair = "\ud800".encode("utf-8", "surrogatepass"), "\ud83d\ude00".encode("utf-16-be", "surrogatepass")
    cesu_pair = b"".join(chr(int.from_bytes(pair[i:i + 2], "big")).encode("utf-8", "surrogatepass") for i in (0, 2))
    assert lone == b"\xed\xa0\x80" and cesu_pair == b"\xed\xa0\xbd\xed\xb8\x80"
    (tmp_path / "s.jsonl").write_bytes(b'{"text": "a ' + lone + b' b"}\n{"text": "smile ' + cesu_pair + b'"}\n'
                                       + '{"text": "한국어 \\ud83d\\ude00"}\n'.encode())
    texts = texts_of(tmp_path / "s.jsonl")
    assert texts == ["a \ufffd b", "smile \U0001F600", "한국어 \U0001F600"]
    assert all(t.encode() for t in texts)


# ------------------------------------------------------------------------------- dying workers
def worker_build(tmp_path: Path, lines: list[str]):
    """A build of `lines` (JSON lines) by two workers in pieces of 30 kB, with a BPE given rather
    than trained (the tests here are about the workers)."""
    from lmcockpit.core.config import TokenizerConfig
    from lmcockpit.core.data import tokenizer

    from .helpers import tiny_config

    source = tmp_path / "c.jsonl"
    source.write_text("".join(line + "\n" for line in lines))
    bpe = tmp_path / "bpe"
    if not bpe.is_dir():
        tokenizer.save_hf_tokenizer(tokenizer.train_bpe(records(100), TokenizerConfig(vocab_size=300)), bpe,
                                    tokenizer.EOS)
    return tiny_config(f"data.source=\"{source}\"", f"data.cache_dir=\"{tmp_path / 'cache'}\"", "data.max_bytes=0",
                       f"tokenizer.kind=\"{bpe}\"", "tokenizer.vocab_size=300", "data.shard_bytes=30_000",
                       "data.workers=2")


@pytest.mark.slow
def test_a_worker_killed_mid_build_stops_it_naming_its_piece_and_preparing_again_resumes(tmp_path):
    """The OOM killer's SIGKILL on one tokenizing worker, from outside, as it comes: the build stops
    at once naming the piece and the cause (a Pool put a new worker in its place and waited for
    ever for that piece, the bar frozen), and what was finished serves the next build."""
    import json
    import time

    import psutil

    from lmcockpit.core.data import tokenizer
    from lmcockpit.core.data.prepare import prepare

    texts = records(1200)
    cfg = worker_build(tmp_path, [json.dumps({"text": t}) for t in texts])
    killed: list[float] = []

    def progress(stage, done, total, unit):
        if stage != "tokenizing" or not (pieces := list(tmp_path.glob("cache/.build-*/pieces/*.json"))):
            return
        if not killed:  # a piece is finished, and each worker is on another of the 13
            workers = [p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]
            assert len(workers) == 2 and len(pieces) < 10
            workers[0].kill()
            killed.append(time.monotonic())
        assert time.monotonic() - killed[0] < 30, "the build went on waiting for the dead worker's piece"

    with pytest.raises(ConfigError, match=r"^data: a tokenizing process died \(exit code -9: killed, out of "
                                          r"memory\?\) on piece \d+ \(c\.jsonl, bytes \d+-\d+\); the pieces "
                                          r"finished are kept, and preparing again goes on from them"):
        prepare(cfg, lambda line: None, progress)
    assert killed
    logs: list[str] = []
    data = prepare(cfg, logs.append, lambda *a: None)
    assert any(line.startswith("data: resuming an interrupted preparation: ") for line in logs), logs
    tok = tokenizer.load_tokenizer("bpe", data.dir / "tokenizer")
    assert tok.decode(np.asarray(data.train[0:len(data.train)]).tolist()).count("record ") + \
        tok.decode(np.asarray(data.val[0:len(data.val)]).tolist()).count("record ") == len(texts)


@pytest.mark.slow
def test_an_error_in_a_worker_is_raised_by_the_build(tmp_path):
    import json

    from lmcockpit.core.data.prepare import prepare

    lines = [json.dumps({"text": t}) for t in records(1200)]
    lines[700] = "not json"
    with pytest.raises(ConfigError, match=r"c\.jsonl:701: not valid JSON") as raised:
        prepare(worker_build(tmp_path, lines), lambda line: None, lambda *a: None)
    assert any("Traceback" in note and "_jsonl" in note for note in raised.value.__notes__)  # the worker's


# -------------------------------------------------------------------------------- long lines
def one_line_text(n_words: int, seed: int = 0) -> str:
    """text8's shape: words and single spaces, no line end at all."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def test_a_text_on_one_line_is_cut_at_spaces_into_bounded_documents(tmp_path):
    text = one_line_text(400_000)  # 2.7 MB
    (tmp_path / "text8").write_text(text)
    docs = texts_of(tmp_path / "text8", shard_bytes=500_000)
    assert "".join(docs) == text  # nothing lost, nothing twice, across the pieces' cuts
    assert len(docs) > len(text.encode()) // (readers.CHUNK_BYTES + readers.LINE_BYTES)
    assert max(len(d.encode()) for d in docs) <= readers.CHUNK_BYTES + readers.LINE_BYTES
    assert all(d.endswith(" ") for d in docs[:-1])  # no word split


def test_a_piece_of_a_one_line_text_reads_about_its_own_bytes(tmp_path):
    """A piece after the first read the rest of the line to find where its range starts: the whole
    remaining file, in memory, in every worker."""
    import tracemalloc

    (tmp_path / "text8").write_text(one_line_text(600_000))  # 3.4 MB
    cfg = DataConfig(source=str(tmp_path / "text8"), shard_bytes=400_000)
    pieces = sources.plan_pieces(sources.list_source(cfg), cfg, 1.0)
    assert len(pieces) > 5
    tracemalloc.start()
    try:
        n = sum(len(d.text) for d in readers.read_piece(pieces[1], "text", lambda _: True))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert abs(n - 400_000) < 2 * readers.CUT_WINDOW
    assert peak < 1_000_000, peak


@pytest.mark.parametrize("shard_bytes", [9_000, 40_000, 65_536, 100_000, 333_333])
def test_long_lines_among_short_ones_are_read_once_whatever_the_pieces(tmp_path, shard_bytes):
    """Every cut of every range meets the next one's: long lines with spaces, a CR-only text, and
    a long line without a space (CJK: three bytes a character, never split)."""
    rng = random.Random(shard_bytes)
    lines = [one_line_text(rng.randint(1, 30), seed=i) + "\n" for i in range(300)]
    lines[40] = one_line_text(40_000, seed=1) + "\n"
    lines[41] = one_line_text(20_000, seed=2).replace(" ", "\r") + "\n"
    lines[42] = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(90_000)) + "\n"
    lines[200] = "é" * 70_000 + "\n"
    text = "".join(lines)
    (tmp_path / "mixed.txt").write_text(text)
    docs = documents(tmp_path / "mixed.txt", shard_bytes=shard_bytes)
    assert "".join(d.text for d in docs) == text
    assert max(len(d.text.encode()) for d in docs) <= readers.CHUNK_BYTES + readers.LINE_BYTES
    # Compressed, it is cut at the same places in its decompressed text, read through spools.
    (tmp_path / "mixed.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    assert [(d.id.replace(".zst", ""), d.text) for d in documents(tmp_path / "mixed.txt.zst", shard_bytes=shard_bytes)
            ] == [(d.id, d.text) for d in docs]


# ------------------------------------------------------------------------------------ layouts
def save_to_disk(folder: Path, texts: list[str]) -> None:
    """What datasets.Dataset.save_to_disk writes: Arrow IPC streams, state.json, dataset_info.json."""
    import json

    import pyarrow as pa

    folder.mkdir(parents=True)
    table = pa.table({"text": texts})
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink, \
            pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))


def test_a_dataset_dict_folder_reads_its_train_split(tmp_path):
    """DatasetDict.save_to_disk: dataset_dict.json beside a save_to_disk folder per split. Its
    dataset_dict.json was read as JSON lines (and failed), and every split was read."""
    import json

    saved = tmp_path / "saved"
    train, test = records(40), records(10, seed=1)
    save_to_disk(saved / "train", train)
    save_to_disk(saved / "test", test)
    (saved / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    listed = sources.list_source(DataConfig(source=str(saved)))
    assert [f.rel for f in listed.files] == ["train/data-00000-of-00001.arrow"]
    assert texts_of(saved) == train
    (tmp_path / "more.jsonl").write_text(json.dumps({"text": "beside it"}) + "\n")
    assert texts_of(tmp_path) == ["beside it", *train]  # found inside a folder too


def test_a_dataset_dict_without_a_train_split_says_where_to_point(tmp_path):
    import json

    saved = tmp_path / "saved"
    save_to_disk(saved / "validation", records(5))
    (saved / "dataset_dict.json").write_text(json.dumps({"splits": ["validation"]}))
    with pytest.raises(ConfigError, match=r"saved: a datasets DatasetDict of the splits validation, with no 'train' "
                                          r"split saved there: set data.source to the folder of the split to train "
                                          r"on, e.g. .*saved/validation"):
        sources.list_source(DataConfig(source=str(saved)))
    assert texts_of(saved / "validation") == records(5)

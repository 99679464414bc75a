"""Data at scale on small files: every format read the same, a build that is the same whatever
the worker count, resumes after SIGKILL byte for byte, reads the previous cache format, and
keeps its memory flat as the corpus grows."""

from __future__ import annotations

import dataclasses
import gzip
import json
import lzma
import os
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from lmcockpit.core.config import ConfigError, DataConfig
from lmcockpit.core.data import build, cache, readers, sources, spool, store
from lmcockpit.core.data.prepare import prepare

from .helpers import WORDS, cli, documents, records, texts_of, tiny_config, write_jsonl

# ------------------------------------------------------------------------------------- formats
def test_every_format_yields_the_documents_of_its_jsonl_twin(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    texts = records(300)
    twin = write_jsonl(tmp_path / "twin.jsonl", texts)
    raw = twin.read_bytes()
    (tmp_path / "twin.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "twin.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    (tmp_path / "twin.jsonl.xz").write_bytes(lzma.compress(raw))
    (tmp_path / "twin.json").write_bytes(raw)
    table = pa.table({"id": list(range(len(texts))), "text": texts})
    pq.write_table(table, tmp_path / "twin.parquet", row_group_size=150)
    assert pq.ParquetFile(tmp_path / "twin.parquet").metadata.num_row_groups == 2
    saved = tmp_path / "saved"  # what datasets.Dataset.save_to_disk writes: Arrow IPC streams + state
    saved.mkdir()
    with pa.OSFile(str(saved / "data-00000-of-00001.arrow"), "wb") as sink, \
            pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=70):
            writer.write_batch(batch)
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (saved / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))

    expected = texts_of(twin)
    assert expected == texts
    for name in ("twin.jsonl.gz", "twin.jsonl.zst", "twin.jsonl.xz", "twin.json", "twin.parquet", "saved"):
        assert texts_of(tmp_path / name) == expected, name
    # A folder of all of them, recursively: each file's documents in path order.
    assert texts_of(tmp_path) == expected * 7


def test_a_large_text_file_is_cut_into_pieces_and_documents_at_line_ends(tmp_path):
    lines = [f"line {i}: " + " ".join(records(1, seed=i, words=12)) + "\n" for i in range(6000)]
    big = tmp_path / "big.txt"
    big.write_text("".join(lines))
    cfg = DataConfig(source=str(big), shard_bytes=200_000)
    src = sources.list_source(cfg)
    pieces = sources.plan_pieces(src, cfg, 1.0)
    assert len(pieces) == -(-big.stat().st_size // 200_000) > 1
    docs = [d for p in pieces for d in readers.read_piece(p, cfg.text_field, lambda _: True)]
    assert "".join(d.text for d in docs) == big.read_text()  # every line once, none cut
    assert all(d.text.endswith("\n") for d in docs)
    assert len({d.id for d in docs}) == len(docs)
    # The same file in a JSONL twin cut into byte ranges: every record once.
    jl = write_jsonl(tmp_path / "big.jsonl", [line.rstrip("\n") for line in lines])
    assert texts_of(jl, shard_bytes=100_000) == [line.rstrip("\n") for line in lines]


def long_records(n: int = 2500) -> list[str]:
    """Records of a few words to a few hundred, and two longer than the pieces they are read in."""
    texts = records(n, words=40)
    texts[300] = " ".join(records(400, seed=1))  # 150 kB
    texts[1800] = "ü" * 70_000
    return texts


@pytest.mark.parametrize("suffix", [".zst", ".gz", ".bz2"])
def test_a_large_compressed_file_is_cut_into_pieces_that_read_as_its_plain_twin(tmp_path, suffix):
    """A compressed file is cut like a plain one, by its decompressed text, rather than read whole
    by one worker: the same documents, ids (offsets) and texts, as its plain twin cut at the same
    places; a record longer than a piece is read once, by the piece it starts in."""
    texts = long_records()
    plain = write_jsonl(tmp_path / "big.jsonl", texts)
    packed = tmp_path / f"big.jsonl{suffix}"
    packed.write_bytes(compress(suffix, plain.read_bytes()))
    cfg = DataConfig(source=str(packed), shard_bytes=40_000)
    pieces = build.plan(cfg, sources.list_source(cfg)).pieces
    assert len(pieces) > plain.stat().st_size // 40_000 and pieces[-1].end == -1
    twin = [(d.id.split("@")[1], d.text) for d in documents(plain, shard_bytes=40_000)]
    assert [(d.id.split("@")[1], d.text) for d in documents(packed, shard_bytes=40_000)] == twin
    assert [text for _, text in twin] == texts


def test_a_compressed_file_holding_more_text_than_its_estimate_is_still_cut_evenly(tmp_path, monkeypatch):
    """The estimate is the ratio of a compressed file's start; a dump whose first records compress
    worse than the rest holds more text. Up to SLACK times the estimate, the pieces planned past it
    take that text, each about a piece's worth, rather than the last piece all of it; every
    document is read once, in order."""
    monkeypatch.setattr(readers, "ESTIMATE_OUTPUT", 64_000)  # a real dump's first 8 MB, at this file's size
    rng = random.Random(0)
    many, few = [f"w{i}" for i in range(20_000)], [f"w{i}" for i in range(8)]
    texts = [" ".join(rng.choices(many, k=60)) for _ in range(400)] + [" ".join(rng.choices(few, k=60))
                                                                       for _ in range(500)]
    plain = write_jsonl(tmp_path / "dump.jsonl", texts)
    packed = tmp_path / "dump.jsonl.gz"  # gzip reads its input 8 kB at a time: the estimate's ratio is fine-grained
    packed.write_bytes(compress(".gz", plain.read_bytes()))
    cfg = DataConfig(source=str(packed), shard_bytes=20_000)
    listed = sources.list_source(cfg)
    short = plain.stat().st_size / readers.text_bytes(listed.files[0], "text")
    assert 1.4 < short < 1.6, short  # more than a quarter more text than estimated
    planned = build.plan(cfg, listed)
    read = []
    with tempfile.TemporaryDirectory() as spools:
        for piece, spooled in spool.spooled(planned.pieces, lambda p: p, Path(spools)):
            read.append([d.text for d in readers.read_piece(piece, "text", lambda _: True, spooled)])
    assert [t for piece in read for t in piece] == texts
    lines = [sum(len(json.dumps({"text": t, "id": 0})) + 1 for t in piece) for piece in read]
    assert max(lines) < 20_000 + 1_000, lines  # a piece's worth, and the line its cut moves to


def compress(suffix: str, raw: bytes) -> bytes:
    import bz2

    import zstandard

    return {".zst": zstandard.ZstdCompressor().compress, ".gz": lambda b: gzip.compress(b, compresslevel=1),
            ".bz2": bz2.compress, ".xz": lzma.compress}[suffix](raw)


def test_a_compressed_file_s_spools_are_written_only_as_asked_for_and_removed(tmp_path):
    """The pieces of a compressed file are decompressed once, in order, a spool at a time: on disk,
    only the spools given out and the next one being written; none left by a reader that stops;
    a resumed build's pieces (the rest of the plan) read as they would have in a whole one."""
    packed = tmp_path / "big.jsonl.zst"
    packed.write_bytes(compress(".zst", write_jsonl(tmp_path / "big.jsonl", records(3000, words=40)).read_bytes()))
    cfg = DataConfig(source=str(packed), shard_bytes=80_000)
    pieces = build.plan(cfg, sources.list_source(cfg)).pieces
    folder = tmp_path / "spools"
    on_disk, whole = [], []
    for piece, spooled in spool.spooled(pieces, lambda p: p, folder):
        on_disk.append(len(list(folder.iterdir())))
        whole.append([(d.id, d.text) for d in readers.read_piece(piece, "text", lambda _: True, spooled)])
        spool.remove(spooled)
    assert len(whole) == len(pieces) > 8 and max(on_disk) == 2 and not list(folder.iterdir())
    rest = spool.spooled(pieces[5:], lambda p: p, folder)
    skipped = [[(d.id, d.text) for d in readers.read_piece(p, "text", lambda _: True, s)] for p, s in
               (next(rest), next(rest))]
    assert skipped == whole[5:7] and len(list(folder.iterdir())) == 3
    rest.close()  # the one it was writing is its own to remove
    assert sorted(p.name for p in folder.iterdir()) == ["00005.spool", "00006.spool"]


def test_the_bpe_sample_reads_a_large_compressed_jsonl_file_as_one_stream(tmp_path):
    """A record's id is its offset in the file's text, cut into pieces or not: the sample reads
    such a file once, from its start, with no spool, and draws what it would from the file uncut."""
    packed = tmp_path / "big.jsonl.zst"
    packed.write_bytes(compress(".zst", write_jsonl(tmp_path / "big.jsonl", records(3000, words=40)).read_bytes()))
    cfg = DataConfig(source=str(packed), shard_bytes=80_000, val_fraction=0.1)
    planned = build.plan(cfg, sources.list_source(cfg))
    assert len(planned.pieces) > 8
    uncut = dataclasses.replace(planned, pieces=[sources.Piece(0, planned.pieces[0].files)])
    spools = tmp_path / "spools"
    sample = build.tokenizer_sample(cfg, planned, 150_000, spools)
    first = next(sample)
    assert not spools.exists()
    texts = [first, *sample]
    assert texts == list(build.tokenizer_sample(cfg, uncut, 150_000, tmp_path / "unused"))
    assert 150_000 <= sum(map(len, texts)) < 151_000


def test_many_compressed_files_are_sized_on_threads_in_file_order_and_said(tmp_path):
    """A compressed file's text is estimated by decompressing its start: a corpus of thousands of
    shards took most of a minute of one core, in silence. Read on several threads, every file still
    gets the size it gets alone, in file order, and the sizing is said file by file."""
    for i in range(20):
        (tmp_path / f"shard-{i:02d}.jsonl.gz").write_bytes(
            compress(".gz", "".join(json.dumps({"text": t}) + "\n" for t in records(40 + 10 * i, seed=i)).encode()))
    cfg = DataConfig(source=str(tmp_path), workers=4)
    source = sources.list_source(cfg)
    said, sizers = [], set()

    def progress(*a):
        said.append(a)
        sizers.update(t.name for t in threading.enumerate() if t.name.startswith("sizing"))

    sizes = build.text_sizes(source, cfg, progress)
    alone = [readers.text_bytes.__wrapped__(f, "text") for f in source.files]  # read again, not the kept ones
    assert sizes == alone and len(set(sizes)) == 20
    assert said == [(build.SIZING, n, 20, "files") for n in range(21)]
    assert len(sizers) == 4  # data.workers threads
    few = DataConfig(source=str(tmp_path / "shard-00.jsonl.gz"))  # a second or two at most: not said
    build.text_sizes(sources.list_source(few), few, lambda *a: said.append(a))
    assert len(said) == 21

    def stop(*a):
        raise KeyboardInterrupt  # a stop from the progress (Ctrl-C, the cockpit's abort) ends the sizing
    with pytest.raises(KeyboardInterrupt):
        build.text_sizes(source, cfg, stop)


def test_a_compressed_file_damaged_past_its_estimate_is_named_by_the_piece_that_reads_it(tmp_path):
    raw = write_jsonl(tmp_path / "big.jsonl", records(40_000, words=50)).read_bytes()
    assert len(raw) > readers.ESTIMATE_OUTPUT
    packed = tmp_path / "big.jsonl.gz"
    whole = compress(".gz", raw)
    packed.write_bytes(whole[:len(whole) * 9 // 10])
    cfg = DataConfig(source=str(packed), shard_bytes=1_000_000)
    pieces = build.plan(cfg, sources.list_source(cfg)).pieces  # its first 8 MB: whole
    folder = tmp_path / "spools"
    with pytest.raises(ConfigError, match=r"big.jsonl.gz: damaged or truncated gzip file \(an interrupted download"):
        for piece, spooled in spool.spooled(pieces, lambda p: p, folder):
            spool.remove(spooled)
    assert not list(folder.iterdir())


@pytest.mark.parametrize("content, field, message", [
    ('{"text": "fine"}\n{"text": "ok"}\nnot json\n', "text", r"bad.jsonl:3: not valid JSON"),
    ('{"text": "fine"}\n{"body": "no text field"}\n', "text", r"bad.jsonl:2: expected an object with a string "
                                                              r"field 'text'"),
])
def test_an_unreadable_record_names_the_file_and_line(tmp_path, content, field, message):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(ConfigError, match=message):
        documents(tmp_path / "bad.jsonl", text_field=field)


def test_a_parquet_file_without_the_text_column_names_its_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a", "b"]}), tmp_path / "x.parquet")
    with pytest.raises(ConfigError, match=r"x.parquet: no column 'text' \(data.text_field\); it has content"):
        documents(tmp_path / "x.parquet")


@pytest.mark.slow
@pytest.mark.parametrize("surrogate", [rb"\ud800", b"\xed\xa0\x80"])  # escaped; raw bytes (CESU-8, WTF-8)
def test_a_lone_surrogate_in_a_json_line_is_replaced_not_fatal(tmp_path, surrogate):
    texts = records(300)
    source = tmp_path / "s.jsonl"
    # Either decodes to a lone surrogate (json.loads reads bytes with "surrogatepass"): no UTF-8, so
    # tokenizers refuses it and encoding its size raises, in a worker, ending the build.
    source.write_bytes(b"".join(json.dumps({"text": t}).encode().replace(b'"}', b" " + surrogate + b' tail"}') + b"\n"
                                for t in texts))
    cfg = tiny_config(f"data.source=\"{source}\"", f"data.cache_dir=\"{tmp_path / 'cache'}\"", "data.max_bytes=0",
                      "tokenizer.vocab_size=300", "tokenizer.train_bytes=50_000")
    data = prepare(cfg, lambda line: None, lambda *a: None)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(data.dir / "tokenizer" / "tokenizer.json"))
    text = tok.decode(np.asarray(data.val[0:len(data.val)]).tolist())
    assert "\ufffd tail" in text and "\ud800" not in text


@pytest.mark.slow
@pytest.mark.parametrize("offline", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])  # huggingface_hub reads both
def test_an_hf_source_offline_exits_2_with_the_download_command(tmp_path, offline):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update({offline: "1", "HF_HOME": str(tmp_path / "hf")})
    proc = cli("--run", "debug", "--set", 'data.source="hf:HuggingFaceFW/fineweb-edu/sample/10BT"',
               "--out", str(tmp_path / "run"), environ=env)
    assert proc.returncode == 2, proc.stderr
    assert f"{offline} is set" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout
    assert ("hf download HuggingFaceFW/fineweb-edu --repo-type dataset --include 'sample/10BT/*' --local-dir DIR"
            in proc.stderr)
    assert "data.source='\"DIR/sample/10BT\"'" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_an_hf_source_fetches_only_the_files_its_budget_needs():
    from lmcockpit.core.data.hub import FILE_BYTES_PER_TOKEN, choose_files, parse

    assert parse("hf:HuggingFaceFW/fineweb-edu/sample/10BT") == ("HuggingFaceFW/fineweb-edu", "sample/10BT")
    with pytest.raises(ConfigError, match="expected hf:OWNER/NAME"):
        parse("hf:fineweb")
    listing = [(f"sample/10BT/{i:03d}_00000.parquet", 2_150_000_000) for i in range(13, -1, -1)]
    listing += [("sample/10BT/README.md", 5_000), ("sample/10BT/.gitattributes", 100)]
    need = int(98_304 * 1_000 * FILE_BYTES_PER_TOKEN)  # the 3090 preset's 98M tokens
    assert choose_files(listing, need) == ["sample/10BT/000_00000.parquet"]
    assert choose_files(listing, 3 * 2_150_000_000 + 1) == [f"sample/10BT/{i:03d}_00000.parquet" for i in range(4)]
    assert len(choose_files(listing, 0)) == 14  # no budget: all the data files, no README


# --------------------------------------------------------------------------------------- builds
def corpus(tmp_path: Path, n: int = 1500) -> Path:
    return write_jsonl(tmp_path / "corpus.jsonl", records(n))


def scale_config(tmp_path: Path, source: Path, cache_dir: Path, *extra: str):
    return tiny_config(f"data.source=\"{source}\"", f"data.cache_dir=\"{cache_dir}\"", "data.max_bytes=0",
                       "data.val_fraction=0.05", "tokenizer.vocab_size=300", "tokenizer.train_bytes=100_000",
                       "data.shard_bytes=60_000", *extra)


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_the_split_and_selection_are_the_same_whatever_the_worker_count(tmp_path):
    source = corpus(tmp_path)
    one = prepare(scale_config(tmp_path, source, tmp_path / "c1", "data.workers=1", "data.max_bytes=120_000"),
                  lambda line: None, lambda *a: None)
    two = prepare(scale_config(tmp_path, source, tmp_path / "c2", "data.workers=2", "data.max_bytes=120_000"),
                  lambda line: None, lambda *a: None)
    meta = store.read_meta(one.dir)
    assert len(meta["shards"]) > 1 and one.dir.name == two.dir.name
    assert folder_bytes(one.dir) == folder_bytes(two.dir)
    # max_bytes is a streamed selection of about that much text
    assert 0.7 * 120_000 < meta["bytes"] < 1.3 * 120_000


@pytest.mark.slow
@pytest.mark.parametrize("compressed", [False, True])
def test_a_killed_build_resumes_and_the_cache_is_byte_identical(tmp_path, compressed):
    """Also for one large compressed file: its pieces spooled as the build reaches them, the BPE's
    sample read through spools of its own, and a resumed build reading through the pieces done."""
    source = corpus(tmp_path)
    if compressed:
        packed = source.with_suffix(".jsonl.zst")
        packed.write_bytes(compress(".zst", source.read_bytes()))
        source = packed
    killed_dir, whole_dir = tmp_path / "killed", tmp_path / "whole"
    overrides = [f"data.source=\"{source}\"", f"data.cache_dir=\"{killed_dir}\"", "data.max_bytes=0",
                 "data.val_fraction=0.05", "tokenizer.vocab_size=300", "tokenizer.train_bytes=100_000",
                 "data.shard_bytes=60_000", "data.workers=1"]
    # A real process that SIGKILLs itself in the middle of its 4th piece (after the 6th write).
    driver = textwrap.dedent(f"""
        import os, signal
        from lmcockpit.core.data.prepare import prepare
        from tests.helpers import tiny_config
        writes = 0
        def progress(stage, done, total, unit):
            global writes
            if stage == "tokenizing" and done:
                writes += 1
                if writes == 6:
                    os.kill(os.getpid(), signal.SIGKILL)
        prepare(tiny_config(*{overrides!r}), print, progress)
        """)
    proc = subprocess.run([sys.executable, "-c", driver], cwd=Path(__file__).parents[1], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    [build] = [p for p in killed_dir.glob(".build-*") if p.is_dir()]  # beside it: its .lock
    done = list((build / "pieces").glob("*.json"))
    assert 0 < len(done) < json.loads((build / "plan.json").read_text())["pieces"]
    assert list(build.rglob("*.tmp-*")), "the kill was meant to land inside a piece"

    logs: list[str] = []
    resumed = prepare(tiny_config(*overrides), logs.append, lambda *a: None)
    assert any(f"{len(done)} of" in line and "already done" in line for line in logs), logs
    whole = prepare(scale_config(tmp_path, source, whole_dir, "data.workers=2"), lambda line: None, lambda *a: None)
    assert resumed.dir.name == whole.dir.name
    assert folder_bytes(resumed.dir) == folder_bytes(whole.dir)
    assert not [p for p in killed_dir.glob(".build-*") if p.is_dir()]
    assert not list(resumed.dir.parent.rglob("*spool*"))


@pytest.mark.slow
def test_a_compressed_file_s_piece_sent_to_validation_is_read_again_from_a_spool(tmp_path):
    """A corpus whose hash sent no document to validation sends the training document nearest to
    it, tokenising its piece again: a compressed file's piece, from a spool of its own."""
    source = tmp_path / "book.txt.gz"
    source.write_bytes(compress(".gz", "".join(t + "\n" for t in records(1500)).encode()))
    data = prepare(scale_config(tmp_path, source, tmp_path / "cache", "data.val_fraction=0.000001"),
                   lambda line: None, lambda *a: None)
    meta = store.read_meta(data.dir)
    assert len(meta["shards"]) > 2 and meta["documents"]["val"] == 1 and len(data.val) > 0
    assert not list(data.dir.parent.rglob("*spool*"))


def start_bpe_training(tmp_path: Path):
    """`data prepare` as a user runs it, on a sample that takes seconds to train; returns it and its
    BPE's child process once that child is there."""
    import psutil

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 12)))
             for _ in range(300_000)]  # many distinct words: seconds of training
    source = write_jsonl(tmp_path / "c.jsonl", [" ".join(rng.choice(words) for _ in range(400)) for _ in range(3_000)])
    flags = [a for s in [f'data.source="{source}"', f'data.cache_dir="{tmp_path / "cache"}"', "data.max_bytes=0",
                         "tokenizer.vocab_size=8192", "tokenizer.train_bytes=20_000_000"] for a in ("--set", s)]
    proc = subprocess.Popen([sys.executable, "-m", "lmcockpit.tui.cli", "data", "prepare", "debug", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    for line in proc.stdout:  # piped: a line when the training starts
        if line.startswith("training tokenizer: 0%"):
            break
    deadline = time.monotonic() + 60
    while not (trainer := [p for p in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]):
        assert time.monotonic() < deadline, "the BPE trains in a child process"
    return proc, trainer[0]


@pytest.mark.slow
def test_ctrl_c_while_the_bpe_trains_stops_it_at_once(tmp_path):
    """Ctrl-C reaches the whole process group: `data prepare` answers 130 and kills the BPE's child
    then and there, rather than wait for it to finish training and write the tokenizer."""
    import signal

    import psutil

    proc, trainer = start_bpe_training(tmp_path)
    try:
        os.killpg(proc.pid, signal.SIGINT)  # while the child starts up or trains: the same answer
        interrupted = time.monotonic()
        out = proc.stdout.read()
        assert proc.wait(timeout=60) == 130
        # Training this sample takes 5 to 13 s here: an answer in seconds means it was not waited for.
        assert time.monotonic() - interrupted < 3
    finally:
        proc.kill()
    assert "interrupted: what is finished is kept" in out and "Traceback" not in out, out
    assert not list((tmp_path / "cache").glob(".build-*/tokenizer")), "the trainer went on to the end"
    assert not psutil.wait_procs([trainer], timeout=10)[1], "the trainer outlived the build"


@pytest.mark.slow
def test_a_bpe_trainer_killed_from_outside_is_an_error_not_a_hang(tmp_path):
    """The OOM killer's SIGKILL on the BPE's child: `data prepare` says so and exits 2 (a Pool
    would have waited for its answer for ever)."""
    proc, trainer = start_bpe_training(tmp_path)
    try:
        trainer.kill()
        out = proc.stdout.read()
        assert proc.wait(timeout=60) == 2
    finally:
        proc.kill()
    assert "the tokenizer's training process died (exit code -9: killed, out of memory?)" in out, out
    assert "Traceback" not in out


@pytest.mark.slow
def test_a_killed_build_s_workers_die_with_it_and_the_next_build_is_whole(tmp_path):
    """SIGKILL of the main process alone (the OOM killer's way): its workers must not go on
    writing pieces beside the next build's (they did, and the next build failed on a rename)."""
    import psutil

    source = corpus(tmp_path, 12_000)  # 7 MB: pieces of several batches, so a kill lands inside them
    killed_dir, whole_dir = tmp_path / "killed", tmp_path / "whole"
    overrides = [f"data.source=\"{source}\"", f"data.cache_dir=\"{killed_dir}\"", "data.max_bytes=0",
                 "data.val_fraction=0.05", "tokenizer.vocab_size=300", "tokenizer.train_bytes=100_000",
                 "data.shard_bytes=2_500_000", "data.workers=2"]
    pids, finished = tmp_path / "workers.txt", tmp_path / "finished.txt"
    driver = textwrap.dedent(f"""
        import os, signal, psutil
        from pathlib import Path
        from lmcockpit.core.data.prepare import prepare
        from tests.helpers import tiny_config
        def progress(stage, done, total, unit):
            if stage == "tokenizing" and done:
                workers = [p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]
                open({str(pids)!r}, "w").write(" ".join(str(w.pid) for w in workers))
                # Stopped first: a worker can finish no piece from here on, and one left behind
                # after the kill stays there, stopped, for the test to see (it did before PDEATHSIG).
                for w in workers:
                    w.suspend()
                while any(w.status() != psutil.STATUS_STOPPED for w in workers):
                    pass
                [build] = [p for p in Path({str(killed_dir)!r}).glob(".build-*") if p.is_dir()]
                open({str(finished)!r}, "w").write(" ".join(sorted(p.name for p in (build / "pieces").glob("*.json"))))
                os.kill(os.getpid(), signal.SIGKILL)
        prepare(tiny_config(*{overrides!r}), print, progress)
        """)
    proc = subprocess.run([sys.executable, "-c", driver], cwd=Path(__file__).parents[1], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    workers = [int(pid) for pid in pids.read_text().split()]
    assert len(workers) == 2
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in workers):
        assert time.monotonic() < deadline, "the killed build's workers are still running"
        time.sleep(0.05)
    # they died with it: no piece was finished after the kill, by a worker left behind
    [build] = [p for p in killed_dir.glob(".build-*") if p.is_dir()]
    assert sorted(p.name for p in (build / "pieces").glob("*.json")) == finished.read_text().split()
    resumed = prepare(tiny_config(*overrides), lambda line: None, lambda *a: None)
    whole = prepare(tiny_config(*overrides, f"data.cache_dir=\"{whole_dir}\"", "data.workers=1"),
                    lambda line: None, lambda *a: None)
    assert resumed.dir.name == whole.dir.name and folder_bytes(resumed.dir) == folder_bytes(whole.dir)


@pytest.mark.slow
def test_a_cache_of_the_previous_format_is_still_read(tmp_path):
    """Format 1 (lmcockpit before shards): one train.bin and val.bin, found under its old key."""
    source = corpus(tmp_path, 200)
    cfg = scale_config(tmp_path, source, tmp_path / "c")
    fresh = prepare(cfg, lambda line: None, lambda *a: None)
    old = tmp_path / "c" / store.legacy_key(cfg, sources.list_source(cfg.data))
    old.mkdir()
    shutil.copytree(fresh.tokenizer_dir, old / "tokenizer")
    train = np.arange(5000, dtype=np.uint16) % 300
    val = np.arange(500, dtype=np.uint16) % 300
    train.tofile(old / "train.bin")
    val.tofile(old / "val.bin")
    (old / "meta.json").write_text(json.dumps({"format": 1, "train_tokens": 5000, "val_tokens": 500, "dtype": "uint16",
                                               "vocab_size": 300, "eos_id": fresh.eos_id, "source": str(source),
                                               "bytes": 1}))
    shutil.rmtree(fresh.dir)
    logs: list[str] = []
    data = prepare(cfg, logs.append, lambda *a: None)
    assert data.reused and data.dir == old and any("reusing token cache" in line for line in logs)
    assert np.array_equal(np.asarray(data.train), train) and np.array_equal(np.asarray(data.val), val)


def test_the_previous_format_s_key_skips_files_by_the_suffix_pathlib_gives():
    """Format 1 keyed its files without its skipped suffixes, tested by Path.suffix; the string test
    that replaced it (a Path per file made most of a 100k-file source's look for its cache) must
    give the same suffix, or an old cache is no longer found."""
    names = ["a.gz", "x/.gz", "x/y.tar.GZ", "foo.", ".bashrc", "a/b.c/d", "a/b.c/d.PNG", "..x", "a..", "x/a.b.",
             "doc.pdf", "dir.zip/inner.txt", "no_suffix", "x/.hidden.so", "a.b/.c"]
    assert [store._suffix(n) for n in names] == [Path(n).suffix for n in names]


def test_a_token_stream_reads_windows_across_shards():
    parts = [np.arange(0, 5, dtype=np.uint16), np.arange(5, 5, dtype=np.uint16), np.arange(5, 12, dtype=np.uint16)]
    stream = cache.TokenStream(parts)
    assert len(stream) == 12
    for start in range(12):
        for stop in range(start, 13):
            assert stream[start:stop].tolist() == list(range(start, stop))


@pytest.mark.slow
def test_preparing_ten_times_the_text_takes_about_the_same_memory(tmp_path):
    """Peak RSS of a real prepare (one process: the reader, the tokenizer and the writer) on a
    corpus and on one ten times larger: the corpus is never held. The peak is the kernel's VmHWM,
    which starts afresh at exec (getrusage's maxrss would carry this test process's over)."""
    driver = textwrap.dedent("""
        import re, sys
        from lmcockpit.core.data.prepare import prepare
        from tests.helpers import tiny_config
        prepare(tiny_config(*sys.argv[1:]), lambda line: None, lambda *a: None)
        print(int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024)
        """)
    peaks = {}
    for n in (5_000, 50_000):
        source = write_jsonl(tmp_path / f"c{n}.jsonl", records(n, words=120))
        proc = subprocess.run([sys.executable, "-c", driver, f"data.source=\"{source}\"",
                               f"data.cache_dir=\"{tmp_path / 'cache'}\"", "data.max_bytes=0", "data.workers=1",
                               "data.shard_bytes=2_000_000",
                               "tokenizer.vocab_size=300", "tokenizer.train_bytes=200_000"],
                              cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        peaks[source.stat().st_size] = int(proc.stdout.split()[-1])
    (small, small_peak), (large, large_peak) = sorted(peaks.items())
    assert large > 9 * small > 25_000_000
    # Flat within 20% (the bound from 1 GB to 5 GB). Holding the corpus, as preparation did
    # before it streamed, adds twice the added text and more: 1.4× here.
    assert large_peak < 1.2 * small_peak, peaks


@pytest.mark.slow
def test_a_parquet_row_group_is_read_a_batch_at_a_time(tmp_path):
    """Row groups of 10 and 40 MB (FineWeb's hold hundreds of MB), each read by a fresh process: the
    peak grows by a page and a record batch, not with the row group (pyarrow's default reading and
    allocator: about 3x the row group)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    driver = textwrap.dedent("""
        import re, sys
        import pyarrow.parquet
        from lmcockpit.core.config import DataConfig
        from lmcockpit.core.data import readers, sources
        status = lambda key: int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
        base = status("VmRSS")
        cfg = DataConfig(source=sys.argv[1])
        pieces = sources.plan_pieces(sources.list_source(cfg), cfg, 1.0)
        n = sum(1 for p in pieces for _ in readers.read_piece(p, "text", lambda doc_id: True))
        print(n, status("VmHWM") - base)
        """)
    rng = random.Random(0)
    grown = {}
    for n in (1_250, 5_000):  # documents of 8 kB
        path = tmp_path / f"{n}.parquet"
        texts = [" ".join(rng.choice(WORDS) for _ in range(1_200)) for _ in range(n)]
        pq.write_table(pa.table({"text": texts}), path, row_group_size=n, compression="zstd")
        proc = subprocess.run([sys.executable, "-c", driver, str(path)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        read, grown[n] = map(int, proc.stdout.split())
        assert read == n
    assert grown[5_000] - grown[1_250] < 15_000_000, grown  # 30 MB more text in the row group


@pytest.mark.slow
def test_the_bpe_trainer_s_memory_is_not_kept_by_the_build(tmp_path):
    """The BPE trains in a child process of its own: the build's main process, which goes on to run
    the workers or tokenise itself, peaks the same whether the trainer's sample is 0.1 or 3 MB
    (in-process: +100 MB here, as the trainer's word counts grow with the sample)."""
    driver = textwrap.dedent("""
        import re, sys
        from lmcockpit.core.data.prepare import prepare
        from tests.helpers import tiny_config
        prepare(tiny_config(*sys.argv[1:]), lambda line: None, lambda *a: None)
        print(int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024)
        """)
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyzéü") for _ in range(rng.randint(3, 12)))
             for _ in range(200_000)]  # many distinct words, as real text has: the trainer counts each
    source = write_jsonl(tmp_path / "c.jsonl", [" ".join(rng.choice(words) for _ in range(300)) for _ in range(1_500)])
    peaks = {}
    for train_bytes in (100_000, 3_000_000):
        proc = subprocess.run([sys.executable, "-c", driver, f"data.source=\"{source}\"",
                               f"data.cache_dir=\"{tmp_path / str(train_bytes)}\"", "data.max_bytes=0", "data.workers=1",
                               "tokenizer.vocab_size=1024", f"tokenizer.train_bytes={train_bytes}"],
                              cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        peaks[train_bytes] = int(proc.stdout.split()[-1])
    assert peaks[3_000_000] < peaks[100_000] + 20_000_000, peaks

@pytest.mark.parametrize("cores, kind, workers", [(2, "jsonl", 2), (16, "jsonl", 15), (64, "jsonl", 15),
                                                   (16, "parquet", 8), (64, "arrow", 8), (1, "parquet", 1)])
def test_the_default_worker_count_keeps_preparation_under_its_memory_bound(monkeypatch, cores, kind, workers):
    """One tokenizer process per core, as many as the bound allows: what a 64-core box gets is decided
    here, on 2 cores, from the per-worker peaks measured in bench/data.py."""
    from lmcockpit.core.data import children

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    source = sources.Source("x", [sources.SourceFile(Path("a"), "a", 1, 0, kind)], False)
    log: list[str] = []
    assert children.default_workers(source, log.append) == workers
    assert workers * (children.COLUMNAR_WORKER_BYTES if kind != "jsonl" else children.WORKER_BYTES) \
        + children.MAIN_BYTES <= children.TREE_BYTES
    assert bool(log) == (workers < cores)
    assert not log or f"{workers} tokenizer processes for {cores} cores" in log[0] and "data.workers" in log[0]


@pytest.mark.slow
def test_a_cache_of_more_shards_than_open_files_allowed_is_read(tmp_path):
    """Thousands of shards (a 45 GB corpus) against the usual limit of 1,024 open files, here 300
    shards against 200: a shard is mapped while it is read, not all at once."""
    source = corpus(tmp_path, n=1200)
    overrides = [f"data.source=\"{source}\"", f"data.cache_dir=\"{tmp_path / 'cache'}\"", "data.max_bytes=0",
                 "data.val_fraction=0.05", "tokenizer.vocab_size=300", "tokenizer.train_bytes=100_000",
                 "data.workers=1", "data.shard_bytes=800"]
    data = prepare(tiny_config(*overrides), lambda line: None, lambda *a: None)
    shards = len(list((data.dir / "shards").glob("*.train.bin")))
    assert shards > 250
    driver = textwrap.dedent("""
        import resource, sys
        import numpy as np
        from lmcockpit.core.data.prepare import prepare
        from tests.helpers import tiny_config
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        data = prepare(tiny_config(*sys.argv[1:]), lambda line: None, lambda *a: None)
        stream = data.train
        # Every shard, across their seams; a window is summed and dropped, as a batch copies it.
        print(len(stream), sum(int(stream[i:i + 40].astype(np.int64).sum()) for i in range(0, len(stream) - 40, 37)))
        """)
    proc = subprocess.run([sys.executable, "-c", driver, *overrides],
                          cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    whole = np.asarray(data.train).astype(np.int64)
    expected = sum(int(whole[i:i + 40].sum()) for i in range(0, len(whole) - 40, 37))
    assert proc.stdout.split() == [str(len(whole)), str(expected)]


@pytest.mark.slow
def test_a_damaged_shard_is_named_with_the_command_that_mends_it(tmp_path):
    source = corpus(tmp_path, n=300)
    cfg = scale_config(tmp_path, source, tmp_path / "cache", "data.workers=1")
    data = prepare(cfg, lambda line: None, lambda *a: None)
    shard = sorted((data.dir / "shards").glob("*.train.bin"))[-1]
    shard.write_bytes(shard.read_bytes()[:-6])  # a disk that filled up, a copy cut short
    with pytest.raises(ConfigError, match=rf"{shard.name}: .* bytes, expected .*damaged: `lmcockpit data rm "
                                          rf"{data.dir.name}`"):
        prepare(cfg, lambda line: None, lambda *a: None)


@pytest.mark.slow
def test_the_first_child_a_build_spawns_is_born_deaf_to_ctrl_c_too():
    """multiprocessing starts its resource tracker with the first spawn and unblocks SIGINT on its
    way out: the BPE's child, a build's first, was born hearing Ctrl-C, and one that landed while
    its interpreter started printed a "Fatal Python error" traceback. In a fresh interpreter (no
    tracker yet): the parent keeps SIGINT blocked through the spawn, and the child is born with it
    blocked (its SigBlk in /proc)."""
    script = """
import multiprocessing as mp, pathlib, signal, time
from lmcockpit.core.data import children
with children._deaf_children():
    child = mp.get_context("spawn").Process(target=time.sleep, args=(60,), daemon=True)
    child.start()
    parent = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
status = pathlib.Path(f"/proc/{child.pid}/status").read_text()
blocked = int(next(l for l in status.splitlines() if l.startswith("SigBlk")).split()[1], 16)
child.kill()
print(parent, bool(blocked & (1 << (signal.SIGINT - 1))))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]

"""Building one token cache folder: streamed, in parallel, resumable.

    pieces → (a tokenizer trained on a sample, or a given one) → worker processes (children.py),
    each reading its piece's documents and writing that piece's train and val shards → meta.json

* Memory does not grow with the corpus: a worker holds one batch of documents (about a
  megabyte of text) at a time; the main process holds the plan and a count per piece.
* A large compressed file is cut into pieces too: the main process decompresses it once, in order,
  writing each piece's text to a spool file as a worker takes the piece (spool.py).
* Every piece's shards are written under temporary names and renamed when whole, then its summary
  (`pieces/NNNNN.json`); the build folder (`.build-KEY`) stays where it is when the build is
  killed, and the next build keeps every finished piece and does only the rest. What a piece
  writes is a function of the piece alone, so the finished cache is byte-identical to one built
  without a kill, and the same whatever the number of workers.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ..config import Config, ConfigError
from ..run.safe_files import current_umask, write_whole
from . import children, encoder, pretrained, readers, sources, split, spool, tokenizer
from .cache import token_dtype

ProgressFn = Callable[[str, int, int, str], None]
BATCH_BYTES = 1 << 20  # text encoded at once: what a worker holds


# What a killed build leaves in its folder, removed when the next one starts: a shard's temporary
# file (named by its writer's process, see _encode_piece), a tokenizer folder being saved
# (tokenizer.tmp-RANDOM) and a file of write_whole's (.NAME.RANDOM.tmp).
KILLED_WRITERS = ("*.tmp-*", ".*.tmp")


def _write_atomic(path: Path, data: bytes) -> None:
    """Under a fresh name (mkstemp: never a file or link already there), then renamed: a cache
    folder may be one others can write to, and a guessable name is one they could plant a link at."""
    write_whole(path, data, fsync=True)


# ---------------------------------------------------------------------------------- one piece
@dataclass(frozen=True)
class PieceJob:
    piece: sources.Piece
    text_field: str
    selection: split.Selection
    tokenizer_json: str
    eos: int | None
    dtype: str
    folder: str  # the build folder
    spool: readers.Spool | None = None  # where a compressed file's piece is read from (spool.py)


_ENCODERS: dict[str, encoder.Encoder] = {}
# Of a piece's documents (and its first), also encoded by tokenizers to check tiktoken's ids: at
# 1/32 the check took 17-19% of a worker's encoding time (tokenizers is 6.7x slower on one core).
CHECK_SHARE = 1 / 128


def _encoder_of(path: str, eos: int | None) -> encoder.Encoder:
    """One load per process: each load of a tokenizer keeps some native memory after it is freed,
    so loading it again for every piece grows a long build by megabytes a piece."""
    if path not in _ENCODERS:
        _ENCODERS.clear()
        _ENCODERS[path] = encoder.Encoder(path, eos)
    return _ENCODERS[path]


def build_piece(job: PieceJob, on_bytes: Callable[[int], None] = lambda n: None) -> dict:
    """Tokenise one piece into its train and val shards; returns (and writes) its summary. Where
    tiktoken and tokenizers disagree on one of its checked documents, the whole piece is encoded
    again by tokenizers: what a piece holds stays a function of the piece alone."""
    enc = _encoder_of(job.tokenizer_json, job.eos)
    try:
        summary = _encode_piece(job, enc, on_bytes)
    except encoder.Disagreement as e:
        summary = _encode_piece(job, enc.reference_only(), lambda n: None)
        summary["disagreed"] = e.doc_id
    _write_atomic(Path(job.folder) / "pieces" / f"{job.piece.index:05d}.json",
                  json.dumps(summary, sort_keys=True).encode())
    spool.remove(job.spool)
    return summary


def _encode_piece(job: PieceJob, enc: encoder.Encoder, on_bytes: Callable[[int], None]) -> dict:
    name = f"{job.piece.index:05d}"
    shards = Path(job.folder) / "shards"
    summary: dict = {"piece": job.piece.index, "documents": {"train": 0, "val": 0}, "bytes": 0,
                     "tokens": {"train": 0, "val": 0}, "closest_to_val": None, "encoder": enc.name, "checked": 0}
    # Named by process: a worker orphaned by a killed build may still finish this piece while the
    # next build does it again; each writes its own file and renames the same bytes into place.
    tmp = {side: shards / f"{name}.{side}.bin.tmp-{os.getpid()}" for side in ("train", "val")}
    files = {side: spool.new_file(tmp[side]) for side in ("train", "val")}
    batches: dict[str, list[str]] = {"train": [], "val": []}
    checked: dict[str, dict[int, str]] = {"train": {}, "val": {}}
    held = {"train": 0, "val": 0}

    def flush(side: str) -> None:
        if batches[side]:
            ids = enc.encode(batches[side], checked[side]).astype(job.dtype)
            files[side].write(ids.tobytes())
            summary["tokens"][side] += len(ids)
            on_bytes(held[side])
            batches[side], checked[side], held[side] = [], {}, 0

    try:
        sel = job.selection
        for doc in readers.read_piece(job.piece, job.text_field, sel.kept, job.spool):
            if not doc.text:
                continue
            side = "val" if sel.is_val(doc.id) else "train"
            if side == "train":  # the train document nearest to validation: taken when none got there
                near = split.fraction("val", doc.id)
                if summary["closest_to_val"] is None or near < summary["closest_to_val"][0]:
                    summary["closest_to_val"] = [near, doc.id]
            size = len(doc.text.encode())  # bytes, as the log and bits per byte mean them, not characters
            if enc.tiktoken is not None and (not summary["documents"][side] or
                                             split.fraction("check", doc.id) < CHECK_SHARE):
                checked[side][len(batches[side])] = doc.id
                summary["checked"] += 1
            summary["documents"][side] += 1
            summary["bytes"] += size
            batches[side].append(doc.text)
            held[side] += size
            if held[side] >= BATCH_BYTES:
                flush(side)
        for side in files:
            flush(side)
            files[side].flush()
            os.fsync(files[side].fileno())
    finally:
        for fh in files.values():
            fh.close()
    for side in files:
        os.rename(tmp[side], shards / f"{name}.{side}.bin")
    return summary


_TOKENISED = None  # in a pool worker: the bytes all workers have tokenised, for the parent's progress


def _worker_init(tokenised) -> None:
    global _TOKENISED
    # One process per core already: each encode_batch on one thread, not one per core again.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _TOKENISED = tokenised
    children.quiet_child()


def _count(n: int) -> None:
    with _TOKENISED.get_lock():
        _TOKENISED.value += n


def _pool_piece(job: PieceJob) -> dict:
    return build_piece(job, _count)


def piece_name(piece: sources.Piece) -> str:
    """A piece as an error names it: its number and where its text is."""
    f = piece.files[0]
    if piece.row_group >= 0:
        where = f"{f.rel}, row group {piece.row_group}"
    elif piece.end >= 0 or piece.start > 0:
        where = (f"{f.rel}, {'decompressed ' if f.compression else ''}bytes {piece.start}-"
                 f"{piece.end if piece.end >= 0 else 'its end'}")
    else:
        where = f.rel + (f" and {len(piece.files) - 1} more files" if len(piece.files) > 1 else "")
    return f"piece {piece.index} ({where})"


# --------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Plan:
    """A source planned: its text's size (estimated), the share max_bytes keeps, its pieces."""
    text_bytes: int
    keep: float
    pieces: list[sources.Piece]

    @property
    def kept_bytes(self) -> float:
        return self.text_bytes * self.keep


def plan(d, source: sources.Source, progress: ProgressFn | None = None) -> Plan:
    """`progress`: told how the files' sizing goes, where it has many files to read (text_sizes)."""
    sizes = text_sizes(source, d, progress)
    keep = split.keep_share(d.max_bytes, sum(sizes))
    return Plan(sum(sizes), keep, sources.plan_pieces(source, d, keep, sizes))


SIZING = "sizing the files"
SIZING_SAID_FROM = 16  # files to read: fewer take a second or two even one at a time


def text_sizes(source: sources.Source, d, progress: ProgressFn | None = None) -> list[int]:
    """Each file's text (readers.text_bytes). A compressed file's is estimated by decompressing its
    first readers.ESTIMATE_OUTPUT bytes: 15-50 ms a file (zstd, gzip, xz) and 180 ms for bz2 on
    one core, so a corpus of thousands of shards took a silent minute or more before its first
    piece. Those files, and Parquet footers, are read on as many threads as the build has workers
    (the decompressors and pyarrow release the GIL), in file order, each file's size the same."""
    files = source.files
    sizes = [f.size for f in files]
    read = [i for i, f in enumerate(files) if readers.sized_by_reading(f)]
    if not read:
        return sizes
    say = progress if progress is not None and len(read) >= SIZING_SAID_FROM else None
    threads = min(d.workers or children.default_workers(source), len(read))
    if say is not None:
        say(SIZING, 0, len(read), "files")
    pool = ThreadPoolExecutor(threads, thread_name_prefix="sizing")
    try:
        sized = pool.map(lambda i: readers.text_bytes(files[i], d.text_field), read)
        for n, (i, size) in enumerate(zip(read, sized), 1):
            sizes[i] = size
            if say is not None:
                say(SIZING, n, len(read), "files")
    finally:  # an error, or a stop from the progress: the files not begun are not read
        pool.shutdown(wait=True, cancel_futures=True)
    return sizes


def tokenizer_sample(d, planned: Plan, budget: int, spools: Path) -> Iterator[str]:
    """About `budget` bytes of training documents for the BPE, drawn by id from pieces taken in a
    scattered but fixed order, so that it spans the corpus rather than its first files. A compressed
    file cut into pieces is read where its first piece falls: a JSONL file whole, as one stream
    (a record's id is its offset in the text, cut or not), a text file's pieces in order through
    spools in `spools` (where a piece's cut falls decides its documents)."""
    share = split.sample_share(budget, planned.kept_bytes * (1 - d.val_fraction))
    sel = split.Selection(planned.keep, d.val_fraction)

    def wanted(doc_id: str) -> bool:
        return sel.kept(doc_id) and not sel.is_val(doc_id) and split.in_tokenizer_sample(doc_id, share)

    groups: dict[object, list[sources.Piece]] = {}
    for piece in sorted(planned.pieces, key=lambda p: split.fraction("piece", str(p.index))):
        if not readers.is_spooled(piece):
            groups[piece.index] = [piece]
        elif piece.files[0].kind == "jsonl":
            groups.setdefault(piece.files[0].path, [dataclasses.replace(piece, start=0, end=-1)])
        else:
            groups.setdefault(piece.files[0].path, []).append(piece)
    used = 0
    for piece, spooled in spool.spooled([p for g in groups.values() for p in sorted(g, key=lambda p: p.index)],
                                        lambda p: p, spools):
        for doc in readers.read_piece(piece, d.text_field, wanted, spooled):
            if used >= budget:
                return
            yield doc.text
            used += len(doc.text)
        spool.remove(spooled)


def train_bpe_folder(cfg: Config, samples: list[tuple[object, Plan, int]], folder: Path) -> None:
    """A BPE trained on the samples (data config, plan, bytes) one after another, saved as `folder`.
    Its spools go to a fresh folder beside it: a mixture's is in the cache folder itself."""
    _remove_siblings(folder, ".spool")  # a killed trainer's
    spools = Path(tempfile.mkdtemp(prefix=f"{folder.name}.spool-", dir=folder.parent))
    try:
        texts = (text for d, planned, budget in samples for text in tokenizer_sample(d, planned, budget, spools))
        save_tokenizer(tokenizer.train_bpe(texts, cfg.tokenizer), None, folder, cfg, print)
    finally:
        shutil.rmtree(spools, ignore_errors=True)


def save_tokenizer(tok, origin: Path | None, folder: Path, cfg: Config, log) -> None:
    """`tok` saved as a transformers folder, written aside and renamed into `folder` when whole."""
    if (size := tok.get_vocab_size()) > cfg.tokenizer.vocab_size:
        # The model's embedding has tokenizer.vocab_size rows; a multiple of 128 keeps its matmuls
        # on whole tensor-core tiles (GPT-2's 50,257 tokens: 50,304 rows).
        raise ConfigError(f"tokenizer.vocab_size = {cfg.tokenizer.vocab_size} is smaller than the "
                          f"tokenizer's {size} tokens: set it to {size} or more, e.g. {-(-size // 128) * 128}")
    eos_name = tokenizer.eos_token(tok, origin)
    if eos_name is None:
        log(f"data: warning: tokenizer {cfg.tokenizer.kind} has no end-of-text token (its tokenizer_config.json "
            f"names none, nor has it any of {', '.join(tokenizer.EOS_NAMES)}): documents are joined without "
            "one, and sampling stops only at its length")
    _remove_siblings(folder, ".tmp")  # a killed save's
    # A fresh folder (mkdtemp), not a guessable name: a link planted at one would have the files
    # written wherever it points. Readable as the caches beside it are, not mkdtemp's 0700.
    tmp = Path(tempfile.mkdtemp(prefix=f"{folder.name}.tmp-", dir=folder.parent))
    os.chmod(tmp, 0o777 & ~current_umask())
    try:
        tokenizer.save_hf_tokenizer(tok, tmp, eos_name)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_siblings(folder: Path, suffix: str) -> None:
    """What killed processes left beside `folder`, named `folder` + `suffix` (an older lmcockpit's)
    or + `suffix` + "-RANDOM". Called under the build's lock, so no live writer's."""
    name = folder.name + suffix
    _remove_left([p for p in folder.parent.glob(glob.escape(name) + "*")
                  if p.name == name or p.name.startswith(name + "-")])


def _remove_left(paths: list[Path]) -> None:
    """Files and folders a killed process left; a link among them is removed itself, never followed."""
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------- the build
class Build:
    def __init__(self, cfg: Config, source: sources.Source, work: Path, log, progress: ProgressFn,
                 tokenizer_file: Path | None, tokenizer_label: str):
        self.cfg, self.source, self.work, self.log, self.progress = cfg, source, work, log, progress
        self.tokenizer_file, self.tokenizer_label = tokenizer_file, tokenizer_label
        self.t0 = time.time()

    def run(self) -> None:
        d = self.cfg.data
        planned = plan(d, self.source, self.progress)
        pieces, keep, text_bytes = planned.pieces, planned.keep, planned.text_bytes
        self._start({"pieces": len(pieces), "text_bytes": text_bytes, "keep": keep, "source": d.source,
                     "vocab_size": self.cfg.tokenizer.vocab_size})
        tok_json, eos = self._tokenizer(planned)
        dtype = np.dtype(token_dtype(self.cfg.tokenizer.vocab_size)).name
        selection = split.Selection(keep, d.val_fraction)

        def job(piece: sources.Piece, sel: split.Selection = selection) -> PieceJob:
            return PieceJob(piece, d.text_field, sel, str(tok_json), eos, dtype, str(self.work))

        done = {p.index: s for p in pieces if (s := self._summary(p.index)) is not None}
        if done:
            self.log(f"data: resuming an interrupted preparation: {len(done)} of {len(pieces)} pieces already done")
        self._run_pieces([job(p) for p in pieces if p.index not in done], done, text_bytes * keep)
        summaries = [done[p.index] for p in pieces]
        docs = {side: sum(s["documents"][side] for s in summaries) for side in ("train", "val")}
        if docs["train"] + docs["val"] < 2:
            raise ConfigError(f"data.source = {d.source!r}: found {docs['train'] + docs['val']} document(s); need "
                              "at least two (one to train on, one to validate on)")
        if docs["val"] == 0:  # a small corpus: the train document nearest to validation goes there
            near = min((s["closest_to_val"], s["piece"]) for s in summaries if s["closest_to_val"])
            forced = split.Selection(keep, d.val_fraction, forced_val=near[0][1])
            [again] = self._spooled([job(pieces[near[1]], forced)])
            summaries[near[1]] = build_piece(again)
        elif docs["train"] == 0:
            raise ConfigError(f"data.val_fraction = {d.val_fraction}: all {docs['val']} documents fell into "
                              "validation; lower it or give more text")
        self._finish(summaries, dtype, eos)

    def _start(self, plan: dict) -> None:
        """A fresh build folder, or the one a killed build left, if it was planned the same way."""
        plan_file = self.work / "plan.json"
        if self.work.is_symlink():  # what is built there would land wherever it points
            raise ConfigError(f"{self.work}: a symbolic link where lmcockpit builds a token cache: refused; "
                              "remove it")
        if self.work.is_dir():
            try:
                same = json.loads(plan_file.read_text()) == plan
            except (OSError, ValueError, RecursionError):
                same = False
            if not same:
                shutil.rmtree(self.work)
        shutil.rmtree(self.work / "spool", ignore_errors=True)  # a killed build's: written again as asked for
        for sub in ("shards", "pieces"):
            (self.work / sub).mkdir(parents=True, exist_ok=True)
        _remove_left([tmp for pattern in KILLED_WRITERS for tmp in self.work.rglob(pattern)])
        if not plan_file.is_file():
            _write_atomic(plan_file, json.dumps(plan, sort_keys=True).encode())

    def _summary(self, index: int) -> dict | None:
        try:
            return json.loads((self.work / "pieces" / f"{index:05d}.json").read_text())
        except (OSError, ValueError, RecursionError):  # unreadable: the piece is done again
            return None

    def _tokenizer(self, planned: Plan) -> tuple[Path, int | None]:
        """The build's tokenizer folder, made once (a resumed build keeps it): trained on a sample,
        a pretrained one, or the one given (a resumed run's own, a mixture's shared one)."""
        folder = self.work / "tokenizer"
        t = self.cfg.tokenizer
        if (folder / "tokenizer.json").is_file():
            pass
        elif self.tokenizer_file is not None:
            from tokenizers import Tokenizer

            self.log("data: tokenising with " + self.tokenizer_label.format(file=self.tokenizer_file))
            save_tokenizer(Tokenizer.from_file(str(self.tokenizer_file)), self.tokenizer_file.parent, folder,
                           self.cfg, self.log)
        elif t.kind != "bpe":
            save_tokenizer(tokenizer.load_tokenizer(t.kind, None), pretrained.folder(t.kind), folder, self.cfg,
                           self.log)
        else:
            budget = min(t.train_bytes or int(planned.kept_bytes), int(planned.kept_bytes)) or 1
            self.progress("training tokenizer", 0, budget, "bytes")
            children.in_child(train_bpe_folder, self.cfg, [(self.cfg.data, planned, budget)], folder)
            self.progress("training tokenizer", budget, budget, "bytes")
            self.log(f"data: trained a byte-level BPE of {tokenizer.load_tokenizer('bpe', folder).get_vocab_size()} "
                     f"tokens on {budget / 1e6:.1f} MB in {time.time() - self.t0:.1f}s")
        tok = tokenizer.load_tokenizer("bpe", folder)
        return folder / "tokenizer.json", tokenizer.eos_id(tok, folder)

    def _spooled(self, jobs: list[PieceJob]) -> Iterator[PieceJob]:
        """The jobs, in order, each with its spool where its piece is a compressed file's."""
        said = [0.0]

        def skipping(done: int, to: int) -> None:  # a resumed build reading through what it has
            if time.monotonic() - said[0] >= children.TICK_S:
                said[0] = time.monotonic()
                self.progress("reading to where it stopped", done, to, "bytes")

        for job, spooled in spool.spooled(jobs, lambda j: j.piece, self.work / "spool", skipping):
            yield job if spooled is None else dataclasses.replace(job, spool=spooled)

    def _run_pieces(self, todo: list[PieceJob], done: dict[int, dict], total_bytes: float) -> None:
        total = max(1, int(total_bytes))
        finished = sum(s["bytes"] for s in done.values())
        self.progress("tokenizing", finished, total, "bytes")
        workers = self.cfg.data.workers or children.default_workers(self.source, self.log)
        workers = min(workers, len(todo))
        jobs = self._spooled(todo)  # spools written as the jobs are handed out
        if workers <= 1:
            for job in jobs:
                def tick(n: int) -> None:
                    nonlocal finished
                    finished += n
                    self.progress("tokenizing", finished, total, "bytes")
                done[job.piece.index] = build_piece(job, tick)
        else:
            tokenised = mp.get_context("spawn").Value("q", 0)

            def piece_done(summary: dict) -> None:
                done[summary["piece"]] = summary

            # A piece takes seconds: the bar moves with every batch a worker encodes.
            children.each_in_workers(_pool_piece, jobs, workers, _worker_init, (tokenised,), piece_done,
                                     lambda: self.progress("tokenizing", finished + tokenised.value, total, "bytes"),
                                     lambda job: piece_name(job.piece))
            finished += tokenised.value
        # The total was an estimate (a JSON line's syntax, a compressed file's ratio): done is done.
        self.progress("tokenizing", finished, finished, "bytes")

    def _encoded(self, summaries: list[dict]) -> str:
        fast = [s for s in summaries if s.get("encoder") == "tiktoken"]
        redone = [s for s in summaries if s.get("disagreed")]
        if redone:
            return (f"data: warning: tiktoken's ids differed from tokenizers' on {redone[0]['disagreed']} (and in "
                    f"{len(redone) - 1} more pieces): those {len(redone)} pieces were encoded by tokenizers alone")
        if fast:
            return (f"data: encoded by tiktoken; {sum(s['checked'] for s in fast):,} documents checked against "
                    "tokenizers gave the same ids")
        why = encoder.tiktoken_shape(json.loads((self.work / "tokenizer" / "tokenizer.json").read_text()))
        return f"data: encoded by tokenizers ({why or 'tiktoken not used'})"

    def _finish(self, summaries: list[dict], dtype: str, eos: int | None) -> None:
        tokens = {side: sum(s["tokens"][side] for s in summaries) for side in ("train", "val")}
        docs = {side: sum(s["documents"][side] for s in summaries) for side in ("train", "val")}
        n_bytes = sum(s["bytes"] for s in summaries)
        shutil.rmtree(self.work / "spool", ignore_errors=True)  # read, and no longer asked for
        meta = {"format": 2, "dtype": dtype, "vocab_size": self.cfg.tokenizer.vocab_size, "eos_id": eos,
                "source": self.cfg.data.source, "bytes": n_bytes, "documents": docs,
                "train_tokens": tokens["train"], "val_tokens": tokens["val"],
                "shards": [{"name": f"{s['piece']:05d}", "train_tokens": s["tokens"]["train"],
                            "val_tokens": s["tokens"]["val"]} for s in summaries]}
        self.log(f"data: {docs['train']} train / {docs['val']} val documents, {n_bytes / 1e6:.1f} MB of text")
        held = sum(1 for s in summaries if s["tokens"]["train"] + s["tokens"]["val"])  # not a slack piece's
        self.log(f"data: {tokens['train']:,} train and {tokens['val']:,} val tokens "
                 f"({n_bytes / max(1, tokens['train'] + tokens['val']):.2f} bytes/token) in "
                 f"{held} shards, {time.time() - self.t0:.1f}s")
        self.log(self._encoded(summaries))
        # meta.json last: its presence is what marks a cache as complete.
        _write_atomic(self.work / "meta.json", json.dumps(meta, indent=1).encode())

"""Token-cache preparation (core/data/prepare.py) on a synthetic corpus, measured side by side in one run.

The corpus: English-like documents of 200 to 3,000 words (log-uniform), in paragraphs and sentences,
drawn with Zipf-Mandelbrot frequencies from a vocabulary ranked by use: the words of Python's own
documentation (`pydoc_data.topics`), then those of the standard library's docstrings and comments,
then a long tail of made-up words (some with accents), so that, as in real text, a share of the
words miss the BPE's word cache; plus numbers and some non-ASCII punctuation. The same documents
are written twice, streamed (one row group of text held at a time): as `.jsonl.zst` files and as
Parquet files of several row groups, each file or row group `--file-mb` of text. Generated once
under `--workdir` and reused.

Measured, each `prepare` in a subprocess of its own with a fresh cache folder (cpu preset's
tokenizer: vocab 8192, train_bytes default; `data.workers` 0, one worker per core up to the 1.5 GB
bound of children.default_workers):
* throughput: wall time, MB/s of text and tokens/s of each format, the BPE training and the
  tokenising phase apart, against two raw speeds of the same tokenizer over the same documents (or
  the first `--raw-mb` of them), read into memory in 8 MB batches first (the read is not timed), in
  this one process: the issue's reference, tokenizers' `Tokenizer.encode_batch_fast` on every core
  (tokenizers' own threads), and what one of prepare's workers does, core's `Encoder`
  (core/data/encoder.py: tiktoken where the BPE allows it, ids into one array, an end-of-text after
  each document) on one thread, alone and with the check it makes of 1/32 of the documents by
  tokenizers on one thread. The ids of the raw `Encoder` are compared with `encode_batch_fast`'s for
  every document they read; prepare's token counts with the raw count (when the raw rows read the
  whole corpus); every cache of the same data byte for byte with the first;
* which encoder each prepare used: its log's "data: encoded by ..." line, and the `encoder`,
  `checked` and `disagreed` fields of the pieces' summaries (the cache's pieces/*.json);
* workers: `data.workers=1` against the default;
* resume: prepare SIGKILLed once half its pieces are done, then prepare again, timed, against the
  uninterrupted time, and every file of the resumed cache compared byte for byte with the
  uninterrupted one; twice: killing its whole process group (a job's kill), then its main process
  alone (`kill -9 PID`, the OOM killer);
* memory: peak RSS (and PSS) of prepare's whole process tree (psutil, summed over the tree every
  0.1 s from a thread here) at `--size-mb` and `--large-mb`, and each process's own peak RSS (the
  kernel's VmHWM, read at each sample): the main process, the BPE's spawned child, the resource
  tracker, each worker, the workers against children.WORKER_BYTES (JSON lines) and
  COLUMNAR_WORKER_BYTES (Parquet), the per-worker bounds behind the default worker count;
* tiktoken (`--tiktoken`): the product's Encoder (its tiktoken Encoding, built by
  encoder.tiktoken_encoding) against tokenizers on `--tiktoken-mb` of the same documents: same ids
  for every document? how fast on every core (`encode_ordinary_batch`, tokenizers' threads) and on
  one (as prepare's workers run)?
The throughput rows run in turn for `--rounds` rounds and keep their best, so a busy neighbour on a
shared machine slows them alike. Prints the tables and appends them, with the date, the machine, the
load average and the command line, to bench/RESULTS.md. Memory is in MB of 10^6 bytes, as the
product's bounds are.

    python bench/data.py [--size-mb 200] [--large-mb 1000] [--workdir /tmp/lmcockpit-bench-data] [--rounds 2]
                         [--file-mb 16] [--formats jsonl,parquet] [--large-formats jsonl] [--raw-mb 0]
                         [--skip workers,resume,large] [--tiktoken]
"""

from __future__ import annotations

import argparse
import filecmp
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from machine import record

MB = 1_000_000
SEED = 20261123
PRESET = "cpu"

# ------------------------------------------------------------------------------------ corpus
SYLLABLES = ("ka ro mi te su na lo ve di pa ri zo ul en ar ost ing ex bra tor lin que mel dor fa gen hu "
             "sil ter wan cy mo ph th ch str ple ment ous ia").split()
ACCENTED = "é è á ö ü ñ ç å ø í".split()


def vocabulary(cache: Path) -> tuple[list[str], np.ndarray]:
    """Words ranked by use and their Zipf-Mandelbrot probabilities; built once, kept in `cache`."""
    if not cache.is_file():
        import pydoc_data.topics
        import sysconfig

        word = re.compile(r"[A-Za-z][a-z]{0,18}(?:'[a-z]+)?")
        docs = Counter(w.lower() for w in word.findall("\n".join(pydoc_data.topics.topics.values())))
        lib = Counter()
        prose = re.compile(r'"""(.*?)"""|#([^\n]*)', re.S)
        for p in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            if "site-packages" in p.parts or "test" in p.parts:
                continue
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            for m in prose.finditer(text):
                lib.update(w.lower() for w in word.findall(m.group(1) or m.group(2) or ""))
        ranked = [w for w, _ in docs.most_common()]
        seen = set(ranked)
        ranked += [w for w, n in lib.most_common() if w not in seen and n >= 2]
        rng = np.random.default_rng(SEED)
        tail: set[str] = set(ranked)
        while len(tail) < len(ranked) + 400_000:  # made-up words: the long tail of names and rare words
            parts = [SYLLABLES[i] for i in rng.integers(0, len(SYLLABLES), rng.integers(2, 5))]
            if rng.random() < 0.05:
                parts.insert(int(rng.integers(1, len(parts))), ACCENTED[int(rng.integers(0, len(ACCENTED)))])
            tail.add("".join(parts))
        ranked += sorted(tail - set(ranked), key=lambda w: (zlib.crc32(w.encode()), w))  # a fixed shuffle
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(ranked))
    words = json.loads(cache.read_text())
    ranks = np.arange(len(words), dtype=np.float64)
    p = 1.0 / (ranks + 2.7) ** 1.15  # "the" 6%, the top 10,000 words 86%, the made-up tail 15%
    return words, p / p.sum()


class Writer:
    """Each document to both formats at once: a `.jsonl.zst` file per `file_bytes` of text, a
    Parquet row group per `file_bytes` and a Parquet file per `row_groups` of them."""

    def __init__(self, folder: Path, file_bytes: int, row_groups: int):
        import pyarrow as pa

        self.folder, self.file_bytes, self.row_groups = folder, file_bytes, row_groups
        (folder / "jsonl").mkdir(parents=True, exist_ok=True)
        (folder / "parquet").mkdir(parents=True, exist_ok=True)
        self.schema = pa.schema([("id", pa.string()), ("text", pa.string())])
        self.jsonl = self.jsonl_raw = None
        self.jsonl_n = self.jsonl_bytes = 0
        self.pq = None
        self.pq_n = self.groups_in_file = 0
        self.rows: list[tuple[str, str]] = []
        self.rows_bytes = 0

    def add(self, doc_id: str, text: str) -> None:
        import zstandard

        if self.jsonl is None:
            self.jsonl_raw = open(self.folder / "jsonl" / f"part-{self.jsonl_n:05d}.jsonl.zst", "wb")
            self.jsonl = zstandard.ZstdCompressor(level=3).stream_writer(self.jsonl_raw)
        n = len(text.encode())
        self.jsonl.write(json.dumps({"id": doc_id, "text": text}, ensure_ascii=False).encode() + b"\n")
        self.jsonl_bytes += n
        if self.jsonl_bytes >= self.file_bytes:
            self._close_jsonl()
        self.rows.append((doc_id, text))
        self.rows_bytes += n
        if self.rows_bytes >= self.file_bytes:
            self._flush_rows()

    def _close_jsonl(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()  # closes the file too
            self.jsonl, self.jsonl_bytes, self.jsonl_n = None, 0, self.jsonl_n + 1

    def _flush_rows(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self.rows:
            return
        if self.pq is None:
            self.pq = pq.ParquetWriter(self.folder / "parquet" / f"part-{self.pq_n:05d}.parquet", self.schema,
                                       compression="zstd")
        ids, texts = zip(*self.rows)
        self.pq.write_table(pa.table({"id": list(ids), "text": list(texts)}, schema=self.schema),
                            row_group_size=len(ids))
        self.rows, self.rows_bytes = [], 0
        self.groups_in_file += 1
        if self.groups_in_file >= self.row_groups:
            self._close_pq()

    def _close_pq(self) -> None:
        if self.pq is not None:
            self.pq.close()
            self.pq, self.groups_in_file, self.pq_n = None, 0, self.pq_n + 1

    def close(self) -> None:
        self._close_jsonl()
        self._flush_rows()
        self._close_pq()


def document(rng: np.random.Generator, words: np.ndarray, cum: np.ndarray, caps: np.ndarray) -> str:
    n = int(math.exp(rng.uniform(math.log(200), math.log(3000))))
    idx = np.searchsorted(cum, rng.random(n), side="right").clip(max=len(words) - 1)
    toks = words[idx].copy()
    # sentences of 4 to 30 words; commas inside; numbers now and then
    pos, sentence_starts, ends = 0, [], []
    while pos < n:
        sentence_starts.append(pos)
        pos += int(rng.integers(4, 31))
        ends.append(min(pos, n) - 1)
    sentence_starts, ends = np.array(sentence_starts), np.array(ends)
    toks[sentence_starts] = caps[idx[sentence_starts]]
    commas = rng.random(n) < 0.06
    toks[commas] = toks[commas] + ","
    numbers = np.flatnonzero(rng.random(n) < 0.01)
    for i in numbers:
        toks[i] = str(int(rng.integers(0, 3000))) if rng.random() < 0.7 else f"{rng.random() * 100:.2f}"
    marks = rng.choice(np.array([".", ".", ".", ".", "?", "!", ":", " —", "…"]), len(ends))
    toks[ends] = toks[ends] + marks.astype(object)
    quoted = np.flatnonzero(rng.random(n) < 0.004)
    toks[quoted] = "“" + toks[quoted] + "”"
    # paragraphs of 2 to 8 sentences
    out, s = [], 0
    while s < len(sentence_starts):
        k = int(rng.integers(2, 9))
        a, b = sentence_starts[s], ends[min(s + k, len(ends)) - 1] + 1
        out.append(" ".join(toks[a:b]))
        s += k
    return "\n\n".join(out)


def corpus(workdir: Path, size_mb: int, file_mb: int) -> tuple[Path, dict]:
    """The corpus of `size_mb` MB of UTF-8 text, made if need be; `stats.json` marks it complete."""
    folder = workdir / f"corpus-{size_mb}mb-{file_mb}"
    if (folder / "stats.json").is_file():
        return folder, json.loads((folder / "stats.json").read_text())
    shutil.rmtree(folder, ignore_errors=True)
    word_list, p = vocabulary(workdir / "vocabulary.json")
    words = np.array(word_list, dtype=object)
    caps = np.array([w[:1].upper() + w[1:] for w in word_list], dtype=object)
    cum = np.cumsum(p)
    rng = np.random.default_rng([SEED, size_mb])
    t0 = time.perf_counter()
    writer = Writer(folder, file_mb * MB, row_groups=4)
    docs = chars = total = 0
    while total < size_mb * MB:
        text = document(rng, words, cum, caps)
        writer.add(f"synthetic-{docs:08d}", text)
        docs += 1
        chars += len(text)
        total += len(text.encode())
    writer.close()
    stats = {"documents": docs, "bytes": total, "chars": chars, "seconds": round(time.perf_counter() - t0, 1),
             "jsonl_files": len(list((folder / "jsonl").iterdir())),
             "parquet_files": len(list((folder / "parquet").iterdir())),
             "disk": {f: sum(x.stat().st_size for x in (folder / f).iterdir()) for f in ("jsonl", "parquet")}}
    (folder / "stats.json").write_text(json.dumps(stats))
    print(f"corpus: {docs:,} documents, {total / MB:.0f} MB of text in {stats['seconds']} s ({folder})", flush=True)
    return folder, stats


def texts_in_batches(folder: Path, batch_bytes: int = 8 * MB):
    """The corpus's documents in order (from the Parquet copy), a list of about `batch_bytes` at a time."""
    import pyarrow.parquet as pq

    batch, held = [], 0
    for f in sorted((folder / "parquet").iterdir()):
        for rb in pq.ParquetFile(f).iter_batches(batch_size=1024, columns=["text"]):
            for t in rb.column(0).to_pylist():
                batch.append(t)
                held += len(t)
                if held >= batch_bytes:
                    yield batch
                    batch, held = [], 0
    if batch:
        yield batch


# ----------------------------------------------------------------------------------- prepare
CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
def emit(**kw):
    print(json.dumps({"t": round(time.perf_counter() - t0, 3), "epoch": time.time(), **kw}), flush=True)
from lmcockpit.core.config import load_config
from lmcockpit.core.data import build
from lmcockpit.core.data.prepare import prepare
cfg, _ = load_config(sys.argv[1], sys.argv[2:])
emit(started=1, code=build.__file__)
data = prepare(cfg, lambda line: emit(log=line), lambda stage, done, total, unit: emit(stage=stage, done=done))
emit(finished=str(data.dir), train=len(data.train), val=len(data.val))
"""


class TreeRSS(threading.Thread):
    """The peak, over time, of the summed RSS of a process and all its descendants; and each
    process's own peak RSS (VmHWM, the kernel's high-water mark, read at every sample), its command
    line and when it was first seen, to tell the main process, the BPE's child and the workers apart."""

    def __init__(self, pid: int, every: float = 0.1):
        super().__init__(daemon=True)
        self.pid, self.every, self.peak, self.peak_procs, self.peak_pss = pid, every, 0, 0, 0
        self.per_pid: dict[int, int] = {}  # each process's own peak, sampled
        self.hwm: dict[int, int] = {}  # each process's VmHWM, as last read
        self.info: dict[int, tuple[float, str]] = {}  # pid: (when first seen, command line)
        self.samples: list[tuple[float, int]] = []  # (time, the tree's summed RSS)
        self.stop = threading.Event()

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self.stop.is_set():
            try:
                procs = [root] + root.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            total = pss = 0
            for p in procs:
                try:
                    # First seen: this clock, as the child's events' (psutil's create_time can be 1 s off).
                    # The command line read again until it is a spawned one's (a fork not yet exec'd
                    # shows its parent's).
                    seen, cmd = self.info.get(p.pid, (time.time(), ""))
                    if p.pid != self.pid and "spawn_main" not in cmd and "resource_tracker" not in cmd:
                        self.info[p.pid] = (seen, " ".join(p.cmdline()))
                    m = p.memory_full_info()  # PSS too: a page shared by n processes counts 1/n in each
                    hwm = _vm_hwm(p.pid)
                except (psutil.NoSuchProcess, psutil.AccessDenied, OSError, ValueError):
                    continue
                total += m.rss
                pss += m.pss
                self.per_pid[p.pid] = max(self.per_pid.get(p.pid, 0), m.rss)
                self.hwm[p.pid] = max(self.hwm.get(p.pid, 0), hwm, m.rss)
            self.peak_pss = max(self.peak_pss, pss)
            self.samples.append((time.time(), total))
            if total > self.peak:
                self.peak, self.peak_procs = total, len(procs)
            self.stop.wait(self.every)

    def roles(self, tokenizing_from: float | None) -> dict:
        """Each process's peak by role: main, bpe (the spawned child that trains the BPE, seen
        before the tokenising phase), tracker (multiprocessing's resource tracker), workers (the
        pool's, started after it; a list), other."""
        out: dict = {"main": self.hwm.get(self.pid, 0), "bpe": None, "tracker": None, "workers": [], "other": []}
        for pid, peak in sorted(self.hwm.items(), key=lambda kv: self.info.get(kv[0], (0.0, ""))[0]):
            if pid == self.pid:
                continue
            created, cmd = self.info.get(pid, (0.0, ""))
            if "resource_tracker" in cmd:
                out["tracker"] = max(out["tracker"] or 0, peak)
            elif "spawn_main" in cmd and tokenizing_from is not None and created < tokenizing_from:
                out["bpe"] = max(out["bpe"] or 0, peak)
            elif "spawn_main" in cmd:
                out["workers"].append(peak)
            else:
                out["other"].append(peak)
        return out


def _vm_hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class Load(threading.Thread):
    """The 1-minute load average, every 5 s, for the whole bench (its own processes included)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[float] = []

    def run(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            time.sleep(5)

    def summary(self, since: int = 0) -> str:
        xs = sorted(self.samples[since:]) or [os.getloadavg()[0]]
        return f"{xs[0]:.1f}–{xs[-1]:.1f} (median {xs[len(xs) // 2]:.1f})"


def prepare_cmd(source: Path, cache: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-c", CHILD, PRESET, f'data.source="{source}"', f'data.cache_dir="{cache}"', *extra]


def run_prepare(source: Path, cache: Path, extra: list[str] = (), kill_at: float | None = None,
                kill_group: bool = True, must_succeed: bool = True) -> dict:
    """One prepare in a subprocess (a session of its own), its events, wall time and peak tree RSS.
    `kill_at`: SIGKILL it once that share of the pieces is done: its whole process group, or with
    `kill_group` false its main process alone (its workers then outlive it for a while)."""
    import psutil

    t0 = time.perf_counter()
    proc = subprocess.Popen(prepare_cmd(source, cache, list(extra)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    rss = TreeRSS(proc.pid)
    rss.start()
    events: list[dict] = []
    errors: list[str] = []
    reader = threading.Thread(target=lambda: events.extend(json.loads(line) for line in proc.stdout), daemon=True)
    reader.start()
    err_reader = threading.Thread(target=lambda: errors.append(proc.stderr.read()), daemon=True)
    err_reader.start()
    killed = None
    if kill_at is not None:
        while proc.poll() is None:
            builds = [b for b in cache.glob(".build-*") if b.is_dir()]
            if builds and (builds[0] / "plan.json").is_file():
                pieces = json.loads((builds[0] / "plan.json").read_text())["pieces"]
                done = len(list((builds[0] / "pieces").glob("*.json")))
                if done >= math.ceil(pieces * kill_at):
                    children = psutil.Process(proc.pid).children(recursive=True)
                    if kill_group:
                        os.killpg(proc.pid, signal.SIGKILL)
                    else:
                        os.kill(proc.pid, signal.SIGKILL)
                    killed = {"pieces": pieces, "done": done, "at": time.perf_counter() - t0,
                              "children": children}
                    break
            time.sleep(0.02)
    proc.wait()
    wall = time.perf_counter() - t0
    rss.stop.set()
    rss.join()
    if killed is not None:  # the pipes stay open while orphans live: not waited for
        time.sleep(0.2)
        children = killed.pop("children")
        killed["children"] = len(children)
        killed["alive"] = sum(1 for c in children if _alive(c))
        return {"wall": wall, "killed": killed}
    reader.join()
    err_reader.join()
    err = errors[0] if errors else ""
    if proc.returncode != 0:
        if must_succeed:
            raise SystemExit(f"prepare failed ({proc.returncode}):\n{err[-4000:]}")
        return {"wall": wall, "rc": proc.returncode, "stderr": err, "dir": None}
    out = {"wall": wall, "events": events, "rss": rss.peak, "rss_procs": rss.peak_procs, "pss": rss.peak_pss,
           "stderr": err, "load": os.getloadavg()[0]}
    fin = next(e for e in events if "finished" in e)
    out["dir"] = Path(fin["finished"])
    out["meta"] = json.loads((out["dir"] / "meta.json").read_text())
    tok = [e for e in events if e.get("stage") == "tokenizing"]
    start = next(e for e in events if "started" in e)
    out["code"] = start.get("code", "")
    out["bpe"] = (tok[0]["t"] - start["t"]) if tok else 0.0  # listing, estimates, BPE training: before tokenising
    out["tokenizing"] = tok[-1]["t"] - tok[0]["t"] if tok else 0.0
    out["resumed"] = next((e["log"] for e in events if "resuming" in e.get("log", "")), "")
    out["procs"] = rss.roles(tok[0]["epoch"] if tok else None)
    out["rss_tokenizing"] = max((x for at, x in rss.samples if tok and at >= tok[0]["epoch"]), default=0)
    out["encoded"] = encoded(out["dir"], events)
    return out


def encoded(cache: Path, events: list[dict]) -> dict:
    """Which encoder a prepare used: its log's line, and its pieces' summaries (pieces/*.json)."""
    pieces = [json.loads(f.read_text()) for f in sorted((cache / "pieces").glob("*.json"))]
    return {"log": next((e["log"] for e in events if e.get("log", "").startswith("data: encoded by")), ""),
            "pieces": len(pieces), "by": dict(Counter(str(s.get("encoder")) for s in pieces)),
            "checked": sum(s.get("checked", 0) for s in pieces),
            "documents": sum(s["documents"]["train"] + s["documents"]["val"] for s in pieces),
            "disagreed": [s["disagreed"] for s in pieces if s.get("disagreed")],
            "workers_log": next((e["log"] for e in events if "tokenizer processes for" in e.get("log", "")), "")}


def _alive(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def fresh(cache: Path) -> Path:
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    return cache


def same_files(a: Path, b: Path) -> tuple[int, int, list[str]]:
    """(files compared, bytes compared, what differs) between two folders, every file byte for byte."""
    fa = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    fb = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    diff = sorted(set(fa) ^ set(fb))
    n_bytes = 0
    for rel in sorted(set(fa) & set(fb)):
        n_bytes += (a / rel).stat().st_size
        if not filecmp.cmp(a / rel, b / rel, shallow=False):
            diff.append(rel)
    return len(fa), n_bytes, diff


# -------------------------------------------------------------------------------- raw speed
def raw_speed(folder: Path, tokenizer_json: Path, eos: int | None, limit_bytes: int = 0) -> dict:
    """The same tokenizer over the same documents (the first `limit_bytes` of text, 0: all), in this
    one process, timing only the encode calls, batch by batch in turn: `encode_batch_fast` on every core (tokenizers' threads), core's
    Encoder on one thread as a worker runs it (tiktoken where the BPE allows it; its check of 1/32
    of the documents by tokenizers, one thread, timed apart). The Encoder's ids are compared with
    `encode_batch_fast`'s (an end-of-text after each document) for every document, untimed."""
    from tokenizers import Tokenizer

    from lmcockpit.core.data.build import CHECK_SHARE
    from lmcockpit.core.data.encoder import Encoder

    enc = Encoder(str(tokenizer_json), eos)  # a worker's: fast, tiktoken where it gives the same ids
    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.encode_special_tokens = True  # as the Encoder's reference: a corpus's "<|endoftext|>" is text
    every = round(1 / CHECK_SHARE)  # a worker checks a hashed 1/32 of its documents: here every 32nd
    res = {"fast": 0.0, "core": 0.0, "check": 0.0, "chars": 0, "bytes": 0, "docs": 0, "tokens": 0,
           "core_tokens": 0, "differ": 0, "first": None, "encoder": enc.name, "threads": len(os.sched_getaffinity(0))}
    try:
        for batch in texts_in_batches(folder):
            os.environ.pop("TOKENIZERS_PARALLELISM", None)  # every core
            t0 = time.perf_counter()
            encs = tok.encode_batch_fast(batch, add_special_tokens=False)
            res["fast"] += time.perf_counter() - t0
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread, as in a worker (_worker_init)
            t0 = time.perf_counter()
            ids = enc.encode(batch)
            res["core"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            enc.reference_ids(batch[::every])
            res["check"] += time.perf_counter() - t0
            lists = [e.ids for e in encs]
            res["tokens"] += sum(len(x) for x in lists)
            res["core_tokens"] += len(ids)
            tail = [eos] if eos is not None else []
            want = np.fromiter(itertools.chain.from_iterable(y for x in lists for y in (x, tail)), np.int64)
            if not np.array_equal(want, ids):
                res["differ"] += 1  # batches with a difference; the first differing document named
                pos = 0
                for k, x in enumerate(lists):
                    if ids[pos:pos + len(x) + len(tail)].tolist() != [*x, *tail]:
                        res["first"] = res["first"] if res["first"] is not None else res["docs"] + k
                        break
                    pos += len(x) + len(tail)
            del encs, lists, want, ids
            res["docs"] += len(batch)
            res["chars"] += sum(len(t) for t in batch)
            res["bytes"] += sum(len(t.encode()) for t in batch)
            if limit_bytes and res["bytes"] >= limit_bytes:
                break
    finally:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)
    return res


def tiktoken_check(folder: Path, tokenizer_json: Path, limit_bytes: int) -> dict:
    """The product's Encoder (its tiktoken Encoding, built by encoder.tiktoken_encoding) against
    tokenizers on the same batches, on every core and on one, the four calls alternating batch by
    batch; ids compared document by document."""
    from lmcockpit.core.data.encoder import Encoder

    enc = Encoder(str(tokenizer_json), None)
    if enc.tiktoken is None:
        from lmcockpit.core.data.encoder import tiktoken_shape

        return {"refused": tiktoken_shape(json.loads(tokenizer_json.read_text())) or "tiktoken_encoding gave none"}
    threads = len(os.sched_getaffinity(0))
    res = {"hf": 0.0, "tt": 0.0, "hf1": 0.0, "tt1": 0.0, "docs": 0, "bytes": 0, "differ": 0, "first": None,
           "threads": threads}
    try:
        for batch in texts_in_batches(folder):
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
            t0 = time.perf_counter()
            a = enc.reference_ids(batch)
            res["hf"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            enc.tiktoken.encode_ordinary_batch(batch, num_threads=threads)
            res["tt"] += time.perf_counter() - t0
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # as prepare's workers run it: one thread each
            t0 = time.perf_counter()
            enc.reference_ids(batch)
            res["hf1"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            b = [enc.tiktoken.encode_ordinary(t) for t in batch]  # what Encoder.encode does
            res["tt1"] += time.perf_counter() - t0
            for i, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    res["differ"] += 1
                    res["first"] = res["first"] if res["first"] is not None else res["docs"] + i
            res["docs"] += len(batch)
            res["bytes"] += sum(len(t.encode()) for t in batch)
            if res["bytes"] >= limit_bytes:
                break
    finally:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)
    return res


# ---------------------------------------------------------------------------------- report
def mbs(n_bytes: float, seconds: float) -> str:
    return f"{n_bytes / MB / seconds:.2f}" if seconds > 0 else "–"


def mem(n: int | None) -> str:
    """Bytes as MB of 10^6 bytes, as the product's bounds (children.WORKER_BYTES, TREE_BYTES) are."""
    return "–" if n is None else f"{n / MB:,.0f} MB"


def encoder_note(e: dict) -> str:
    by = ", ".join(f"{name} {n}" for name, n in sorted(e["by"].items()))
    return (f"{e['pieces']} pieces ({by}); {e['checked']:,} of {e['documents']:,} documents checked against "
            f"tokenizers ({e['checked'] / max(1, e['documents']):.1%}); "
            + (f"**{len(e['disagreed'])} pieces disagreed** (first: {e['disagreed'][0]})" if e["disagreed"]
               else "no piece disagreed") + f"; log: \"{e['log'].removeprefix('data: ')}\"")


def resume_after_kill(folder: Path, cache: Path, whole: dict, group: bool) -> tuple[list[str], str]:
    """Kill prepare once half its pieces are done (`group`: its whole process group, as a job kill does;
    else its main process alone, as `kill -9 PID` or the OOM killer does), then prepare again until one
    succeeds (three tries). Rows for the table, and a sentence on the resumed cache's files."""
    killed = run_prepare(folder, fresh(cache), kill_at=0.5, kill_group=group)
    what = "the process group" if group else "the main process only"
    if killed["killed"] is None:
        return [f"| SIGKILL of {what} | – | the prepare finished before half its pieces were done |"], ""
    k = killed["killed"]
    rows = [f"| SIGKILL of {what}, until the kill | {k['at']:.1f} | {k['done']} of {k['pieces']} pieces done; "
            f"{k['alive']} of its {k['children']} child processes still alive 0.2 s after |"]
    total = k["at"]
    for attempt in range(1, 4):
        rest = run_prepare(folder, cache, must_succeed=False)
        total += rest["wall"]
        if rest.get("dir") is not None:
            rows.append(f"| `prepare` again{f' (try {attempt})' if attempt > 1 else ''}: the rest | {rest['wall']:.1f} | "
                        f"{rest['wall'] / whole['wall']:.2f} of the whole; \"{rest['resumed'].removeprefix('data: ')}\" |")
            rows.append(f"| killed + rest | {total:.1f} | {total / whole['wall']:.2f} of the whole |")
            n, nb, diff = same_files(whole["dir"], rest["dir"])
            return rows, (f"after a SIGKILL of {what}: {n} files, {nb / MB:.0f} MB compared byte for byte with the "
                          f"uninterrupted cache: " + ("**byte-identical**" if not diff else
                                                      f"**DIFFERENT**: {', '.join(diff[:8])}"))
        last = rest["stderr"].strip().splitlines()[-1] if rest["stderr"].strip() else f"exit {rest['rc']}"
        rows.append(f"| `prepare` again (try {attempt}): **failed** | {rest['wall']:.1f} | `{last[:220]}` |")
    return rows, f"after a SIGKILL of {what}: no prepare succeeded in three tries"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=200, help="corpus size, MB of UTF-8 text (default 200)")
    ap.add_argument("--large-mb", type=int, default=1000, help="the second size for peak memory (default 1000)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/lmcockpit-bench-data"))
    ap.add_argument("--file-mb", type=int, default=16, help="text per .jsonl.zst file and per Parquet row group")
    ap.add_argument("--formats", default="jsonl,parquet", help="which copies to prepare: jsonl, parquet or both")
    ap.add_argument("--large-formats", default="", help="which copies to prepare at --large-mb (default: --formats)")
    ap.add_argument("--rounds", type=int, default=2, help="throughput rows run in turn this many times; best kept")
    ap.add_argument("--skip", default="", help="comma-separated: workers, resume, large")
    ap.add_argument("--tiktoken", action="store_true",
                    help="also compare the product's Encoder (tiktoken) with tokenizers, on every core and on one")
    ap.add_argument("--tiktoken-mb", type=int, default=40, help="text the tiktoken comparison reads (default 40)")
    ap.add_argument("--raw-mb", type=int, default=0,
                    help="text the raw rows encode each round: the corpus's first documents (default 0: all of it)")
    ap.add_argument("--no-record", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args()
    from lmcockpit.core.data import children

    load = Load()
    load.start()
    skip = set(filter(None, args.skip.split(",")))
    formats = [f for f in args.formats.split(",") if f]
    large_formats = [f for f in (args.large_formats or args.formats).split(",") if f]
    workdir = args.workdir.resolve()
    caches = workdir / "caches"
    folder, stats = corpus(workdir, args.size_mb, args.file_mb)
    cores = len(os.sched_getaffinity(0))
    base_fmt = formats[0]
    label = {"jsonl": "`.jsonl.zst`", "parquet": "Parquet"}
    bound = {"jsonl": ("WORKER_BYTES", children.WORKER_BYTES), "parquet": ("COLUMNAR_WORKER_BYTES", children.COLUMNAR_WORKER_BYTES)}
    marks: dict[str, int] = {"start": len(load.samples)}

    # 1-3. prepare per format, its tokenizer's raw speed, one worker: in turn, round after round
    runs: dict[str, list[dict]] = {}
    raws: dict[str, list[dict]] = {}
    notes: list[str] = []
    for rnd in range(args.rounds):
        keys = [(fmt, []) for fmt in formats] + ([] if "workers" in skip else [("w1", ["data.workers=1"])])
        for key, extra in keys:
            fmt = base_fmt if key == "w1" else key
            print(f"round {rnd + 1}: prepare {key} ...", flush=True)
            r = run_prepare(folder / fmt, fresh(caches / f"{key}-r{rnd}"), extra)
            m = r["meta"]
            print(f"  {r['wall']:.1f} s (BPE {r['bpe']:.1f} s, tokenising {r['tokenizing']:.1f} s), "
                  f"{m['train_tokens'] + m['val_tokens']:,} tokens, peak RSS {mem(r['rss'])}, "
                  f"{r['encoded']['log']}, load {r['load']:.1f}", flush=True)
            runs.setdefault(key, []).append(r)
            ref = runs[fmt][0]["dir"]
            if r["dir"] != ref:  # every later cache of the same data against the first: byte for byte
                n, nb, diff = same_files(ref, r["dir"])
                if diff or rnd == args.rounds - 1:
                    notes.append(f"{key} round {rnd + 1} against {fmt} round 1: {n} files, {nb / MB:.0f} MB: "
                                 + ("byte-identical" if not diff else "DIFFERENT: " + ", ".join(diff[:5])) + ".")
                shutil.rmtree(r["dir"].parent)
            if key != "w1":
                print(f"round {rnd + 1}: raw encode, {key}'s tokenizer ...", flush=True)
                raw = raw_speed(folder, ref / "tokenizer" / "tokenizer.json", m["eos_id"], args.raw_mb * MB)
                print(f"  encode_batch_fast {raw['fast']:.1f} s, Encoder ({raw['encoder']}) {raw['core']:.1f} s "
                      f"+ check {raw['check']:.1f} s", flush=True)
                raws.setdefault(key, []).append(raw)
    marks["throughput"] = len(load.samples)

    def best(key: str) -> dict:
        return min(runs[key], key=lambda r: r["tokenizing"])

    def raw_best(fmt: str, what: str) -> float:
        return min(r[what] if what != "worker" else r["core"] + r["check"] for r in raws[fmt])

    def rate(r: dict) -> float:  # bytes/s of the tokenising phase
        return stats["bytes"] / r["tokenizing"]

    def n_workers(r: dict) -> int:
        return len(r["procs"]["workers"]) or 1

    rows = []
    for key in list(runs):
        r, fmt = best(key), (base_fmt if key == "w1" else key)
        m = r["meta"]
        tokens = m["train_tokens"] + m["val_tokens"]
        name = (f"`prepare`, {label[fmt]}, `data.workers=1`" if key == "w1" else
                f"`prepare`, {label[fmt]}, workers 0 (= {n_workers(r)})")
        walls = ", ".join(f"{x['wall']:.1f}" for x in runs[key])
        loads = ", ".join(f"{x['load']:.1f}" for x in runs[key])
        rows.append(f"| {name} | {r['wall']:.1f} s | {r['bpe']:.1f} s | {r['tokenizing']:.1f} s | "
                    f"{mbs(stats['bytes'], r['wall'])} | {mbs(stats['bytes'], r['tokenizing'])} | "
                    f"{tokens / r['tokenizing'] / 1e6:.2f}M | {walls} | {loads} |")
    for fmt in formats:
        raw = raws[fmt][0]
        for what, name, threads in (
                ("fast", "`Tokenizer.encode_batch_fast`", f"{cores} threads"),
                ("core", f"core `Encoder` ({raw['encoder']})", "1 thread"),
                ("worker", f"core `Encoder` ({raw['encoder']}) + its 1/32 check by tokenizers", "1 thread")):
            t = raw_best(fmt, what)
            tokens = raw["tokens"] if what == "fast" else raw["core_tokens"]
            times = ", ".join(f"{(x['core'] + x['check']) if what == 'worker' else x[what]:.1f}" for x in raws[fmt])
            rows.append(f"| raw {name}, {fmt}'s tokenizer, 1 process, {threads} | | | {t:.1f} s | | "
                        f"{mbs(raw['bytes'], t)} | {tokens / t / 1e6:.2f}M | {times} | |")
    ratio_lines = []
    for key in runs:
        fmt = base_fmt if key == "w1" else key
        r = best(key)
        w = n_workers(r)
        n_raw = raws[fmt][0]["bytes"]
        raw_fast, raw_worker = n_raw / raw_best(fmt, "fast"), n_raw / raw_best(fmt, "worker")
        same_round = ", ".join(f"{rate(x) / (raw['bytes'] / raw['fast']):.2f}" for x, raw in zip(runs[key], raws[fmt]))
        ratio_lines.append(f"| {label[fmt]}, {'workers 1' if key == 'w1' else f'workers 0 (= {w})'} | "
                           f"**{rate(r) / raw_fast:.2f}** | {rate(r) / (w * raw_worker):.2f} | "
                           f"{stats['bytes'] / r['wall'] / raw_fast:.2f} | {same_round} |")
    for fmt in formats:
        m, raw = runs[fmt][0]["meta"], raws[fmt][0]
        got = m["train_tokens"] + m["val_tokens"]
        want = raw["tokens"] + raw["docs"] * (m["eos_id"] is not None)
        whole = raw["docs"] == stats["documents"]
        notes.append(f"{fmt}: {m['documents']['train']:,} + {m['documents']['val']:,} documents (corpus: "
                     f"{stats['documents']:,}), {got:,} tokens " + (
                         f"(its tokenizer's `encode_batch_fast` over the same documents, an EOS each: {want:,}: "
                         f"{'equal' if got == want else 'DIFFERENT'})" if whole else
                         f"(the raw rows encoded the first {raw['docs']:,} documents only: counts not compared)")
                     + f"; meta.json `bytes` {m['bytes']:,} (the corpus: {stats['bytes']:,} UTF-8 bytes); "
                     f"{len(m['shards'])} shards.")
        notes.append(f"{fmt}'s raw `Encoder` ({raw['encoder']}) against `encode_batch_fast`, every document it "
                     f"encoded in every round ({raw['docs']:,} a round, {raw['bytes'] / MB:.0f} MB): " + ("the same ids." if not any(x["differ"] for x in raws[fmt])
                     else f"**ids DIFFER** (first: document {next(x['first'] for x in raws[fmt] if x['differ'])})."))
    for key in runs:
        encs = {json.dumps(x["encoded"], sort_keys=True) for x in runs[key]}
        notes.append(f"Encoder, {key}: " + encoder_note(runs[key][0]["encoded"])
                     + ("" if len(encs) == 1 else f" (the {len(runs[key])} rounds' pieces say otherwise: {len(encs)} variants)"))

    # 4. resume after a kill at half way
    resume_lines = []
    if "resume" not in skip:
        print("prepare, uninterrupted, just before the kills ...", flush=True)
        whole = run_prepare(folder / base_fmt, fresh(caches / "resume-whole"))  # under the load the kills see
        earlier = ", ".join(f"{x['wall']:.1f}" for x in runs[base_fmt])
        resume_lines = ["| resume after SIGKILL at half way | seconds | |", "| --- | ---: | --- |",
                        f"| uninterrupted `prepare` ({label[base_fmt]}, {stats['bytes'] / MB:.0f} MB), run just before "
                        f"| {whole['wall']:.1f} | the throughput rounds above: {earlier} |"]
        sentences = []
        for group in (True, False):
            print(f"prepare killed at half way ({'group' if group else 'main process'}), then again ...", flush=True)
            lines, sentence = resume_after_kill(folder / base_fmt, caches / f"resumed-{int(group)}", whole, group)
            resume_lines += lines
            sentences.append(sentence)
        resume_lines += ["", "Resumed caches " + "; ".join(filter(None, sentences)) + "."]
        shutil.rmtree(caches / "resume-whole", ignore_errors=True)
        for group in (0, 1):
            shutil.rmtree(caches / f"resumed-{group}", ignore_errors=True)
    marks["resume"] = len(load.samples)

    # 5. peak memory at two sizes, each process apart
    mem_lines, per_worker, bigs = [], [], {}
    if "large" not in skip:
        big_folder, big_stats = corpus(workdir, args.large_mb, args.file_mb)
        marks["large corpus made"] = len(load.samples)
        mem_lines = ["| peak memory of prepare | text | pieces | wall | BPE | MB/s | RSS, tree (sum) | PSS, tree (sum) | "
                     "RSS, tree, tokenising phase | main | BPE child | resource tracker | each worker | "
                     "a worker's bound (children.py) |",
                     "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
        ratios = []
        for fmt in large_formats:
            print(f"prepare {fmt}, {args.large_mb} MB ...", flush=True)
            big = run_prepare(big_folder / fmt, fresh(caches / f"{fmt}-large"))
            print(f"  {big['wall']:.1f} s (BPE {big['bpe']:.1f} s), peak RSS {mem(big['rss'])}, {big['encoded']['log']}, load {big['load']:.1f}",
                  flush=True)
            bigs[fmt] = big
            shutil.rmtree(caches / f"{fmt}-large", ignore_errors=True)
        for key in [*formats, *(["w1"] if "w1" in runs else [])]:
            fmt = base_fmt if key == "w1" else key
            small = max(runs[key], key=lambda r: r["rss"])
            sizes = [(args.size_mb, small, stats)] + ([(args.large_mb, bigs[fmt], big_stats)] if key in bigs else [])
            for size, r, s in sizes:
                pr = r["procs"]
                name, const = bound[fmt]
                worst = max(pr["workers"], default=None)
                verdict = ("– (no pool: the main process tokenises)" if worst is None else
                           f"{name} {mem(const)}: largest {mem(worst)}, " + ("**under**" if worst < const else "**OVER**"))
                if worst is not None:
                    per_worker.append((fmt, size, worst, const, name))
                mem_lines.append(
                    f"| {label[fmt]}{', `data.workers=1`' if key == 'w1' else ''}, {size} MB | {s['bytes'] / MB:.0f} MB | "
                    f"{len(r['meta']['shards'])} | {r['wall']:.1f} s | {r['bpe']:.1f} s | {mbs(s['bytes'], r['wall'])} | {mem(r['rss'])} | "
                    f"{mem(r['pss'])} | {mem(r['rss_tokenizing'])} | {mem(pr['main'])} | {mem(pr['bpe'])} | {mem(pr['tracker'])} | "
                    f"{', '.join(mem(x) for x in pr['workers']) or '–'}"
                    f"{'; other processes: ' + ', '.join(mem(x) for x in pr['other']) if pr['other'] else ''} | {verdict} |")
            if key in bigs:
                ratios.append(f"{label[fmt]} {bigs[fmt]['rss'] / small['rss']:.2f} (PSS {bigs[fmt]['pss'] / small['pss']:.2f}, "
                              f"tokenising phase {bigs[fmt]['rss_tokenizing'] / small['rss_tokenizing']:.2f})")
        for fmt, big in bigs.items():
            notes.append(f"Encoder, {fmt} at {args.large_mb} MB: " + encoder_note(big["encoded"]))
        mem_lines += ["", f"Peak RSS of the tree, {big_stats['bytes'] / stats['bytes']:.1f}× the text against 1×: "
                      + "; ".join(ratios) + f". The bound: children.TREE_BYTES {mem(children.TREE_BYTES)}. Tree: summed "
                      "over prepare's processes every 0.1 s (psutil, from a thread of the bench); RSS summed counts a "
                      "shared page (libraries) once per process, PSS once in all; its tokenising phase: the samples from "
                      "the first tokenising progress on (the BPE's child has ended). Each process: its own peak RSS "
                      "(VmHWM from /proc, read at every sample, so up to 0.1 s before it ended), by role: main, the "
                      "spawned child that trains the BPE (seen before the tokenising phase), multiprocessing's "
                      "resource tracker, each pool worker. The small size's row: its round with the highest tree peak."]
    marks["large"] = len(load.samples)

    # 6. tiktoken
    tt_lines = []
    if args.tiktoken:
        print("tiktoken ...", flush=True)
        import tiktoken

        tok_json = runs[base_fmt][0]["dir"] / "tokenizer" / "tokenizer.json"
        tt = tiktoken_check(folder, tok_json, args.tiktoken_mb * MB)
        if "refused" in tt:
            tt_lines = [f"tiktoken: the product's Encoder does not use it for this BPE ({tt['refused']})."]
        else:
            tt_lines = [f"| core `Encoder`, same BPE ({base_fmt}'s), same {tt['bytes'] / MB:.0f} MB ({tt['docs']:,} "
                        "documents) | threads | seconds | MB/s | vs tokenizers |", "| --- | ---: | ---: | ---: | ---: |"]
            for n, hf_key, tt_key, call in ((tt["threads"], "hf", "tt", "`encode_ordinary_batch`"),
                                            (1, "hf1", "tt1", "`encode_ordinary` a document at a time (as `Encoder.encode`)")):
                tt_lines += [f"| tokenizers `encode_batch_fast` (`Encoder.reference_ids`) | {n} | {tt[hf_key]:.1f} | "
                             f"{mbs(tt['bytes'], tt[hf_key])} | 1.00x |",
                             f"| tiktoken {tiktoken.__version__} {call} | {n} | {tt[tt_key]:.1f} | "
                             f"{mbs(tt['bytes'], tt[tt_key])} | {tt[hf_key] / tt[tt_key]:.2f}x |"]
            tt_lines += ["", f"Ids (tokenizers' every document against tiktoken's, one thread): "
                         f"{tt['docs'] - tt['differ']:,} of {tt['docs']:,} documents identical"
                         + (f" (first difference: document {tt['first']})." if tt["differ"] else ".")
                         + " The four calls alternate batch by batch (8 MB each), so each saw the same load. "
                         "tiktoken's Encoding: the product's, `encoder.tiktoken_encoding` through `Encoder`."]
    marks["end"] = len(load.samples)

    import tiktoken
    import tokenizers

    meta = runs[base_fmt][0]["meta"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "core"], cwd=Path(__file__).parent,
                           capture_output=True, text=True).stdout.strip()
    phases = list(marks)
    load_line = "; ".join(f"{b}: {load.summary(marks[a]) if marks[b] > marks[a] else '–'}"
                          for a, b in zip(phases, phases[1:]) if marks[b] > marks[a])
    setup = (f"Command: `python bench/data.py {' '.join(sys.argv[1:])}`, the product's code at {commit}"
             f"{' (core/ modified)' if dirty else ''} ({runs[base_fmt][0]['code']}). Load average (1 min, every 5 s, "
             f"this bench's own processes included): {load_line}. Preset `{PRESET}`'s tokenizer settings (byte-level "
             f"BPE, vocab {meta['vocab_size']}, `train_bytes` 8 MB); tokenizers {tokenizers.__version__}, tiktoken "
             f"{tiktoken.__version__}. Synthetic corpus (the script's docstring): {stats['documents']:,} documents, "
             f"{stats['bytes'] / MB:.0f} MB of UTF-8 text, as {stats['jsonl_files']} `.jsonl.zst` files "
             f"({stats['disk']['jsonl'] / MB:.0f} MB on disk) and as {stats['parquet_files']} Parquet files of up to 4 "
             f"row groups ({stats['disk']['parquet'] / MB:.0f} MB), {args.file_mb} MB of text per file or row group; "
             f"`data.shard_bytes` default (16 MB). Each prepare: a fresh subprocess, an empty cache folder; its wall "
             f"time includes the interpreter's start and imports. BPE: from the start of `prepare` to its first "
             f"tokenising progress (listing, size estimates, the BPE trained on its sample in a child); MB/s and "
             f"tokens/s of the tokenising phase after it. Raw rows: "
             + ("the same documents" if raws[base_fmt][0]["docs"] == stats["documents"] else
                f"the corpus's first {raws[base_fmt][0]['docs']:,} documents ({raws[base_fmt][0]['bytes'] / MB:.0f} MB "
                f"of its {stats['bytes'] / MB:.0f} MB, `--raw-mb`)")
             + f" read from Parquet into memory in 8 MB batches, only the encode calls timed, the three calls "
             f"alternating batch by batch; speeds are MB/s of what each read. "
             f"{args.rounds} rounds, rows in turn; the best round shown, every round's wall (prepare) or encode time "
             f"(raw) in the last columns, with the load average as each prepare ended.")
    lines = [setup, "", "| run | wall | BPE | tokenising | MB/s whole | MB/s tokenising | tokens/s | each round | "
             "load at its end |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |", *rows, "",
             f"| tokenising phase's speed as a share of a raw speed (same tokenizer, same documents) | of "
             f"`encode_batch_fast`, {cores} threads (the issue's target: ≥ 0.9) | of W × core `Encoder` + check, 1 "
             f"thread (W: prepare's workers) | whole prepare, of `encode_batch_fast` | each round against its own "
             f"raw `encode_batch_fast` |", "| --- | ---: | ---: | ---: | --- |",
             *ratio_lines, "", *[f"* {n}" for n in notes]]
    for block in (resume_lines, mem_lines, tt_lines):
        if block:
            lines += ["", *block]
    dump = {"args": {k: str(v) for k, v in vars(args).items()}, "corpus": stats, "raw": raws, "load": load.samples,
            "large": {k: {x: y for x, y in r.items() if x not in ("events", "stderr", "dir")} for k, r in bigs.items()},
            "marks": marks, "runs": {k: [{x: y for x, y in r.items() if x not in ("events", "stderr", "dir")} for r in v]
                                     for k, v in runs.items()}}
    (workdir / f"results-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(dump, indent=1, default=str))
    if args.no_record:
        print("\n".join(lines))
    else:
        record("Data preparation: throughput, memory, resume (tiktoken encoder, bounded workers)", lines)


if __name__ == "__main__":
    main()

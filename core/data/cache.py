"""Tokens prepared once into memory-mapped arrays, keyed by everything that decides them.

The key covers the source (and every file's size and mtime), the split and slice settings, the
tokenizer settings, the token dtype and this format's version: change any and a new cache is
built; change none and a second run (or every rank of a multi-GPU run) reuses it. A cache is
built in a temporary folder and renamed into place, so a killed preparation leaves nothing
half-written that a later run could mistake for finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..config import Config, ConfigError
from . import sources, tokenizer
from .store import cache_root

FORMAT_VERSION = 1
ProgressFn = Callable[[str, int, int, str], None]


@dataclass
class TokenData:
    dir: Path
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    token_bytes: np.ndarray
    eos_id: int | None
    reused: bool

    @property
    def tokenizer_dir(self) -> Path:
        return self.dir / "tokenizer"


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def cache_key(cfg: Config, tokenizer_file: Path | None = None) -> tuple[str, list[sources.SourceFile]]:
    """What decides the tokens, hashed: the source's files and split, and the tokenizer (its
    settings, or with `tokenizer_file` that very file's contents)."""
    desc, files = sources.list_source_files(cfg.data)
    d, t = cfg.data, cfg.tokenizer
    material = {
        "format": FORMAT_VERSION,
        "source": desc,
        "files": [(f.rel, f.size, f.mtime_ns) for f in files],
        "text_field": d.text_field, "val_fraction": d.val_fraction, "max_bytes": d.max_bytes,
        "tokenizer": [t.kind, t.vocab_size, t.train_bytes],
        "dtype": np.dtype(token_dtype(t.vocab_size)).name,
    }
    if tokenizer_file is not None:
        material["tokenizer"] = ["file", hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()]
    elif t.kind != "bpe":  # a pretrained tokenizer's files decide the tokens as much as its path does
        folder = Path(t.kind).expanduser()
        material["tokenizer_files"] = [(f.name, f.stat().st_size, f.stat().st_mtime_ns)
                                       for f in (folder / "tokenizer.json", folder / "tokenizer_config.json")
                                       if f.is_file()]
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]
    return digest, files


def prepare(cfg: Config, log: Callable[[str], None], progress: ProgressFn,
            tokenizer_file: Path | None = None) -> TokenData:
    """The token cache for `cfg`'s data, built if need be. A resumed run passes its own
    `tokenizer_file`: its weights know those ids and no others. The cache for its data serves if it
    was made with that very tokenizer; if not (the source changed since the run started, so a new
    BPE would differ, or the cache was deleted), the data is tokenised with the run's own."""
    key, files = cache_key(cfg)
    root = cache_root(cfg)
    if tokenizer_file is not None and not _same_bytes(root / key / "tokenizer" / "tokenizer.json", tokenizer_file):
        key, files = cache_key(cfg, tokenizer_file)
    else:
        tokenizer_file = None  # the cache for the data has it already
    final = root / key
    if (final / "meta.json").is_file():
        log(f"data: reusing token cache {final}")
        return _open(final, cfg, reused=True)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(_mkdtemp(root, key))
    except OSError as e:
        raise ConfigError(f"data.cache_dir: cannot write the token cache under {root} ({e.strerror})") from None
    try:
        _build(cfg, files, tmp, log, progress, tokenizer_file)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process (a second rank, a parallel run) finished the same cache first.
            if not (final / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"data: token cache written to {final}")
    return _open(final, cfg, reused=False)


def _mkdtemp(root: Path, key: str) -> str:
    """A folder to build in, named after this machine and process, so that a later build can tell
    a killed build's leftovers (gigabytes, for a large corpus) from one still under way."""
    import tempfile

    _clean_abandoned(root)
    return tempfile.mkdtemp(prefix=f".tmp-{key}-{socket.gethostname()}-{os.getpid()}-", dir=root)


def _clean_abandoned(root: Path) -> None:
    import psutil

    host = socket.gethostname()
    for p in root.glob(".tmp-*"):
        parts = p.name.split("-")  # ".tmp", key, host..., pid, random: a host name may hold "-"
        if len(parts) < 5 or "-".join(parts[2:-2]) != host or not parts[-2].isdigit():
            continue  # another machine's (a shared cache folder), or an older name: not ours to judge
        if not psutil.pid_exists(int(parts[-2])):
            shutil.rmtree(p, ignore_errors=True)


def _same_bytes(a: Path, b: Path) -> bool:
    return a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes()


def _build(cfg: Config, files: list[sources.SourceFile], out: Path, log, progress: ProgressFn,
           tokenizer_file: Path | None) -> None:
    t0 = time.time()
    progress("reading corpus", 0, len(files), "files")
    docs = list(sources.iter_documents(cfg.data, files))
    train_docs, val_docs = sources.split_documents(cfg.data, docs)
    n_bytes = sum(len(d.text) for d in train_docs) + sum(len(d.text) for d in val_docs)
    log(f"data: {len(train_docs)} train / {len(val_docs)} val documents, {n_bytes / 1e6:.1f} MB of text")

    tok_cfg = cfg.tokenizer
    if tokenizer_file is not None:
        from tokenizers import Tokenizer

        tok, tok_folder = Tokenizer.from_file(str(tokenizer_file)), tokenizer_file.parent
        log(f"data: tokenising with the run's own tokenizer ({tokenizer_file}): no token cache for this data "
            "was made with it (the source changed since the run started, or the cache was deleted)")
    elif tok_cfg.kind == "bpe":
        budget = min(tok_cfg.train_bytes or n_bytes, n_bytes)
        progress("training tokenizer", 0, budget, "bytes")
        tok, tok_folder = tokenizer.train_bpe((d.text for d in train_docs), tok_cfg), None
        log(f"data: trained a byte-level BPE of {tok.get_vocab_size()} tokens on "
            f"{budget / 1e6:.1f} MB in {time.time() - t0:.1f}s")
    else:
        tok, tok_folder = tokenizer.load_tokenizer(tok_cfg.kind, None), Path(tok_cfg.kind).expanduser()
    if tok.get_vocab_size() > tok_cfg.vocab_size:
        raise ConfigError(f"tokenizer.vocab_size = {tok_cfg.vocab_size} is smaller than the tokenizer's "
                          f"{tok.get_vocab_size()} tokens")
    eos_name = tokenizer.eos_token(tok, tok_folder)
    if eos_name is None:
        log(f"data: warning: tokenizer {tok_cfg.kind} has no end-of-text token (its tokenizer_config.json names "
            f"none, nor has it any of {', '.join(tokenizer.EOS_NAMES)}): documents are joined without one, "
            f"and sampling stops only at its length")
    tokenizer.save_hf_tokenizer(tok, out / "tokenizer", eos_name)

    eos = tokenizer.eos_id(tok, out / "tokenizer")
    dtype = token_dtype(tok_cfg.vocab_size)
    counts = {}
    done = 0
    for split, split_docs in (("train", train_docs), ("val", val_docs)):
        n = 0
        with open(out / f"{split}.bin", "wb") as fh:
            def tick(b: int) -> None:
                nonlocal done
                done += b
                progress("tokenizing", done, n_bytes, "bytes")
            for arr in tokenizer.encode_documents(tok, [d.text for d in split_docs], eos, tick):
                fh.write(arr.astype(dtype).tobytes())
                n += len(arr)
            fh.flush()
            os.fsync(fh.fileno())
        counts[split] = n
    meta = {"format": FORMAT_VERSION, "train_tokens": counts["train"], "val_tokens": counts["val"],
            "dtype": np.dtype(dtype).name, "vocab_size": tok_cfg.vocab_size, "eos_id": eos,
            "source": cfg.data.source, "bytes": n_bytes}
    # meta.json last: its presence is what marks a cache as complete.
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    log(f"data: {counts['train']:,} train and {counts['val']:,} val tokens "
        f"({n_bytes / max(1, counts['train'] + counts['val']):.2f} bytes/token) in {time.time() - t0:.1f}s")


def _open(folder: Path, cfg: Config, reused: bool) -> TokenData:
    meta = json.loads((folder / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    train = np.memmap(folder / "train.bin", dtype=dtype, mode="r")
    val = np.memmap(folder / "val.bin", dtype=dtype, mode="r")
    tok = tokenizer.load_tokenizer("bpe", folder / "tokenizer")
    need = cfg.training.seq_len + 1
    for split, arr in (("train", train), ("val", val)):
        if len(arr) < need:
            raise ConfigError(f"data.source = {cfg.data.source!r}: the {split} split has {len(arr)} tokens, "
                              f"fewer than one sequence of training.seq_len + 1 = {need}; give more text")
    return TokenData(folder, train, val, meta["vocab_size"],
                     tokenizer.token_byte_lengths(tok, meta["vocab_size"]), meta["eos_id"], reused)

"""Where training text comes from: the interpreter's standard library, text files, or JSONL.

A corpus is a list of documents, each with a stable id. Train/validation membership and the
`data.max_bytes` slice are decided by a hash of the id, so they are the same on every machine
and every rank, and a file's documents never straddle the split (no leakage between near-copies).
No torch here: the cache key is computed before anything heavy is imported.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..config import ConfigError, DataConfig

STDLIB = "python-stdlib"
CHUNK_BYTES = 64 * 1024  # a single big text file is cut into documents of about this size
TEXT_SUFFIXES_SKIPPED = {".pyc", ".so", ".png", ".jpg", ".gif", ".zip", ".gz", ".bin", ".exe", ".pdf"}


@dataclass(frozen=True)
class SourceFile:
    path: Path
    rel: str
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Document:
    id: str
    text: str


def _digest(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")


def _hash_fraction(doc_id: str) -> float:
    return _digest(doc_id) / 2**64


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(cfg: DataConfig) -> tuple[str, list[SourceFile]]:
    """(a canonical description of the source, its files with sizes and mtimes)."""
    if cfg.source == STDLIB:
        root = stdlib_root()
        files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()]
        desc = f"{STDLIB}:{root}"
    else:
        root = Path(cfg.source).expanduser().resolve()
        if not root.exists():
            raise ConfigError(f"data.source = {cfg.source!r}: no such file or folder")
        if root.is_dir():
            files = [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")
                     and p.suffix.lower() not in TEXT_SUFFIXES_SKIPPED]
        else:
            files = [root]
            root = root.parent
        desc = str(Path(cfg.source).expanduser().resolve())
    out = []
    for p in sorted(files):
        st = p.stat()
        out.append(SourceFile(p, str(p.relative_to(root)), st.st_size, st.st_mtime_ns))
    if not out or sum(f.size for f in out) == 0:
        raise ConfigError(f"data.source = {cfg.source!r}: no text found there (empty)")
    return desc, out


def _read_text(f: SourceFile) -> str:
    return f.path.read_bytes().decode("utf-8", errors="replace")


def _jsonl_documents(f: SourceFile, field: str) -> Iterator[Document]:
    with f.path.open(encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{f.path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise ConfigError(f"{f.path}:{lineno}: expected an object with a string field "
                                  f"{field!r} (data.text_field)")
            yield Document(f"{f.rel}#{lineno}", record[field])


def _chunks(f: SourceFile) -> Iterator[Document]:
    """Cut one text at line boundaries into documents of about CHUNK_BYTES."""
    text, start, n = _read_text(f), 0, 0
    while start < len(text):
        end = text.find("\n", start + CHUNK_BYTES)
        end = len(text) if end < 0 else end + 1
        yield Document(f"{f.rel}@{n}", text[start:end])
        start, n = end, n + 1


def iter_documents(cfg: DataConfig, files: list[SourceFile]) -> Iterator[Document]:
    """Every document of the source (before the max_bytes slice)."""
    single = len(files) == 1
    for f in files:
        if f.path.suffix == ".jsonl":
            yield from _jsonl_documents(f, cfg.text_field)
        elif single:
            yield from _chunks(f)
        else:
            yield Document(f.rel, _read_text(f))


def split_documents(cfg: DataConfig, docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """(train, val), in hash order, after the max_bytes slice; both sides hold at least one doc."""
    docs = sorted((d for d in docs if d.text), key=lambda d: _digest(d.id))
    if cfg.max_bytes:
        kept, total = [], 0
        for d in docs:
            if total >= cfg.max_bytes:
                break
            kept.append(d)
            total += len(d.text)
        docs = kept
    if len(docs) < 2:
        raise ConfigError(f"data.source = {cfg.source!r}: found {len(docs)} document(s); need at least "
                          "two (one to train on, one to validate on)")
    val = [d for d in docs if _hash_fraction(d.id) < cfg.val_fraction]
    if not val:
        val = [min(docs, key=lambda d: _hash_fraction(d.id))]
    val_ids = {d.id for d in val}
    train = [d for d in docs if d.id not in val_ids]
    if not train:
        train, val = val[1:], val[:1]
    return train, val

"""The token cache: its key, its folder, and reading it back as one token stream per split.

The key covers the source (every file's size and mtime), the split, selection and shard
settings, the tokenizer settings (or a run's own tokenizer file), the token dtype and this
format's version: change any and a new cache is built; change none and a second run (or every
rank of a multi-GPU run) reuses it. prepare.py builds it.

A cache folder (format 2): `meta.json` (written last: its presence marks the cache complete),
`tokenizer/` (a transformers fast tokenizer), and per shard `shards/NNNNN.train.bin` and
`NNNNN.val.bin`, raw little-endian uint16 or uint32 tokens, documents separated by the end-of-text
token. A format-1 cache (one `train.bin` and `val.bin`, written by lmcockpit before shards) is
still found under its old key and read.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import Config, ConfigError
from . import tokenizer
from .sources import Source
from .store import cache_root  # noqa: F401 - the cache's folder, for the engine's callers

FORMAT_VERSION = 2
LEGACY_FORMAT = 1
LEGACY_SKIPPED = {".pyc", ".so", ".png", ".jpg", ".gif", ".zip", ".gz", ".bin", ".exe", ".pdf"}


class TokenStream:
    """Shards read as one array by memory map: `len`, and slices that may span shards (a
    training window across two shards is read from both)."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = [a for a in arrays if len(a)]
        self.starts = np.cumsum([0] + [len(a) for a in self.arrays])
        self.dtype = self.arrays[0].dtype if self.arrays else np.dtype(np.uint16)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(len(self))
        assert step == 1, "token streams are read in windows"
        if stop <= start:
            return np.empty(0, dtype=self.dtype)
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts = []
        while start < stop:
            a, offset = self.arrays[first], int(self.starts[first])
            end = min(stop, offset + len(a))
            parts.append(a[start - offset:end - offset])
            start, first = end, first + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[0:len(self)]
        return out if dtype is None else out.astype(dtype)


@dataclass
class TokenData:
    dir: Path
    train: TokenStream | np.ndarray
    val: TokenStream | np.ndarray
    vocab_size: int
    token_bytes: np.ndarray
    eos_id: int | None
    reused: bool

    @property
    def tokenizer_dir(self) -> Path:
        return self.dir / "tokenizer"


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _tokenizer_material(cfg: Config, tokenizer_file: Path | None) -> dict:
    t = cfg.tokenizer
    if tokenizer_file is not None:
        return {"tokenizer": ["file", hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()]}
    material: dict = {"tokenizer": [t.kind, t.vocab_size, t.train_bytes]}
    if t.kind != "bpe":  # a pretrained tokenizer's files decide the tokens as much as its path does
        folder = Path(t.kind).expanduser()
        material["tokenizer_files"] = [(f.name, f.stat().st_size, f.stat().st_mtime_ns)
                                       for f in (folder / "tokenizer.json", folder / "tokenizer_config.json")
                                       if f.is_file()]
    return material


def _digest(material: dict) -> str:
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]


def cache_key(cfg: Config, source: Source, tokenizer_file: Path | None = None) -> str:
    """What decides the tokens, hashed: the source's files, the split and selection, the shards,
    and the tokenizer (its settings, or with `tokenizer_file` that very file's contents)."""
    d = cfg.data
    return _digest({
        "format": FORMAT_VERSION, "source": source.desc,
        "files": [(f.rel, f.size, f.mtime_ns) for f in source.files],
        "text_field": d.text_field, "val_fraction": d.val_fraction, "max_bytes": d.max_bytes,
        "shard_bytes": d.shard_bytes, "dtype": np.dtype(token_dtype(cfg.tokenizer.vocab_size)).name,
        **_tokenizer_material(cfg, tokenizer_file)})


def legacy_key(cfg: Config, source: Source, tokenizer_file: Path | None = None) -> str:
    """The key a format-1 cache of the same source was stored under (files listed as format 1 did)."""
    d = cfg.data
    return _digest({
        "format": LEGACY_FORMAT, "source": source.desc,
        "files": [(f.rel, f.size, f.mtime_ns) for f in source.files
                  if Path(f.rel).suffix.lower() not in LEGACY_SKIPPED],
        "text_field": d.text_field, "val_fraction": d.val_fraction, "max_bytes": d.max_bytes,
        "dtype": np.dtype(token_dtype(cfg.tokenizer.vocab_size)).name,
        **_tokenizer_material(cfg, tokenizer_file)})


def read_meta(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def open_cache(folder: Path, cfg: Config, reused: bool) -> TokenData:
    meta = read_meta(folder)
    if meta is None or meta.get("format") not in (LEGACY_FORMAT, FORMAT_VERSION):
        raise ConfigError(f"{folder}: not a token cache this version reads (remove it: `lmcockpit data rm "
                          f"{folder.name}`)")
    dtype = np.dtype(meta["dtype"])
    if meta["format"] == LEGACY_FORMAT:
        train, val = (np.memmap(folder / f"{split}.bin", dtype=dtype, mode="r") for split in ("train", "val"))
    else:
        train, val = (TokenStream([np.memmap(folder / "shards" / f"{s['name']}.{split}.bin", dtype=dtype, mode="r")
                                   for s in meta["shards"] if s[f"{split}_tokens"]])
                      for split in ("train", "val"))
    tok = tokenizer.load_tokenizer("bpe", folder / "tokenizer")
    need = cfg.training.seq_len + 1
    for split, arr in (("train", train), ("val", val)):
        if len(arr) < need:
            raise ConfigError(f"data.source = {cfg.data.source!r}: the {split} split has {len(arr)} tokens, "
                              f"fewer than one sequence of training.seq_len + 1 = {need}; give more text")
    return TokenData(folder, train, val, meta["vocab_size"],
                     tokenizer.token_byte_lengths(tok, meta["vocab_size"]), meta["eos_id"], reused)

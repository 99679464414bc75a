"""A token cache read back: one token stream per split, by memory map.

store.py says where a cache is and what its key covers; prepare.py builds it.

A cache folder (format 2): `meta.json` (written last: its presence marks the cache complete),
`tokenizer/` (a transformers fast tokenizer), and per shard `shards/NNNNN.train.bin` and
`NNNNN.val.bin`, raw little-endian uint16 or uint32 tokens, documents separated by the end-of-text
token. A format-1 cache (one `train.bin` and `val.bin`, written by lmcockpit before shards) is
still found under its old key and read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import Config, ConfigError
from . import tokenizer
from .store import FORMAT_VERSION, LEGACY_FORMAT, dtype_name, read_meta

OPEN_SHARDS = 128  # shard files mapped at once in a process (each map holds a file descriptor)


@functools.lru_cache(maxsize=OPEN_SHARDS)
def _mapped(path: str, dtype: str) -> np.memmap:
    return np.memmap(path, dtype=np.dtype(dtype), mode="r")


class Shard:
    """One shard file, mapped when read. A mapping keeps a descriptor open, and a 45 GB corpus has
    thousands of shards: mapping them all at once passes the usual limit of 1,024 open files. The
    OPEN_SHARDS most recently read stay mapped; a slice of one keeps its mapping alive."""

    def __init__(self, path: Path, length: int, dtype: np.dtype):
        self.path, self.length, self.dtype = str(path), length, np.dtype(dtype)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: slice) -> np.ndarray:
        return _mapped(self.path, self.dtype.str)[index]


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
    return np.dtype(dtype_name(vocab_size))


def open_cache(folder: Path, cfg: Config, reused: bool) -> TokenData:
    meta = read_meta(folder)
    if meta is None or meta.get("format") not in (LEGACY_FORMAT, FORMAT_VERSION):
        raise ConfigError(f"{folder}: not a token cache this version reads (remove it: `lmcockpit data rm "
                          f"{folder.name}`)")
    dtype = np.dtype(meta["dtype"])
    if meta["format"] == LEGACY_FORMAT:
        train, val = (np.memmap(folder / f"{split}.bin", dtype=dtype, mode="r") for split in ("train", "val"))
    else:
        train, val = (TokenStream([Shard(folder / "shards" / f"{s['name']}.{split}.bin", s[f"{split}_tokens"], dtype)
                                   for s in meta["shards"] if s[f"{split}_tokens"]])
                      for split in ("train", "val"))
        for shard in (*train.arrays, *val.arrays):
            size = Path(shard.path).stat().st_size if Path(shard.path).is_file() else -1
            if size != len(shard) * dtype.itemsize:
                raise ConfigError(f"{shard.path}: {'missing' if size < 0 else f'{size} bytes'}, expected "
                                  f"{len(shard) * dtype.itemsize} ({len(shard)} tokens); the cache is damaged: "
                                  f"`lmcockpit data rm {folder.name}` and prepare it again")
    tok = tokenizer.load_tokenizer("bpe", folder / "tokenizer")
    need = cfg.training.seq_len + 1
    for split, arr in (("train", train), ("val", val)):
        if len(arr) < need:
            raise ConfigError(f"data.source = {cfg.data.source!r}: the {split} split has {len(arr)} tokens, "
                              f"fewer than one sequence of training.seq_len + 1 = {need}; give more text")
    return TokenData(folder, train, val, meta["vocab_size"],
                     tokenizer.token_byte_lengths(tok, meta["vocab_size"]), meta["eos_id"], reused)

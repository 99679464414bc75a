"""Conversations packed into rows of training.seq_len + 1 tokens with loss masks: the packing, their cache folder, batches.

Packing (`Packer`): best fit, as nanochat's chat_sft packs, over a window of OPEN_ROWS rows being
filled: each conversation (chat_template.render: its start token first) goes into the open row it
leaves the least room in, else a new row; when OPEN_ROWS are open, the fullest is closed first.
Every row so starts with a conversation's start token, and the room a row's last conversation
leaves is filled with start tokens masked out. A conversation never spans two rows: one longer than
a row is truncated to the row (its start kept, as nanochat keeps it), or dropped where none of its
assistant's tokens is left in the row; both are counted and said. Attention spans a row's
conversations, as in pretraining's rows; the loss does not: a conversation's first token (its start)
is masked out, so no conversation's end is trained to predict the next one.

The cache (`prepare_chat`): under the token caches' root (store.py), a folder `chat-KEY` holding per
side `train.ids.bin`, `train.mask.bin`, `val.ids.bin`, `val.mask.bin` (rows one after another:
ids as the token caches store them, the mask one byte a token) and `meta.json` with the counts. The
key covers the source's files (sizes and mtimes), data.val_fraction, the row length and the
tokenizer's very bytes. It is built in a temporary folder under the key's lock and renamed whole;
not resumable: a conversation set is read once through, in seconds to minutes, and a killed build
starts again.

Batches (`ChatRows.batch`): rows drawn with replacement as a function of (seed, g), as batches.py
draws windows; targets are -1 (IGNORE, cross-entropy's ignore_index) where the mask is 0.
Torch: never.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..config import Config, ConfigError
from ..run.safe_files import current_umask, write_whole
from . import chat_template, conversations
from .prepare import building, make_root
from .store import BUILD_PREFIX, cache_root, dtype_name, read_meta

IGNORE = -1  # a target the loss skips
OPEN_ROWS = 64  # rows being filled at once: the best fit looks among them
RENDER_BATCH = 512  # conversations encoded at once
FORMAT = "chat-1"
PREFIX = "chat-"
SIDES = ("train", "val")


@dataclass
class Counts:
    conversations: int = 0
    truncated: int = 0  # longer than a row: cut to it
    dropped: int = 0  # longer than a row, with no assistant token within it
    rows: int = 0
    tokens: int = 0  # conversations' tokens in the rows (padding not counted)
    trained: int = 0  # of those, the tokens the loss is on (mask 1)


@dataclass
class Packer:
    """Best-fit packing of rendered conversations into rows of `row_len` tokens, `pad` filling."""
    row_len: int
    pad: int
    open_rows: int = OPEN_ROWS
    counts: Counts = field(default_factory=Counts)
    open: list[tuple[list[int], list[int]]] = field(default_factory=list)

    def add(self, ids: list[int], mask: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """The conversation placed; the rows that closed, in order."""
        self.counts.conversations += 1
        if len(ids) > self.row_len:
            ids, mask = ids[:self.row_len], mask[:self.row_len]
            if not any(mask):
                self.counts.dropped += 1
                return []
            self.counts.truncated += 1
        closed = []
        room = [(self.row_len - len(row_ids), i) for i, (row_ids, _) in enumerate(self.open)]
        fits = [(left, i) for left, i in room if left >= len(ids)]
        if fits:
            row = self.open[min(fits)[1]]
        else:
            if len(self.open) >= self.open_rows:
                closed.append(self._close(self.open.pop(min(room)[1])))  # the fullest: the least room left
            row = ([], [])
            self.open.append(row)
        row[0].extend(ids)
        row[1].extend(mask)
        self.counts.tokens += len(ids)
        self.counts.trained += sum(mask)
        if len(row[0]) == self.row_len:
            self.open.remove(row)
            closed.append(self._close(row))
        return closed

    def finish(self) -> list[tuple[np.ndarray, np.ndarray]]:
        rows = [self._close(row) for row in self.open]
        self.open = []
        return rows

    def _close(self, row: tuple[list[int], list[int]]) -> tuple[np.ndarray, np.ndarray]:
        ids, mask = row
        gap = self.row_len - len(ids)
        self.counts.rows += 1
        return (np.asarray(ids + [self.pad] * gap, dtype=np.int64),
                np.asarray(mask + [0] * gap, dtype=np.uint8))


class ChatRows:
    """One side's rows, (rows, row_len) ids and masks; batches of (inputs, targets) from them."""

    def __init__(self, ids: np.ndarray, mask: np.ndarray):
        self.ids, self.mask = ids, mask

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def tokens(self) -> int:
        """The positions its rows train on (each row's inputs), as a token stream's length counts them."""
        return len(self.ids) * (self.ids.shape[1] - 1)

    def at(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) of these rows, each (len(rows), row_len - 1) int64; targets IGNORE where masked out."""
        ids = np.asarray(self.ids[rows], dtype=np.int64)
        targets = ids[:, 1:].copy()
        targets[np.asarray(self.mask[rows])[:, 1:] == 0] = IGNORE
        return ids[:, :-1], targets

    def batch(self, seed: int, g: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch g (batches.global_index's numbering): rows drawn with replacement by (seed, g) alone."""
        return self.at(np.random.default_rng([seed, g]).integers(0, len(self), size=batch_size))

    def eval_rows(self, n_batches: int, batch_size: int) -> np.ndarray:
        """Rows for evaluation, (n_batches, batch_size): a fixed spread, the same every time."""
        n = n_batches * batch_size
        return np.linspace(0, len(self) - 1, num=n).astype(np.int64).reshape(n_batches, batch_size)


@dataclass
class ChatData:
    dir: Path
    train: ChatRows
    val: ChatRows
    vocab_size: int  # the tokenizer's, its turn tokens included
    start_id: int
    counts: dict[str, dict]  # per side, Counts as a dict
    reused: bool


def chat_key(cfg: Config, tokenizer_file: Path) -> str:
    """What decides the rows: the conversations' files, the split, the row length, the tokenizer."""
    listed = conversations.list_conversations(cfg.data.source)
    material = {"format": FORMAT, "source": listed.desc, "files": [(f.rel, f.size, f.mtime_ns) for f in listed.files],
                "val_fraction": cfg.data.val_fraction, "row_len": cfg.training.seq_len + 1,
                "tokenizer": hashlib.sha256(tokenizer_file.read_bytes()).hexdigest(), "template": chat_template.JINJA}
    return PREFIX + hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]


def prepare_chat(cfg: Config, tokenizer_file: Path, log: Callable[[str], None]) -> ChatData:
    """The packed rows of `cfg`'s conversations (data.source) by `tokenizer_file`, which holds the
    turn tokens: found, or built under the key's lock."""
    root = cache_root(cfg)
    key = chat_key(cfg, tokenizer_file)
    folder = root / key
    reused = read_meta(folder) is not None
    if not reused:
        make_root(root)
        with building(root, key, log):
            if read_meta(folder) is None:  # not built by another process while this one waited
                _build(cfg, tokenizer_file, folder, log)
    data = open_chat(folder, cfg.training.seq_len, reused)
    log(("data: reusing conversation rows " if reused else "data: conversation rows written to ") + str(folder))
    log(said(data.counts))
    return data


def said(counts: dict[str, dict]) -> str:
    """The counts as a run says them."""
    c = {key: sum(counts[side][key] for side in SIDES) for key in asdict(Counts())}
    return (f"data: {c['conversations']:,} conversations ({counts['train']['conversations']:,} train, "
            f"{counts['val']['conversations']:,} val) in {c['rows']:,} rows; {c['truncated']:,} truncated and "
            f"{c['dropped']:,} dropped (longer than a row); {c['trained']:,} of {c['tokens']:,} tokens trained on "
            "(the assistant's)")


def _build(cfg: Config, tokenizer_file: Path, folder: Path, log) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    start = chat_template.chat_ids(tok).start
    dtype = dtype_name(tok.get_vocab_size())
    for left in folder.parent.glob(f"{BUILD_PREFIX}{folder.name}-*"):  # a killed build's: under the lock, no live one's
        if left.is_dir() and not left.is_symlink():
            shutil.rmtree(left, ignore_errors=True)
    # A fresh folder (mkdtemp: no name a link could be planted at), renamed whole when done.
    work = Path(tempfile.mkdtemp(prefix=f"{BUILD_PREFIX}{folder.name}-", dir=folder.parent))
    os.chmod(work, 0o777 & ~current_umask())
    try:
        packers = {side: Packer(cfg.training.seq_len + 1, start) for side in SIDES}
        files = {(side, part): open(work / f"{side}.{part}.bin", "wb") for side in SIDES for part in ("ids", "mask")}
        try:
            _pack(cfg, tok, packers, files, dtype)
            for fh in files.values():
                fh.flush()
                os.fsync(fh.fileno())
        finally:
            for fh in files.values():
                fh.close()
        counts = {side: asdict(packers[side].counts) for side in SIDES}
        meta = {"format": FORMAT, "kind": "conversations", "source": cfg.data.source, "dtype": dtype,
                "vocab_size": tok.get_vocab_size(), "start_id": start, "row_len": cfg.training.seq_len + 1,
                "train_tokens": counts["train"]["tokens"], "val_tokens": counts["val"]["tokens"], "counts": counts}
        write_whole(work / "meta.json", json.dumps(meta, indent=1), fsync=True)  # last: the folder is whole
        os.rename(work, folder)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _pack(cfg: Config, tok, packers: dict[str, Packer], files: dict, dtype: str) -> None:
    """Every conversation read, rendered a batch at a time, packed, its rows written as they close."""
    pending: dict[str, list[list[dict]]] = {side: [] for side in SIDES}

    def write(side: str, rows: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for ids, mask in rows:
            files[side, "ids"].write(ids.astype(dtype).tobytes())
            files[side, "mask"].write(mask.tobytes())

    def flush(side: str) -> None:
        for ids, mask in chat_template.render_many(pending[side], tok):
            write(side, packers[side].add(ids, mask))
        pending[side] = []

    for side, conv in conversations.read_split(cfg.data.source, cfg.data.val_fraction):
        pending[side].append(conv.messages)
        if len(pending[side]) >= RENDER_BATCH:
            flush(side)
    for side in SIDES:
        flush(side)
        write(side, packers[side].finish())


def open_chat(folder: Path, seq_len: int, reused: bool = True) -> ChatData:
    meta = read_meta(folder)
    if meta is None or meta.get("format") != FORMAT:
        raise ConfigError(f"{folder}: not a conversation cache this version reads (remove it: `lmcockpit data rm "
                          f"{folder.name}`)")
    row_len = meta["row_len"]
    if row_len != seq_len + 1:
        raise ConfigError(f"{folder}: rows of {row_len} tokens, not training.seq_len + 1 = {seq_len + 1}")
    sides = {}
    for side in SIDES:
        rows = meta["counts"][side]["rows"]
        if rows == 0:
            c = meta["counts"][side]
            raise ConfigError(f"data.source = {meta['source']!r}: no row of conversations on the {side} side "
                              f"({c['conversations']} conversations there, {c['dropped']} of them dropped as longer "
                              "than a row); give more conversations" +
                              (", or raise data.val_fraction" if side == "val" else ""))
        ids = np.memmap(folder / f"{side}.ids.bin", dtype=np.dtype(meta["dtype"]), mode="r", shape=(rows, row_len))
        mask = np.memmap(folder / f"{side}.mask.bin", dtype=np.uint8, mode="r", shape=(rows, row_len))
        sides[side] = ChatRows(ids, mask)
    return ChatData(folder, sides["train"], sides["val"], meta["vocab_size"], meta["start_id"], meta["counts"],
                    reused)

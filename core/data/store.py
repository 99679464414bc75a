"""Token caches on disk, without numpy or tokenizers: where they live, their keys, listing and removing.

They live under `$XDG_CACHE_HOME/lmcockpit` (or `data.cache_dir`); a config's cache has a key
there; a cache is complete, or a build a kill left to resume. The front-end reads it (`lmcockpit data info/rm`,
the token budget on the launch screen and in `presets`, the doctor's free-disk line).

The key covers the source (every file's size and mtime), the split, selection and shard
settings, the tokenizer settings (or a run's own tokenizer file), the token dtype and the
format's version: change any and a new cache is built; change none and a second run (or every
rank of a multi-GPU run) reuses it.

A trained BPE's settings include the special tokens it reserves (chat_template.RESERVED), so a key
names one kind of BPE only. A cache (or a mixture's BPE) made before BPEs reserved the chat
template's turn tokens keeps its folder under the key it had (`pre_chat_key`), and is still found
where none was made under the new one, as a format-1 cache is: a corpus is not tokenised again for
four tokens its pretraining never reads; fine-tuning to chat adds them (tokenizer.add_chat_tokens)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import Config, ConfigError, shown
from ..run.safe_files import cache_home
from . import pretrained
from .chat_template import RESERVED
from .sources import Source

FORMAT_VERSION = 2
LEGACY_FORMAT = 1
LEGACY_SKIPPED = {".pyc", ".so", ".png", ".jpg", ".gif", ".zip", ".gz", ".bin", ".exe", ".pdf"}
BUILD_PREFIX = ".build-"  # a build under way, or one a kill left behind: the next prepare resumes it


def cache_root(cfg: Config) -> Path:
    if cfg.data.cache_dir:
        return Path(cfg.data.cache_dir).expanduser()
    return cache_home()


def dtype_name(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _tokenizer_material(cfg: Config, tokenizer_file: Path | None, pre_chat: bool = False) -> dict:
    t = cfg.tokenizer
    if tokenizer_file is not None:
        return {"tokenizer": ["file", hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()]}
    material: dict = {"tokenizer": [t.kind, t.vocab_size, t.train_bytes]}
    if t.kind == "bpe" and not pre_chat:  # what it reserves decides its merges and ids
        material["reserved"] = list(RESERVED)
    if t.kind != "bpe":  # a pretrained tokenizer's files decide the tokens as much as its name does
        material |= pretrained.material(t.kind)
    return material


def _digest(material: dict) -> str:
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]


def cache_key(cfg: Config, source: Source, tokenizer_file: Path | None = None, pre_chat: bool = False) -> str:
    """What decides the tokens, hashed: the source's files, the split and selection, the shards,
    and the tokenizer (its settings, or with `tokenizer_file` that very file's contents); with
    `pre_chat`, the key a BPE cache had before BPEs reserved the chat template's tokens."""
    d = cfg.data
    return _digest({
        "format": FORMAT_VERSION, "source": source.desc,
        "files": [(f.rel, f.size, f.mtime_ns) for f in source.files],
        "text_field": d.text_field, "val_fraction": d.val_fraction, "max_bytes": d.max_bytes,
        "shard_bytes": d.shard_bytes, "dtype": dtype_name(cfg.tokenizer.vocab_size),
        **_tokenizer_material(cfg, tokenizer_file, pre_chat)})


def pre_chat_key(cfg: Config, source: Source) -> str:
    """The key a cache of the same settings was stored under before BPEs reserved the turn tokens."""
    return cache_key(cfg, source, pre_chat=True)


def legacy_key(cfg: Config, source: Source, tokenizer_file: Path | None = None) -> str:
    """The key a format-1 cache of the same source was stored under (files listed as format 1 did)."""
    d = cfg.data
    return _digest({
        "format": LEGACY_FORMAT, "source": source.desc,
        "files": [(f.rel, f.size, f.mtime_ns) for f in source.files
                  if _suffix(f.rel).lower() not in LEGACY_SKIPPED],
        "text_field": d.text_field, "val_fraction": d.val_fraction, "max_bytes": d.max_bytes,
        "dtype": dtype_name(cfg.tokenizer.vocab_size),
        **_tokenizer_material(cfg, tokenizer_file)})


def _suffix(rel: str) -> str:
    """`Path(rel).suffix`, without building a Path: a source of 100k files made that most of the
    launch screen's wait for its token count, on every change of preset or setting."""
    name = rel.rpartition("/")[2]
    dot = name.rfind(".")
    return name[dot:] if 0 < dot < len(name) - 1 else ""


def mixture_tokenizer_key(cfg: Config, listed: list[Source], pre_chat: bool = False) -> str:
    """The key of the BPE a mixture's parts share (a folder beside the caches): every part's
    files and weight, and the tokenizer settings. `listed`: each part's source, in order."""
    return "tokenizer-" + cache_key(cfg, Source(
        "mixture:" + ";".join(f"{s.desc}*{part.weight}" for s, part in zip(listed, cfg.data.sources)),
        [f for s in listed for f in s.files], False), pre_chat=pre_chat)


def mixture_tokenizer_folder(cfg: Config, listed: list[Source]) -> Path:
    """Where the BPE a mixture's parts share is: under its key, or, where none was trained there,
    one trained under its pre-chat key (the parts' caches were tokenised with it)."""
    root = cache_root(cfg)
    new, old = (root / mixture_tokenizer_key(cfg, listed, pre_chat) for pre_chat in (False, True))
    return old if not (new / "tokenizer.json").is_file() and (old / "tokenizer.json").is_file() else new


def find_cache(cfg: Config, source: Source, tokenizer_file: Path | None = None) -> Path | None:
    """The complete cache that serves `cfg`'s data from `source`, or None. With `tokenizer_file`
    (a resumed run's own, a mixture's shared one) only a cache made with that very tokenizer
    serves: its ids are the only ones the model knows."""
    root = cache_root(cfg)
    for key in (make(cfg, source) for make in (cache_key, pre_chat_key, legacy_key)):  # the older only if needed
        if read_meta(root / key) is not None and (
                tokenizer_file is None or _same_bytes(root / key / "tokenizer" / "tokenizer.json", tokenizer_file)):
            return root / key
    if tokenizer_file is not None and read_meta(root / (key := cache_key(cfg, source, tokenizer_file))) is not None:
        return root / key  # that tokenizer made this cache before
    return None


def _same_bytes(a: Path, b: Path) -> bool:
    return a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes()


def read_meta(folder: Path) -> dict | None:
    """A complete cache's meta.json (written last), or None."""
    meta = _json(folder / "meta.json")
    return meta or None


def lock_path(root: Path, key: str) -> Path:
    return root / f"{BUILD_PREFIX}{key}.lock"


def open_lock(root: Path, key: str):
    """The lock file of `key`'s cache, open for flock (made if missing, never truncated). Never
    through a link: in a cache folder others can write, a link planted at this guessable name would
    have lmcockpit create the file it points to; nor a FIFO, whose open would block."""
    path = lock_path(root, key)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        why = "a symbolic link where the lock belongs: refused, remove it" if e.errno == errno.ELOOP else e.strerror
        raise ConfigError(f"{path}: cannot take the lock of token cache {key} ({why})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"{path}: cannot take the lock of token cache {key} (not a regular file: refused, remove it)")
    return os.fdopen(fd, "wb")


@dataclass(frozen=True)
class CacheInfo:
    key: str
    folder: Path
    complete: bool
    source: str
    vocab_size: int | None
    train_tokens: int | None
    val_tokens: int | None
    size: int  # bytes on disk
    modified: float  # seconds since the epoch
    pieces_done: int = 0
    pieces: int = 0
    link: str = ""  # where the folder's name points, if it is a symbolic link (a cache kept on another disk)

    @property
    def state(self) -> str:
        return "complete" if self.complete else f"partial ({self.pieces_done}/{self.pieces} pieces)"


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: arrays nested hundreds deep
        return {}
    return value if isinstance(value, dict) else {}


def list_caches(root: Path) -> list[CacheInfo]:
    """Every cache under `root`, newest first."""
    out = []
    for folder in root.iterdir() if root.is_dir() else ():
        if not folder.is_dir():
            continue
        link = os.readlink(folder) if folder.is_symlink() else ""
        if folder.name.startswith(BUILD_PREFIX):
            plan = _json(folder / "plan.json")
            out.append(CacheInfo(folder.name[len(BUILD_PREFIX):], folder, False, str(plan.get("source", "?")),
                                 plan.get("vocab_size"), None, None, _size(folder), folder.stat().st_mtime,
                                 len(list((folder / "pieces").glob("*.json"))), plan.get("pieces", 0), link))
        elif (meta := read_meta(folder)):
            out.append(CacheInfo(folder.name, folder, True, str(meta.get("source", "?")), meta.get("vocab_size"),
                                 meta.get("train_tokens"), meta.get("val_tokens"), _size(folder),
                                 (folder / "meta.json").stat().st_mtime, link=link))
    return sorted(out, key=lambda c: -c.modified)


def remove(root: Path, key: str) -> CacheInfo:
    """Remove the cache `key` (a unique prefix will do); a ConfigError if there is none, or if a
    process is building it right now."""
    found = [c for c in list_caches(root) if c.key.startswith(key)] if key else []
    if len(found) != 1:
        known = ", ".join(c.key for c in list_caches(root)) or "none"
        what = "no token cache" if not found else f"{len(found)} token caches"
        raise ConfigError(f"{shown(key)}: {what} under {root} has that key (there: {known})")
    cache = found[0]
    with open_lock(root, cache.key) as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # the builder's lock: left to it
            raise ConfigError(f"{cache.key}: a process is preparing this token cache right now; "
                              "stop it first") from None
        try:
            _remove_folder(cache)
        finally:  # held by this process alone: no lock is left behind, whether the folder went or not
            lock_path(root, cache.key).unlink(missing_ok=True)
    return cache


def _remove_folder(cache: CacheInfo) -> None:
    """The cache's folder; of a link, the link alone: what it points to may be anything at all (a
    cache on another disk, or a folder someone else's link names), and is not lmcockpit's to delete."""
    try:
        if cache.folder.is_symlink():
            cache.folder.unlink()
        else:
            shutil.rmtree(cache.folder)  # never follows a link inside, nor removes the folder if it became one
    except OSError as e:
        raise ConfigError(f"{cache.folder}: cannot remove this token cache ({e.strerror or e})") from None


def age(seconds_since: float) -> str:
    s = max(0, time.time() - seconds_since)
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.0f} {unit}"
    return f"{s:.0f} s"

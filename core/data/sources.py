"""Where training text comes from, and how it is cut into pieces of work.

A source is the interpreter's standard library (`python-stdlib`), a file, or a folder read
recursively with mixed formats: text; JSON lines (`.jsonl`, `.json`, `.ndjson`), also compressed
(`.gz`, `.zst`, `.xz`, `.bz2`); Parquet (`.parquet`, by row group); and folders written by
`datasets.Dataset.save_to_disk` (their Arrow files; of a DatasetDict's, its train split's).
`hf:OWNER/NAME[/PATH]` is a Hub dataset, fetched first (hub.py) and then read as a local folder.
Archives and compressions it cannot read are refused by name, wherever they are; known binary files
are skipped in a folder and refused as the source.

The files are listed with sizes and mtimes (the cache key) and planned into pieces of about
`data.shard_bytes` of selected text each: several small files, one byte range of a large text or
JSONL file (of a compressed one, a range of its decompressed text), one Parquet row group, or one
small compressed file or Arrow file. A piece is the unit of parallel work, one shard of the cache
and the unit a killed build resumes from. The plan is a function of the files and the settings
alone, so every machine and worker count makes the same one.
No torch, no numpy: readers.py does the reading.
"""

from __future__ import annotations

import json
import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..config import ConfigError, DataConfig
from .formats import (ARCHIVES, COMPRESSIONS, JSON_SUFFIXES, READ_FORMATS, SKIPPED_SUFFIXES, TEXT_SUFFIXES,
                      UNREAD_COMPRESSIONS)

STDLIB = "python-stdlib"
# A compressed file's text is known only by an estimate (readers.text_bytes: the ratio of its first
# 8 MB) until it is read: one of more than SPLIT_AT pieces is planned with SLACK times the pieces
# (past its end they are empty, and its last piece reads to its end), so that text the estimate
# missed is not left to one worker. bench/slack.py: a dump whose first records compress worse than
# the rest held 1.37 times its estimate, and at 1.25 its last piece was 6.2 pieces' worth; the
# empty pieces of an exact estimate cost no measurable time.
SPLIT_AT = 2
SLACK = 2.0
NOT_FETCHED = "not fetched yet"  # a Hub source with nothing of it in the Hub's cache
SAVE_TO_DISK_FILES = {"state.json", "dataset_info.json"}  # a save_to_disk folder's metadata, not data
DATASET_DICT = "dataset_dict.json"  # DatasetDict.save_to_disk's: {"splits": [...]}, a save_to_disk folder each


@dataclass(frozen=True)
class SourceFile:
    path: Path
    rel: str
    size: int
    mtime_ns: int
    kind: str  # "text", "jsonl", "parquet" or "arrow"
    compression: str = ""  # "", "gzip", "zstd", "xz" or "bzip2"


@dataclass(frozen=True)
class Piece:
    """A unit of work: whole files, a byte range [start, end) of one file, or one Parquet row group."""
    index: int
    files: tuple[SourceFile, ...]
    start: int = 0
    end: int = -1  # -1: to the end of the file
    row_group: int = -1
    chunked: bool = False  # text cut at line boundaries into ~CHUNK_BYTES documents (readers.py)


@dataclass(frozen=True)
class Source:
    desc: str  # canonical: the cache key holds it
    files: list[SourceFile]
    single_text_file: bool  # a lone text file is always cut into documents
    skipped: tuple[str, ...] = ()  # what in a folder was no document (a link that loops), each with why


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[Path]:
    """The standard library's .py files under `root`, not what is installed into its site-packages.
    Listed on every start of a run to find its token cache, so os.walk, which leaves site-packages
    and __pycache__ unvisited: Path.rglob walked them all, 13,000 paths in 0.5 s on a 2-core VM.
    Like rglob it does not follow links to folders."""
    out = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "__pycache__")]
        out += [p for name in names if name.endswith(".py") and (p := Path(folder, name)).is_file()]
    return out


def file_kind(path: Path, alone: bool = True) -> tuple[str, str] | None:
    """(kind, compression) by the file's suffixes; None for what is skipped (a known binary file,
    something compressed that is neither text nor JSON, an archive in a folder); a ConfigError
    naming a compression this does not read, or an archive given `alone` as the source.

    An archive in a folder is skipped, not refused: downloads such as wikitext keep their .zip
    beside the files unpacked from it, and those files are the data."""
    suffixes = [s.lower() for s in path.suffixes]
    last = suffixes[-1] if suffixes else ""
    if last in UNREAD_COMPRESSIONS:
        raise ConfigError(f"{path}: {UNREAD_COMPRESSIONS[last]}-compressed, which lmcockpit does not read: "
                          f"decompress it, or recompress it as .gz, .zst, .xz or .bz2 (it reads {READ_FORMATS})")
    compression = COMPRESSIONS.get(last, "")
    inner = suffixes[-2] if compression and len(suffixes) > 1 else last
    if inner in ARCHIVES:
        if not alone:
            return None
        raise ConfigError(f"{path}: a {ARCHIVES[inner]} archive, which lmcockpit does not read: unpack it and "
                          f"set data.source to what it holds (it reads {READ_FORMATS})")
    if compression and inner not in JSON_SUFFIXES and inner not in TEXT_SUFFIXES:
        return None  # compressed something else (.bin.gz, .npy.xz)
    if inner in JSON_SUFFIXES:
        return "jsonl", compression
    if inner == ".parquet" and not compression:
        return "parquet", ""
    if inner == ".arrow" and not compression:
        return "arrow", ""
    if inner in SKIPPED_SUFFIXES:
        return None
    return "text", compression


def _is_save_to_disk(folder: Path) -> bool:
    return (folder / "state.json").is_file() and any(folder.glob("*.arrow"))


def _train_split(folder: Path) -> Path:
    """A DatasetDict's folder of its train split: its other splits are the dataset's held-out text
    (the build holds out its own validation documents)."""
    try:
        splits = json.loads((folder / DATASET_DICT).read_text()).get("splits")
    except (OSError, ValueError, AttributeError, RecursionError):  # unreadable: the folders say
        splits = None
    if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
        splits = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if "train" in splits and _is_save_to_disk(folder / "train"):
        return folder / "train"
    raise ConfigError(f"{folder}: a datasets DatasetDict of the splits {', '.join(splits) or '(none)'}, with no "
                      f"'train' split saved there: set data.source to the folder of the split to train on"
                      + (f", e.g. {folder / splits[0]}" if splits else ""))


def _walk(root: Path, skipped: list[str], above: dict[tuple[int, int], Path] | None = None) -> list[Path]:
    """Data files under `root`, recursively; a save_to_disk folder contributes its Arrow files, a
    DatasetDict's those of its train split; their metadata is not data. Links to files and folders
    are followed, as rglob took them (a corpus gathered from several disks), but a link that loops
    or leads nowhere is no document, and a link to a folder `above` it (to itself, or to one it is
    in) would list the same files again under ever longer names until the kernel says ELOOP: each
    is skipped, with why in `skipped`, and the listing goes on."""
    st = root.stat()
    above = {} if above is None else above
    if (st.st_dev, st.st_ino) in above:
        skipped.append(f"{root}: a link to the folder {above[st.st_dev, st.st_ino]}, which holds it: skipped")
        return []
    above = {**above, (st.st_dev, st.st_ino): root}
    if _is_save_to_disk(root):
        return sorted(root.glob("*.arrow"))
    if (root / DATASET_DICT).is_file():
        return _walk(_train_split(root), skipped, above)
    out = []
    # scandir's entries know their type without a stat each (with list_source's cheaper sort and
    # names, 100k files listed and estimated in 1.2 s, not 1.8). Sorted by name, as Paths of one
    # folder sort.
    with os.scandir(root) as listing:
        entries = sorted(listing, key=lambda e: e.name)
    for e in entries:
        if e.name.startswith(".") or e.name == "__pycache__":
            continue
        try:
            is_dir, is_file = e.is_dir(), e.is_file()
        except OSError as err:  # ELOOP: a link to itself, or through a chain of links that loops
            skipped.append(f"{e.path}: a symbolic link that loops ({err.strerror}), not a document: skipped")
            continue
        if is_dir:
            out += _walk(Path(e.path), skipped, above)
        elif is_file and e.name not in SAVE_TO_DISK_FILES:
            out.append(Path(e.path))
        elif not is_file and e.is_symlink():
            skipped.append(f"{e.path}: a symbolic link to nothing ({os.readlink(e.path)}), not a document: skipped")
    return out


def _resolved(spec: str) -> Path:
    try:
        return Path(spec).expanduser().resolve()
    except RuntimeError:  # pathlib's word for a link that loops
        raise ConfigError(f"data.source = {spec!r}: a symbolic link that loops, not a file or folder") from None


def list_source(cfg: DataConfig, budget_tokens: int = 0, fetch: bool = True) -> Source:
    """The source's files with sizes and mtimes; a ConfigError naming the source otherwise. A Hub
    source fetches the files a run of `budget_tokens` needs (0: all of them); with `fetch` False,
    what was fetched before, or a ConfigError saying it is NOT_FETCHED, without the network."""
    single = False
    skipped: list[str] = []
    if cfg.source == STDLIB:
        root = stdlib_root()
        paths = stdlib_files(root)
        desc = f"{STDLIB}:{root}"
    else:
        if cfg.source.startswith("hf:"):
            from .hub import fetched_folder, local_folder

            root = local_folder(cfg.source, budget_tokens) if fetch else fetched_folder(cfg.source)
            if root is None:
                raise ConfigError(f"data.source = {cfg.source!r}: {NOT_FETCHED}")
        else:
            root = _resolved(cfg.source)
        if not root.exists():
            raise ConfigError(f"data.source = {cfg.source!r}: no such file or folder")
        desc = cfg.source if cfg.source.startswith("hf:") else str(root)
        single = not root.is_dir()
        paths, root = ([root], root.parent) if single else (_walk(root, skipped), root)
    files = []
    under = str(root).rstrip("/") + "/"
    for p in sorted(paths, key=lambda p: p.parts):  # as Paths sort, without their slower comparison
        kind = file_kind(p, alone=single)
        if kind is None:
            if single:  # the source itself: skipping it would only say it is empty
                raise ConfigError(f"data.source = {cfg.source!r}: not a format lmcockpit reads "
                                  f"(it reads {READ_FORMATS})")
            continue
        st = p.stat()
        name = str(p)
        rel = name[len(under):] if name.startswith(under) else str(p.relative_to(root))
        files.append(SourceFile(p, rel, st.st_size, st.st_mtime_ns, *kind))
    if not files or sum(f.size for f in files) == 0:
        raise ConfigError(f"data.source = {cfg.source!r}: no text found there (empty)")
    return Source(desc, files, single_text_file=len(files) == 1 and files[0].kind == "text", skipped=tuple(skipped))


# ---------------------------------------------------------------------------------- estimates
def parquet_row_group_bytes(f: SourceFile, text_field: str, meta=None) -> list[int]:
    """The text column's uncompressed bytes in each row group; `meta`: the file's footer, if read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if meta is None:
        try:
            meta = pq.ParquetFile(f.path).metadata
        except (pa.ArrowException, OSError) as e:  # the footer is the file's last bytes: the first lost
            if isinstance(e, OSError) and e.errno is not None:  # the disk's or the system's, not the file's
                raise
            raise ConfigError(f"{f.path}: not a readable Parquet file, damaged or truncated (an interrupted "
                              f"download? fetch it again): {e}") from None
    names = [meta.schema.column(i).name for i in range(meta.num_columns)]
    if text_field not in names:
        raise ConfigError(f"{f.path}: no column {text_field!r} (data.text_field); it has {', '.join(names)}")
    col = names.index(text_field)
    return [meta.row_group(i).column(col).total_uncompressed_size for i in range(meta.num_row_groups)]


# ------------------------------------------------------------------------------------- pieces
def plan_pieces(source: Source, cfg: DataConfig, keep: float, text_sizes: Sequence[int] | None = None) -> list[Piece]:
    """Pieces of about `cfg.shard_bytes` of *selected* text (a `keep` share of the whole), in file
    order. Large text and JSONL files are cut into byte ranges; their cuts move to the next line
    ending when read, so a range is whole lines (but for a text's line longer than
    readers.LINE_BYTES, cut near the range's cut, at whitespace). `text_sizes`: each file's text
    (readers.text_bytes), which cutting a compressed file needs; without them it is one piece."""
    target = max(1, int(cfg.shard_bytes / max(keep, 1e-9)))
    pieces: list[Piece] = []
    group: list[SourceFile] = []
    group_bytes = 0

    def close_group() -> None:
        nonlocal group, group_bytes
        if group:
            pieces.append(Piece(len(pieces), tuple(group), chunked=source.single_text_file))
        group, group_bytes = [], 0

    for i, f in enumerate(source.files):
        if f.kind == "parquet":
            close_group()
            for rg, _ in enumerate(parquet_row_group_bytes(f, cfg.text_field)):
                pieces.append(Piece(len(pieces), (f,), row_group=rg))
        elif f.kind in ("text", "jsonl") and not f.compression and f.size > target:
            close_group()
            chunked = f.kind == "text"
            for start in range(0, f.size, target):
                pieces.append(Piece(len(pieces), (f,), start, min(f.size, start + target), chunked=chunked))
        elif f.compression and text_sizes and text_sizes[i] > SPLIT_AT * target:
            close_group()
            n = math.ceil(SLACK * text_sizes[i] / target)
            for k in range(n):
                pieces.append(Piece(len(pieces), (f,), k * target, (k + 1) * target if k < n - 1 else -1,
                                    chunked=f.kind == "text"))
        elif f.compression or f.kind == "arrow":
            close_group()
            pieces.append(Piece(len(pieces), (f,), chunked=f.kind == "text"))
        else:
            group.append(f)
            group_bytes += f.size
            if group_bytes >= target:
                close_group()
    close_group()
    return pieces

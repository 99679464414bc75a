"""Token shards in modded-nanogpt's .bin format, read as a run's train and validation tokens.

A shard (llm.c's and modded-nanogpt's `fineweb_train_000001.bin`, ...): a header of 256 int32
(magic 20240520, version 1, the number of tokens), then that many uint16 token ids, each document
after an end-of-text token (GPT-2's 50256). `data.format = "tokens"` trains on them as they are:
no token cache is built, only the tokenizer saved beside the caches for the run folder.

`data.source`: a .bin file, a folder (its .bin files in name order but those named `*_val_*`, the
held-out shards), or `hf:OWNER/NAME[/PATH]`, whose `*train*.bin` files in name order are fetched
until they hold the run's tokens. `data.val_source`: one .bin file, or `hf:OWNER/NAME/FILE`.

numpy only where the tokens are mapped (`open_tokens`): the front-end reads headers and plans.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

from ..config import Config, ConfigError

MAGIC, VERSION = 20240520, 1
HEADER_BYTES = 256 * 4
# modded-nanogpt's FineWeb shards: 100M tokens each (data/fineweb.py's shard_size), its validation
# shard fineweb_val_000000.bin, the training ones numbered from 1.
SHARD_TOKENS = 100_000_000
SPEEDRUN_DATASET = "kjj0/fineweb10B-gpt2"


def shard_tokens(path: Path, key: str = "data.source") -> int:
    """The shard's token count from its header, checked against the file's size; a ConfigError
    naming the file and what was expected otherwise."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
        size = path.stat().st_size
    except OSError as e:
        raise ConfigError(f"{key}: {path}: cannot be read ({e.strerror or e})") from None
    if len(head) < HEADER_BYTES:
        raise ConfigError(f"{key}: {path}: {len(head)} bytes, shorter than a .bin token shard's header of "
                          f"{HEADER_BYTES} (256 int32)")
    magic, version, n = struct.unpack("<3i", head[:12])
    if magic != MAGIC or version != VERSION:
        raise ConfigError(f"{key}: {path}: not a .bin token shard: its header starts {magic}, {version}; expected "
                          f"the magic number {MAGIC} and version {VERSION} (modded-nanogpt's and llm.c's format)")
    if n < 0 or size != HEADER_BYTES + 2 * n:
        raise ConfigError(f"{key}: {path}: {size:,} bytes, but its header says {n:,} tokens, which take "
                          f"{HEADER_BYTES + 2 * max(n, 0):,} (truncated? fetch it again)")
    return n


def local_train_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*.bin") if "_val_" not in p.name and not p.name.startswith("."))


def train_files(cfg: Config, budget_tokens: int, fetch: bool = True) -> list[Path]:
    """The training shards of data.source: local, or those of a Hub dataset the run needs."""
    spec = cfg.data.source
    if spec.startswith("hf:"):
        from .hub import parse

        repo, path = parse(spec)
        files = _hub_files(spec, repo, path, budget_tokens, fetch)
    else:
        root = Path(spec).expanduser()
        if not root.exists():
            raise ConfigError(f"data.source = {spec!r}: no such file or folder")
        files = local_train_files(root)
    if not files:
        raise ConfigError(f"data.source = {spec!r}: no .bin token shards there (data.format = \"tokens\")")
    return files


def val_file(cfg: Config, fetch: bool = True) -> Path:
    spec = cfg.data.val_source
    if not spec:
        raise ConfigError('data.format = "tokens" validates on a shard of its own: set data.val_source (a .bin file '
                          f"or hf:OWNER/NAME/FILE, e.g. hf:{SPEEDRUN_DATASET}/fineweb_val_000000.bin)",
                          keys=("data.val_source", "data.format"))
    if spec.startswith("hf:"):
        from .hub import parse

        repo, path = parse(spec)
        if not path.endswith(".bin"):
            raise ConfigError(f"data.val_source = {spec!r}: expected one .bin file, hf:OWNER/NAME/FILE.bin")
        return _hub_files(spec, repo, path, 0, fetch, key="data.val_source")[0]
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"data.val_source = {spec!r}: no such file (expected a .bin token shard)")
    return path


def _hub_files(spec: str, repo: str, path: str, budget_tokens: int, fetch: bool,
               key: str = "data.source") -> list[Path]:
    """A Hub dataset's shards: the one named, or its training ones in name order until they hold
    `budget_tokens` (all of them at 0); without `fetch`, those fetched before, or a ConfigError."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    from .hub import download_command, fetch_or_cached

    def chosen(listing: list[tuple[str, int]]) -> list[str]:
        if path.endswith(".bin"):
            return [path]
        names, held = [], 0
        for name, size in sorted(listing):
            if name.endswith(".bin") and "train" in Path(name).name and name.startswith(path):
                if budget_tokens and held >= budget_tokens:
                    break
                names.append(name)
                held += (size - HEADER_BYTES) // 2
        return names

    def online() -> list[Path]:
        api = HfApi()
        if path.endswith(".bin"):
            names = [path]
        else:
            names = chosen([(f.path, f.size) for f in api.list_repo_tree(repo, path or None, recursive=True,
                                                                         repo_type="dataset") if hasattr(f, "size")])
        if not names:
            raise ConfigError(f"{key} = {spec!r}: no .bin token shards under {path or 'the dataset'}")
        return [Path(hf_hub_download(repo, name, repo_type="dataset")) for name in names]

    def cached() -> list[Path] | None:
        try:
            folder = Path(snapshot_download(repo, repo_type="dataset", local_files_only=True,
                                            allow_patterns=[path] if path.endswith(".bin") else ["*.bin"]))
        except Exception as e:  # noqa: BLE001 - the incomplete-snapshot error still names the folder
            folder = getattr(e, "snapshot_path", None)
            if folder is None:
                return None
            folder = Path(folder)
        files = [folder / path] if path.endswith(".bin") else [
            p for p in local_train_files(folder / path) if "train" in p.name]
        return [f for f in files if f.is_file()] or None

    if not fetch:
        found = cached()
        if found is None:
            from .sources import NOT_FETCHED

            raise ConfigError(f"{key} = {spec!r}: {NOT_FETCHED}")
        return found
    return fetch_or_cached(
        f"{key} = {spec!r}", repo, "dataset", online, cached,
        lambda reason: f"{key} = {spec!r}: not downloaded yet, and {reason}. Download it on a machine with a "
                       f"network:\n  {download_command(repo, path)}\nthen set {key} to DIR/{path}")


def found_here(cfg: Config) -> list[tuple[str, list[Path] | str]]:
    """Per key (data.source, data.val_source): the shards on this machine, or why there are none
    (not fetched yet, a path that is not there), without the network."""
    out: list[tuple[str, list[Path] | str]] = []
    for key, find in (("data.source", lambda: train_files(cfg, cfg.training.max_steps * cfg.tokens_per_step,
                                                          fetch=False)),
                      ("data.val_source", lambda: [val_file(cfg, fetch=False)])):
        try:
            out.append((key, find()))
        except ConfigError as e:
            out.append((key, str(e).split(": ", 2)[-1] if str(e).startswith(key) else str(e)))
    return out


def planned_fetch(cfg: Config) -> list[tuple[str, int]]:
    """What a run fetches of modded-nanogpt's dataset, (file, bytes), without the network: its
    shards hold SHARD_TOKENS each. Empty for other sources (their files are listed when fetched)."""
    out = []
    if cfg.data.source.rstrip("/") == f"hf:{SPEEDRUN_DATASET}":
        n = max(1, math.ceil(cfg.training.max_steps * cfg.tokens_per_step / SHARD_TOKENS))
        out += [(f"fineweb_train_{i:06d}.bin", HEADER_BYTES + 2 * SHARD_TOKENS) for i in range(1, n + 1)]
    if cfg.data.val_source.startswith(f"hf:{SPEEDRUN_DATASET}/"):
        out.append((cfg.data.val_source.rsplit("/", 1)[-1], HEADER_BYTES + 2 * SHARD_TOKENS))
    return out


def open_tokens(files: list[Path], limit: int = 0, key: str = "data.source"):
    """The shards' tokens as one stream (cache.TokenStream over memory maps); the first `limit`."""
    import numpy as np

    from .cache import TokenStream

    arrays, left = [], limit or math.inf
    for f in files:
        n = int(min(shard_tokens(f, key), left))
        if n == 0:
            continue
        arrays.append(np.memmap(f, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(n,)))
        left -= n
        if left <= 0:
            break
    if limit and limit > sum(len(a) for a in arrays):
        raise ConfigError(f"data.val_tokens = {limit:,}: {key} holds {sum(len(a) for a in arrays):,} tokens")
    return TokenStream(arrays)

"""Datasets on the Hugging Face Hub (`hf:` sources), fetched resumably and read as a local folder.

`hf:OWNER/NAME[/PATH]`: a dataset on the Hugging Face Hub, fetched with `huggingface_hub` into
its own cache (HF_TOKEN and HF_HUB_OFFLINE are honoured), then read as a local folder. A connection
dropped mid-file is resumed from its last whole 10 MB; an interrupted run keeps the files it
finished, and the next fetches the one it was in the middle of again from its start.

Only what the run needs is fetched: the data files under PATH, in name order, until they hold
enough for the run's token budget with a margin (a 10B-token sample is 27 GB; a 100M-token run
needs one of its 2 GB files). Offline, or the Hub out of reach, the files fetched before serve;
with none: a ConfigError that gives the command to download them elsewhere and the `--set` that
trains on the result.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Callable

from ..config import ConfigError
from .formats import DATA_SUFFIXES

# Compressed bytes a token takes at most in a Parquet text shard (FineWeb-Edu: about 2.7 per GPT-2
# token), with the margin a budget gets: what is fetched covers the run, rarely much more.
FILE_BYTES_PER_TOKEN = 4.0


def parse(spec: str) -> tuple[str, str]:
    """("OWNER/NAME", "PATH" or "") from "hf:OWNER/NAME[/PATH]"."""
    parts = [p for p in spec[len("hf:"):].strip("/").split("/") if p]
    if len(parts) < 2:
        raise ConfigError(f"data.source = {spec!r}: expected hf:OWNER/NAME or hf:OWNER/NAME/PATH "
                          "(e.g. hf:HuggingFaceFW/fineweb-edu/sample/10BT)")
    return "/".join(parts[:2]), "/".join(parts[2:])


def download_command(repo: str, path: str) -> str:
    include = f" --include '{path}/*'" if path else ""
    return f"hf download {repo} --repo-type dataset{include} --local-dir DIR"


def choose_files(listing: list[tuple[str, int]], need_bytes: int) -> list[str]:
    """The data files to fetch, in name order, until they hold `need_bytes`; at least one, and
    all of them when `need_bytes` is 0 (no budget given)."""
    files = sorted((name, size) for name, size in listing if name.endswith(DATA_SUFFIXES))
    chosen, held = [], 0
    for name, size in files:
        if need_bytes and held >= need_bytes:
            break
        chosen.append(name)
        held += size
    return chosen


def unreachable_errors() -> tuple[type[Exception], ...]:
    """What the Hub out of reach raises: an HTTP error answer, and the client's own errors for no
    answer at all. Those of requests (huggingface_hub before 1.0) are OSErrors; those of httpx and
    httpx2 (1.x, 2.x) are not."""
    from huggingface_hub.errors import HfHubHTTPError

    errors: list[type[Exception]] = [HfHubHTTPError, OSError]
    for client in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(client).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def offline_reason() -> str:
    """Why huggingface_hub is offline, as an error says it (it reads transformers' older name too)."""
    return next((f"{name} is set" for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
                 if os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")), "offline mode is set")


def has_token() -> bool:
    from huggingface_hub import get_token

    return get_token() is not None


def fetch_or_cached(key: str, repo: str, repo_word: str, online: Callable[[], Path],
                    cached: Callable[[], Path | None], missing: Callable[[str], str]) -> Path:
    """What `online()` fetches; offline, or the Hub out of reach, what `cached()` finds from an
    earlier fetch; with neither, a ConfigError: `key` (the setting, as the user wrote it), that
    the Hub has no such `repo_word` `repo` when it says so, or `missing(reason)` (what is not
    downloaded and how to get it elsewhere, given why the Hub was not asked)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import RepositoryNotFoundError

    reason = offline_reason()
    if not constants.HF_HUB_OFFLINE:
        try:
            return online()
        except RepositoryNotFoundError:  # the Hub answers so for a private or gated repo too
            token = "this machine's token cannot read it" if has_token() else "set HF_TOKEN to a token that can"
            raise ConfigError(f"{key}: the Hub has no {repo_word} {repo} that this machine may read "
                              f"(a typo in the name? private or gated: {token})") from None
        except unreachable_errors() as e:
            reason = f"the Hub could not be reached ({type(e).__name__})"
    if (found := cached()) is not None:
        return found
    raise ConfigError(missing(reason))


def local_folder(spec: str, budget_tokens: int = 0) -> Path:
    """The folder holding the source's files: fetched (those the budget needs) or fetched before."""
    from huggingface_hub import HfApi, snapshot_download

    repo, path = parse(spec)
    prefix = f"{path}/" if path else ""

    def online() -> Path:
        api = HfApi()
        # One request that is not retried first: the listing retries a refused connection with
        # backoff, 23 s before it gives up, and a machine without a network has its files cached.
        commit = api.repo_info(repo, repo_type="dataset").sha
        listing = [(f.path, f.size) for f in api.list_repo_tree(repo, path or None, recursive=True,
                                                                revision=commit, repo_type="dataset")
                   if hasattr(f, "size")]
        chosen = choose_files(listing, int(budget_tokens * FILE_BYTES_PER_TOKEN))
        if not chosen:
            raise ConfigError(f"data.source = {spec!r}: no data files (.parquet, .arrow, JSON lines or .txt, "
                              f"plain or compressed) under {prefix or 'the dataset'}")
        return Path(snapshot_download(repo, repo_type="dataset", allow_patterns=chosen)) / path

    use = "DIR/" + path if path else "DIR"
    return fetch_or_cached(
        f"data.source = {spec!r}", repo, "dataset", online, lambda: fetched_folder(spec),
        lambda reason: f"data.source = {spec!r}: not downloaded yet, and {reason}. Download it on a machine "
                       f"with a network:\n  {download_command(repo, path)}\n"
                       f"then train on it with --set data.source='\"{use}\"'")


def fetched_folder(spec: str) -> Path | None:
    """The folder of what an earlier run fetched of the source, from the Hub's cache alone (no
    network: the token budget asks on every preset the launch screen passes); None if nothing."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    repo, path = parse(spec)
    prefix = f"{path}/" if path else ""
    try:
        try:
            snapshot = snapshot_download(repo, repo_type="dataset", local_files_only=True,
                                         allow_patterns=[prefix + "*" + s for s in DATA_SUFFIXES]
                                         + [prefix + "**/*" + s for s in DATA_SUFFIXES])
        except LocalEntryNotFoundError as e:
            # Newer huggingface_hub refuses a snapshot that lacks files its cached listing has
            # (IncompleteSnapshotError): the very state that fetching only what a budget needs
            # leaves. The error names the folder, which holds the files fetched.
            snapshot = getattr(e, "snapshot_path", None)
            if snapshot is None:
                raise
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, HfHubHTTPError, OSError):
        return None
    folder = Path(snapshot) / path
    return folder if folder.is_dir() and any(p.name.endswith(DATA_SUFFIXES) for p in folder.rglob("*")) else None

"""A pretrained tokenizer: a local folder, or the tokenizer files of a model repo on the Hub.

A pretrained tokenizer named by `tokenizer.kind`: a local folder holding tokenizer.json, or
`hf:OWNER/NAME`, a model repo on the Hugging Face Hub (e.g. `hf:openai-community/gpt2`).

Of a Hub repo only the tokenizer's files are fetched (a model repo also holds its weights: GPT-2's
are 500 MB), with `huggingface_hub` into the Hub's own cache, HF_TOKEN and HF_HUB_OFFLINE honoured;
then the folder they landed in is read as a local one. `fetch` goes to the network (once, when a
run prepares its data); `folder` never does: the cache key and the launch screen ask it of every
preset. Offline, or the Hub out of reach, a fetched copy serves; with none, a ConfigError gives the
command that fetches it elsewhere and the `--set` that uses the result. No numpy or tokenizers.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..config import HUB_TOKENIZER, ConfigError

# tokenizer.json is the tokenizer; the other two may name its end-of-text token.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def is_hub(kind: str) -> bool:
    return kind.startswith("hf:")


def repo_of(kind: str) -> str:
    """"OWNER/NAME" of "hf:OWNER/NAME"; a ConfigError for anything else that starts with hf:."""
    m = HUB_TOKENIZER.fullmatch(kind)
    if m is None:
        raise ConfigError(f"tokenizer.kind = {kind!r}: expected hf:OWNER/NAME, a model repo on the Hub "
                          "(e.g. hf:openai-community/gpt2)")
    return m[1]


def download_command(repo: str) -> str:
    return f"hf download {repo} {' '.join(TOKENIZER_FILES)} --local-dir DIR"


def folder(kind: str) -> Path | None:
    """The local folder a pretrained kind is read from, without the network: the path itself, or
    the Hub's cached copy of the repo's tokenizer files (None when it was never fetched)."""
    if not is_hub(kind):
        return Path(kind).expanduser()
    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(repo_of(kind), "tokenizer.json", repo_type="model")
    return Path(path).parent if isinstance(path, str) else None


def fetch(kind: str) -> Path:
    """The folder holding the tokenizer of `kind`: for a Hub repo, its tokenizer files fetched
    (a cached copy when offline or out of reach); a ConfigError when there is none to be had."""
    if not is_hub(kind):
        return Path(kind).expanduser()
    from huggingface_hub import HfApi, snapshot_download

    from .hub import fetch_or_cached

    repo = repo_of(kind)

    def online() -> Path:
        # Not retried, unlike the download: a machine without a network fails here at once and
        # goes on to the cached copy (hub.py says why).
        names = {s.rfilename for s in HfApi().model_info(repo).siblings or ()}
        if names and "tokenizer.json" not in names:
            raise ConfigError(no_tokenizer_json(kind, repo, names))
        got = Path(snapshot_download(repo, allow_patterns=list(TOKENIZER_FILES)))
        if not (got / "tokenizer.json").is_file():
            raise ConfigError(no_tokenizer_json(kind, repo, set()))
        return got

    return fetch_or_cached(
        f"tokenizer.kind = {kind!r}", repo, "model", online, lambda: folder(kind),
        lambda reason: f"tokenizer.kind = {kind!r}: the tokenizer of {repo} is not downloaded yet, and {reason}. "
                       f"Download it on a machine with a network:\n  {download_command(repo)}\n"
                       f"then copy DIR here and train with --set tokenizer.kind='\"DIR\"'")


def no_tokenizer_json(kind: str, repo: str, names: set[str]) -> str:
    has = sorted(n for n in names if n in ("vocab.json", "merges.txt", "tokenizer.model", "vocab.txt"))
    return (f"tokenizer.kind = {kind!r}: the Hub's model {repo} has no tokenizer.json"
            + (f" (it has {', '.join(has)})" if has else "") + ". Only a `tokenizers` tokenizer.json is read: "
            "save one with transformers (AutoTokenizer.from_pretrained(REPO).save_pretrained(DIR)) and set "
            "tokenizer.kind to DIR")


def material(kind: str) -> dict:
    """What of a pretrained tokenizer decides the tokens, for the token cache's key (store.py)."""
    found = folder(kind)
    files = [found / name for name in TOKENIZER_FILES] if found is not None else []
    if is_hub(kind):
        # By content: the Hub's cache gives each machine its own mtimes, and a cache folder
        # shared by several machines must have one key for the same tokenizer.
        return {"tokenizer_files": [(f.name, hashlib.sha256(f.read_bytes()).hexdigest())
                                    for f in files if f.is_file()]}
    # A local folder as before special_tokens_map.json was read (the caches made since keep their
    # keys): a folder that changes it alone, and not tokenizer_config.json, is not known of.
    return {"tokenizer_files": [(f.name, f.stat().st_size, f.stat().st_mtime_ns)
                                for f in files[:2] if f.is_file()]}

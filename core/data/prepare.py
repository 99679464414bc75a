"""The token cache a run needs: found, or built (build.py) under a lock; a mixture's per part.

    sources → a cache per source (key: store.py) → the run's token streams (cache.py)

* One process builds a given key at a time (an flock beside the folder); others wait, then reuse.
* A resumed run passes its own tokenizer, a mixture its shared one: a cache made with that very
  tokenizer serves, else one is made with it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from ..config import Config, ConfigError
from ..run.folder import DISK_FULL
from . import aligned_rows, pretrained, sources, token_shards
from .batches import Mixture
from .build import Build, ProgressFn, plan, train_bpe_folder
from .children import in_child
from .cache import TokenData, TokenStream, open_cache
from .store import (BUILD_PREFIX, cache_key, cache_root, find_cache, mixture_tokenizer_folder, mixture_tokenizer_key,
                    open_lock, pre_chat_key, read_meta)
from .tokenizer import load_tokenizer

# What a given tokenizer is, said when a cache is tokenised with it ({file}: its tokenizer.json).
RUN_OWN = ("the run's own tokenizer ({file}): no token cache for this data was made with it (the source changed "
           "since the run started, or the cache was deleted)")
MIXTURE_OWN = "the mixture's tokenizer ({file}), which all its sources share"


def prepare(cfg: Config, log: Callable[[str], None], progress: ProgressFn,
            tokenizer_file: Path | None = None) -> TokenData:
    """The token cache for `cfg`'s data, built if need be; a mixture's one per part. A resumed run
    passes its own `tokenizer_file`: its weights know those ids and no others. A cache for its
    data serves if it was made with that very tokenizer; if not (the source changed since the run
    started, so a new BPE would differ, or the cache was deleted), the data is tokenised with it."""
    if tokenizer_file is None and pretrained.is_hub(cfg.tokenizer.kind):
        # Before the data: its files are kilobytes to a source's gigabytes, and its absence is
        # better said before those are fetched. The cache's key is read from what lands here.
        log(f"data: tokenizer {cfg.tokenizer.kind} from {pretrained.fetch(cfg.tokenizer.kind)}")
    if cfg.data.format == "tokens":
        data = prepare_tokens(cfg, log, tokenizer_file)
    elif cfg.data.sources:
        data = prepare_mixture(cfg, log, progress, tokenizer_file)
    else:
        data = prepare_source(cfg, log, progress, tokenizer_file, RUN_OWN)
    return aligned_rows.aligned(data, cfg)


def prepare_tokens(cfg: Config, log, tokenizer_file: Path | None) -> TokenData:
    """data.format = "tokens": the shards trained on as they are (token_shards.py), validated on
    data.val_source's; the tokenizer (the run's own on resume) saved once beside the caches, where
    the run folder copies it from, under a key of its content."""
    import numpy as np
    from tokenizers import Tokenizer

    from .build import save_tokenizer
    from .tokenizer import eos_id, token_byte_lengths

    train = token_shards.open_tokens(token_shards.train_files(cfg, cfg.training.max_steps * cfg.tokens_per_step))
    val = token_shards.open_tokens([token_shards.val_file(cfg)], cfg.data.val_tokens, key="data.val_source")
    origin = tokenizer_file.parent if tokenizer_file is not None else pretrained.folder(cfg.tokenizer.kind)
    if origin is None or not (origin / "tokenizer.json").is_file():
        raise ConfigError(f"tokenizer.kind = {cfg.tokenizer.kind!r}: no tokenizer.json found at {origin}")
    digest = hashlib.sha256((origin / "tokenizer.json").read_bytes()
                            + str(cfg.tokenizer.vocab_size).encode()).hexdigest()[:16]
    folder = cache_root(cfg) / f"tokens-{digest}"
    if not (folder / "tokenizer" / "tokenizer.json").is_file():
        make_root(root := cache_root(cfg))
        with building(root, folder.name, log):
            if not (folder / "tokenizer" / "tokenizer.json").is_file():
                folder.mkdir(exist_ok=True)
                save_tokenizer(Tokenizer.from_file(str(origin / "tokenizer.json")), origin, folder / "tokenizer",
                               cfg, log)
    need = cfg.training.seq_len + 1
    for split, tokens in (("data.source", train), ("data.val_source", val)):
        if len(tokens) < need:
            raise ConfigError(f"{split}: {len(tokens)} tokens, fewer than one sequence of training.seq_len + 1 = {need}")
    # An id past the embedding's rows fails on a GPU as a device-side assert, far from its cause:
    # the validation tokens, made by the same tokenizer as the training ones, are checked whole.
    if (top := int(np.asarray(val).max())) >= cfg.tokenizer.vocab_size:
        raise ConfigError(f"data.val_source: token id {top} in {cfg.data.val_source}, past tokenizer.vocab_size = "
                          f"{cfg.tokenizer.vocab_size}: the shards were made by another tokenizer than "
                          f"tokenizer.kind = {cfg.tokenizer.kind!r}, or vocab_size is too small")
    tok = Tokenizer.from_file(str(folder / "tokenizer" / "tokenizer.json"))
    log(f"data: {len(train):,} training tokens in {len(train.arrays)} shards, {len(val):,} validation tokens "
        f"({cfg.data.val_source})")
    return TokenData(folder, train, val, cfg.tokenizer.vocab_size, token_byte_lengths(tok, cfg.tokenizer.vocab_size),
                     eos_id(tok, folder / "tokenizer"), True)


def prepare_source(cfg: Config, log, progress: ProgressFn, tokenizer_file: Path | None, tokenizer_label: str,
                   source: sources.Source | None = None) -> TokenData:
    source = source or sources.list_source(cfg.data, cfg.training.max_steps * cfg.tokens_per_step)
    for why in source.skipped:
        log(f"data: {why}")
    root = cache_root(cfg)
    if (found := find_cache(cfg, source, tokenizer_file)) is not None:
        older = (", made before lmcockpit's BPEs reserved the chat template's tokens (fine-tuning to chat adds them)"
                 if tokenizer_file is None and cfg.tokenizer.kind == "bpe" and found.name == pre_chat_key(cfg, source)
                 else "")
        log(f"data: reusing token cache {found}{older}")
        return open_cache(found, cfg, reused=True)
    key = cache_key(cfg, source, tokenizer_file)
    final = root / key
    make_root(root)
    with building(root, key, log):
        if read_meta(final) is None:  # not finished by another process while this one waited
            _clean_abandoned(root)
            work = root / f"{BUILD_PREFIX}{key}"
            try:
                Build(cfg, source, work, log, progress, tokenizer_file, tokenizer_label).run()
            except OSError as e:
                if e.errno not in DISK_FULL:
                    raise
                # A worker's shard, a spool, the BPE: wherever it ran out, the cure is the same.
                raise ConfigError(f"data: the disk holding the token cache is full ({root}: {e.strerror}); free "
                                  "some space there, or point data.cache_dir at a disk with room; preparing again "
                                  "goes on from the pieces finished") from None
            os.rename(work, final)
            log(f"data: token cache written to {final}")
    return open_cache(final, cfg, reused=False)


def prepare_mixture(cfg: Config, log, progress: ProgressFn, tokenizer_file: Path | None) -> TokenData:
    """[[data.sources]]: one tokenizer for all the parts (trained on a sample of each by weight,
    or pretrained, or the run's own), then each part's cache made with it; training draws each
    row from a part by its weight, validation spans every part's held-out documents."""
    parts = cfg.data_parts()
    listed = []
    for i, part in enumerate(parts):  # a part's error names it as the user wrote it
        try:
            listed.append(sources.list_source(part.data, cfg.training.max_steps * cfg.tokens_per_step))
        except ConfigError as e:
            raise ConfigError(str(e).replace("data.source = ", f"data.sources[{i}].source = ", 1)) from None
    label = RUN_OWN
    if tokenizer_file is None and cfg.tokenizer.kind == "bpe":
        tokenizer_file, label = mixture_tokenizer(cfg, parts, listed, log, progress), MIXTURE_OWN
    datas = [prepare_source(part, log, progress, tokenizer_file, label, source)
             for part, source in zip(parts, listed)]
    return TokenData(datas[0].dir, Mixture([d.train for d in datas], [part.weight for part in cfg.data.sources]),
                     TokenStream([d.val for d in datas]), datas[0].vocab_size, datas[0].token_bytes,
                     datas[0].eos_id, all(d.reused for d in datas))


def mixture_tokenizer(cfg: Config, parts: list[Config], listed: list[sources.Source], log,
                      progress: ProgressFn) -> Path:
    """The BPE a mixture's parts share, trained once on each part's sample in its weight's share
    of tokenizer.train_bytes, and kept beside the caches (tokenizer-KEY/) under a key of its own."""
    root = cache_root(cfg)
    key = mixture_tokenizer_key(cfg, listed)
    folder = mixture_tokenizer_folder(cfg, listed)
    if not (folder / "tokenizer.json").is_file():
        make_root(root)
        with building(root, key, log):
            if not (folder / "tokenizer.json").is_file():
                t0, total = time.time(), sum(part.weight for part in cfg.data.sources)
                planned = [plan(part.data, s, progress) for part, s in zip(parts, listed)]
                train_bytes = cfg.tokenizer.train_bytes  # 0: all of each part, as of a single source (build.py)
                budgets = [int(train_bytes * part.weight / total) if train_bytes else int(p.kept_bytes)
                           for part, p in zip(cfg.data.sources, planned)]
                samples = [(part.data, p, max(1, min(b, int(p.kept_bytes))))
                           for part, p, b in zip(parts, planned, budgets)]
                budget = sum(b for _, _, b in samples)
                progress("training tokenizer", 0, budget, "bytes")
                in_child(train_bpe_folder, cfg, samples, folder)
                progress("training tokenizer", budget, budget, "bytes")
                log(f"data: trained the mixture's byte-level BPE of {load_tokenizer('bpe', folder).get_vocab_size()} "
                    f"tokens on {budget / 1e6:.1f} MB from {len(parts)} sources in {time.time() - t0:.1f}s")
    return folder / "tokenizer.json"


def make_root(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"data.cache_dir: cannot write the token cache under {root} ({e.strerror})") from None


@contextmanager
def building(root: Path, key: str, log):
    """Held while this process builds `key`: a second process waits here, then reuses."""
    with open_lock(root, key) as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"data: another process is preparing this token cache ({key}); waiting for it")
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _clean_abandoned(root: Path) -> None:
    """Temporary folders of builds from before resumable caches, whose process is gone."""
    import psutil

    host = socket.gethostname()
    for p in root.glob(".tmp-*"):
        parts = p.name.split("-")  # ".tmp", key, host..., pid, random: a host name may hold "-"
        if len(parts) < 5 or "-".join(parts[2:-2]) != host or not parts[-2].isdigit():
            continue  # another machine's (a shared cache folder), or an older name: not ours to judge
        if not psutil.pid_exists(int(parts[-2])):
            shutil.rmtree(p, ignore_errors=True)

"""A checkpoint folder on disk, without torch: its files, whether it is whole, and which one a path names.

Its files, whether it is whole, the one a user's
path names (a run folder's latest, or a checkpoint folder), and its config and tokenizer.
Resume, chat, export and the trainer all find and check checkpoints here."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..config import Config, ConfigError, config_from_dict, read_toml
from .checkpoint_pickle import check_metadata
from .folder import CONFIG, TOKENIZER, latest_checkpoint
from .rows import INT_LIMIT

WEIGHTS = "model.safetensors"
STATE = "state.json"
TRAIN_STATE = "train_state"  # the torch.distributed.checkpoint folder: weights and optimizer state
METADATA = f"{TRAIN_STATE}/.metadata"  # a pickle: read only through checkpoint_pickle
CHECKPOINT_FILES = (WEIGHTS, METADATA, STATE, CONFIG)
FORMAT_VERSION = 2  # train.checkpoint_io writes it; kept here so the front-end needs no torch


def is_run_dir(path: Path) -> bool:
    """A run folder has config.toml; a checkpoint folder has one too, beside its state.json."""
    return (path / CONFIG).is_file() and not (path / STATE).is_file() and not (path / WEIGHTS).is_file()


def check_checkpoint(path: Path) -> int:
    """The checkpoint's step, or a ConfigError saying what is wrong with it (resume, chat and
    export all check a checkpoint here). Its metadata pickle is checked too, running nothing: one
    that names anything a checkpoint does not hold is refused here, before any engine starts."""
    missing = [f for f in CHECKPOINT_FILES if not (path / f).is_file()]
    if missing:
        raise ConfigError(f"{path}: not a complete lmcockpit checkpoint (missing {', '.join(missing)})")
    try:
        state = json.loads((path / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: not JSON, or not UTF-8 at all
        raise ConfigError(f"{path}: {STATE} is unreadable ({e}); the checkpoint is damaged") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise ConfigError(f"{path}: {STATE} is not an lmcockpit checkpoint of format {FORMAT_VERSION}")
    if problem := state_problem(state):
        raise ConfigError(f"{path}: {STATE}: {problem}; the checkpoint is damaged, or not lmcockpit's")
    check_shards(path)
    try:
        with open(path / METADATA, "rb") as fh:
            check_metadata(fh, f"{path}: {METADATA}")
    except OSError as e:
        raise ConfigError(f"{path}: {METADATA} is unreadable ({e.strerror or e})") from None
    return state["step"]


def _count(value: object, least: int = 0) -> bool:
    return type(value) is int and least <= value < INT_LIMIT


def _ints(value: object) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value)


# What a resume reads from state.json, each field as checkpoint_io.save writes it; fields that
# older checkpoints lack are optional (the trainer reads them with .get).
STATE_FIELDS = {
    "step": (_count, "a step (a whole number from 0)"),
    "tokens_seen": (_count, "a count of tokens (a whole number from 0)"),
    "rng": (lambda v: isinstance(v, dict) and isinstance(v.get("python"), list) and len(v["python"]) == 3
            and type(v["python"][0]) is int and _ints(v["python"][1])
            and isinstance(v.get("numpy"), list) and len(v["numpy"]) == 5 and isinstance(v["numpy"][0], str)
            and _ints(v["numpy"][1]) and isinstance(v.get("torch"), str)
            and all(isinstance(s, (str, type(None))) for s in v.get("cuda_by_rank") or v.get("cuda") or []),
            "the random states (python, numpy, torch) as lmcockpit saves them"),
}
OPTIONAL_STATE = {
    "nan_skips": (_count, "a count"),
    "world": (lambda v: _count(v, 1), "a count of processes (from 1)"),
    "data_unit": (lambda v: isinstance(v, list) and len(v) == 2 and all(_count(n, 1) for n in v),
                  "[sequences per micro-batch, micro-batches per step]"),
    "spikes": (lambda v: isinstance(v, dict) and all(_count(v.get(k, 0)) for k in
                                                    ("rollbacks", "batch_offset", "lr_cut_until")),
               "the spike detector's state"),
    "target": (lambda v: isinstance(v, dict) and (v.get("reached_at") is None or _count(v["reached_at"])),
               "the target's state"),
    "grad_scaler": (lambda v: isinstance(v, dict), "fp16's loss scaler state"),
}


def state_problem(state: dict) -> str | None:
    """What is wrong with a checkpoint's state.json, in words; None when a resume can read it."""
    for name, (fits, what) in STATE_FIELDS.items():
        if name not in state:
            return f"no {name}"
        if not fits(state[name]):
            return f"{name} is not {what}"
    for name, (fits, what) in OPTIONAL_STATE.items():
        if state.get(name) is not None and not fits(state[name]):
            return f"{name} is not {what}"
    return None


def check_shards(path: Path) -> None:
    """Every file of the checkpoint's train_state/ a regular one, never a link: a FIFO there
    hung a resume (an open that waits for a writer, deaf to SIGTERM), a link reads elsewhere."""
    try:
        entries = list(os.scandir(path / TRAIN_STATE))
    except OSError as e:
        raise ConfigError(f"{path}: {TRAIN_STATE} is unreadable ({e.strerror or e})") from None
    for entry in entries:
        if not entry.is_file(follow_symlinks=False):
            kind = "a symbolic link" if entry.is_symlink() else "not a regular file"
            raise ConfigError(f"{path}: {TRAIN_STATE}/{entry.name} is {kind}: refused (the checkpoint is damaged, "
                              "or not lmcockpit's)")


def find_checkpoint(spec: str) -> Path:
    """A run folder (its latest complete checkpoint) or a checkpoint folder; a ConfigError naming
    what is missing otherwise."""
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{spec}: no such run folder or checkpoint folder")
    if is_run_dir(path):
        ckpt = latest_checkpoint(path)
        if ckpt is None:
            raise ConfigError(f"{spec}: the run has no complete checkpoint yet (it stopped, or is still, before "
                              "its first one)")
    elif (path / STATE).is_file() or (path / WEIGHTS).is_file():
        ckpt = path
    else:
        raise ConfigError(f"{spec}: neither a run folder (config.toml) nor a checkpoint folder ({STATE}, {WEIGHTS})")
    check_checkpoint(ckpt)
    tokenizer_file(ckpt, checkpoint_config(ckpt))
    return ckpt


def checkpoint_config(ckpt: Path) -> Config:
    return config_from_dict(read_toml(ckpt / CONFIG), source=str(ckpt / CONFIG))


def tokenizer_file(ckpt: Path, cfg: Config) -> Path:
    """The run folder's tokenizer (a checkpoint lives in RUN/checkpoints/), else a pretrained one's."""
    from ..data import pretrained

    candidates = [ckpt.parent.parent / TOKENIZER / "tokenizer.json"]
    if cfg.tokenizer.kind != "bpe" and (folder := pretrained.folder(cfg.tokenizer.kind)) is not None:
        candidates.append(folder / "tokenizer.json")
    for path in candidates:
        if path.is_file():
            return path
    raise ConfigError(f"{ckpt}: no tokenizer found for it (looked for {', '.join(map(str, candidates))})")



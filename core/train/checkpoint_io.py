"""Checkpoints that survive a kill at any moment, and resume on any number of processes.

`checkpoints/step_NNNNNN/` holds
* `train_state/`: weights and optimizer state through `torch.distributed.checkpoint` (DCP), keyed
  by parameter name, each rank writing its own shards: a run saved by 2 processes resumes on 1,
  or the reverse, and DDP, FSDP and a single process all read each other's;
* `model.safetensors`: the whole weights once more, the portable copy that chat and export read;
* `config.toml`, and `state.json` (step, tokens seen, RNG) written last: the commit marker.

Everything is written into a temporary folder, fsynced, and the folder renamed into place; only
then is the `latest` pointer replaced (atomically, by rename). A kill at any point leaves either
the new checkpoint complete or the previous one untouched; leftover `.tmp-*` folders are ignored
and cleaned up by the next writer. Pruning works the other way round: a checkpoint is renamed out
of sight (`.pruned-*`) before it is deleted, so a kill never leaves one that looks complete but
has lost files, nor one whose state.json went first (unlisted, so never pruned); a resume in
place deletes the checkpoints past its own the same way (run.folder.remove_checkpoints). Every rank
calls `save` and `load`; rank 0 alone touches the folders.

A disk without room for a checkpoint (too little free before it starts, or full while it is
written) is NoSpace, raised on every rank alike, its partial folder removed: the trainer goes on
training rather than lose the steps since the last checkpoint.

A checkpoint may come from anyone, and `load` runs nothing in it: DCP's own reader unpickles the
metadata with a plain unpickle and loads entries that are not tensors as full pickles (torch.load
with weights_only off), either of which runs what the file names. Here the metadata is unpickled
through the allow-list of run.checkpoint_pickle (the names DCP writes, as the real classes) and
every other entry with weights_only=True; anything else is refused in one line (a ConfigError),
before any of it runs.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import io
import json
import os
import pickle
import random
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from ..config import ConfigError
from ..run.checkpoint_pickle import ALLOWED, AllowListUnpickler, damaged, refusal, shard_problem
from ..run.checkpoint_folder import FORMAT_VERSION, TRAIN_STATE, check_checkpoint
from ..run.folder import CONFIG, DISK_FULL, list_checkpoints, remove_checkpoints, step_dirs
from ..run.safe_files import pinned_dir, write_whole
from .group import Group

LATEST = "latest"


class CheckpointError(RuntimeError):
    pass


class NoSpace(CheckpointError):
    """The disk has no room for the checkpoint: nothing of it is left behind."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def device_rng_state(device: torch.device) -> str | None:
    """This rank's CUDA generator, of the one GPU it trains on (None on a CPU)."""
    return _b64(torch.cuda.get_rng_state(device)) if device.type == "cuda" else None


def rng_state(device_states: list[str | None]) -> dict[str, Any]:
    """Every random state a resume restores: the host's (Python, NumPy, torch) once, and one CUDA
    generator per rank, `device_states[r]` for rank r's GPU. Not torch.cuda.get_rng_state_all():
    that is every GPU this process sees, which set_rng_state_all cannot restore where fewer are
    visible (a run moved from 2 GPUs to 1, or started with --gpu 1)."""
    np_state = np.random.get_state()
    state = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": _b64(torch.get_rng_state()),
    }
    if any(s is not None for s in device_states):
        state["cuda_by_rank"] = device_states
    return state


def device_rng_plan(state: dict[str, Any], rank: int, world: int, device: torch.device) -> tuple[str | None, str]:
    """The CUDA generator state rank `rank` of `world` restores onto `device`, and what is not
    exact ("" when all is). Older checkpoints kept `cuda` instead: every GPU the saving process
    saw, by CUDA index."""
    by_rank = state.get("cuda_by_rank")
    legacy = state.get("cuda")
    saved = len(by_rank) if by_rank is not None else len(legacy or [])
    if device.type != "cuda":
        return None, (f"the checkpoint's {saved} GPU random state(s) are not used on the CPU" if saved else "")
    if by_rank is not None:
        mine = by_rank[rank] if rank < len(by_rank) else None
        if mine is None:
            return None, f"rank {rank}'s GPU random state was not saved (the checkpoint has {saved}): it starts from the seed"
        dropped = len(by_rank) - world
        return mine, (f"the GPU random states of {dropped} rank(s) beyond the {world} now running are not used"
                      if dropped > 0 and rank == 0 else "")
    index = device.index or 0
    if legacy and index < len(legacy):
        return legacy[index], ""
    if legacy:
        return None, f"no GPU random state for cuda:{index} in the checkpoint (it has {saved}): it starts from the seed"
    return None, ""


def restore_rng_state(state: dict[str, Any], rank: int = 0, world: int = 1,
                      device: torch.device = torch.device("cpu")) -> str:
    """Restore what rng_state saved, for this rank's device; returns what could not be exact."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npst = state["numpy"]
    np.random.set_state((npst[0], np.asarray(npst[1], dtype=np.uint32), *npst[2:]))
    torch.set_rng_state(_unb64(state["torch"]))
    mine, note = device_rng_plan(state, rank, world, device)
    if mine is not None:
        torch.cuda.set_rng_state(_unb64(mine), device)
    return note


def estimate_bytes(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> int:
    """The checkpoint's size on disk: weights twice (train_state and model.safetensors) and the
    optimizer state (numel of a sharded tensor counts the whole: all ranks write to one disk)."""
    total = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    for opt in optimizers:
        for st in opt.state.values():
            total += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return total


def free_space_problem(folder: Path, need: int) -> str | None:
    """What stops a checkpoint of `need` bytes fitting in `folder`, or None."""
    free = shutil.disk_usage(folder).free
    if free >= need:
        return None
    return (f"not enough free disk for a checkpoint in {folder}: {free / 2**30:.2f} GiB free, about "
            f"{need / 2**30:.2f} GiB needed; free some space (older runs, checkpoint.keep)")


def _filled(ckpt_root: Path, e: OSError) -> str:
    """A full disk's error as what it stopped; any other error raised as it is."""
    if e.errno not in DISK_FULL:
        raise e
    return f"the disk filled while the checkpoint was written in {ckpt_root} ({e.strerror})"


def _agreed(group: Group, problem: str | None) -> None:
    """Rank 0's verdict on the disk, heard by every rank (each then raises it alike, rather than
    one raise while the others wait at the next barrier for ever)."""
    if (problem := group.gather(problem)[0]) is not None:
        raise NoSpace(problem)


def save(ckpt_root: Path, step: int, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
         state: dict[str, Any], config_toml: str, keep: int, group: Group = Group(), config_mode: int = 0o644) -> Path:
    """Write checkpoint `step` atomically; a checkpoint folder is self-contained (its own config,
    `config_mode`: 0600 where it holds notification URLs).
    Every rank calls this; each writes its shards, rank 0 the rest. Everything goes through a
    descriptor of `ckpt_root` opened once (safe_files.pinned_dir): a link another account plants at
    `checkpoints/` meanwhile never has the writes, nor the pruning, land in what it points to."""
    with contextlib.ExitStack() as pinned:
        root, problem = ckpt_root, None
        if group.is_main:
            try:
                root = pinned.enter_context(pinned_dir(ckpt_root))
                tmp = root / f".tmp-{step_dir_name(step)}"
                _clean_partial(root)
                # checked on the name, which is what the message shows: the same filesystem as `root`
                problem = free_space_problem(ckpt_root, int(estimate_bytes(model, optimizers) * 1.1) + (1 << 20))
                if problem is None:
                    tmp.mkdir()
            except OSError as e:
                problem = _filled(ckpt_root, e)
        _agreed(group, problem)  # every rank past here: tmp exists
        if not group.is_main:
            root = pinned.enter_context(pinned_dir(ckpt_root, make=False))
            tmp = root / f".tmp-{step_dir_name(step)}"
        device_states = group.gather(device_rng_state(next(model.parameters()).device))
        model_sd, optim_sd = get_state_dict(model, optimizers)
        try:
            with _dcp_errors():
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp / TRAIN_STATE,
                         no_dist=not _distributed())
        except NoSpace:
            if group.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        # The whole weights, gathered on rank 0 (a no-op for a model that is not sharded).
        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        problem = None
        if group.is_main:
            try:
                _commit(root, tmp, root / step_dir_name(step), step, weights, state, (config_toml, config_mode),
                        device_states, keep)
            except OSError as e:
                problem = _filled(ckpt_root, e)
                shutil.rmtree(tmp, ignore_errors=True)
        # An all-gather of rank 0's verdict, sent once its part is in place: no rank runs ahead into a
        # step (or a next save) before then, which a barrier here did as well.
        _agreed(group, problem)
    return ckpt_root / step_dir_name(step)


def _commit(ckpt_root: Path, tmp: Path, final: Path, step: int, weights: dict, state: dict[str, Any],
            config: tuple[str, int], device_states: list[str | None], keep: int) -> None:
    """Rank 0's part: the whole weights, config (its text and mode) and state into `tmp`, fsynced,
    renamed into place."""
    save_file({k: v.detach().contiguous() for k, v in weights.items()}, tmp / "model.safetensors")
    write_whole(tmp / CONFIG, config[0], mode=config[1])
    full_state = {"format": FORMAT_VERSION, "step": step, **state, "rng": rng_state(device_states)}
    (tmp / "state.json").write_text(json.dumps(full_state, indent=1))
    _test_hold(tmp, step)
    for f in tmp.rglob("*"):
        if f.is_file():
            _fsync_file(f)
    _fsync_dir(tmp / TRAIN_STATE)
    _fsync_dir(tmp)
    if final.exists():
        # This step is on disk already, the same weights: deleting it first would leave no
        # checkpoint at all if the process were killed before the rename.
        shutil.rmtree(tmp)
    else:
        os.rename(tmp, final)
        _fsync_dir(ckpt_root)
    _write_latest(ckpt_root, final.name)
    _prune(ckpt_root, keep)


def _test_hold(tmp: Path, step: int) -> None:
    """Tests only: with LMCOCKPIT_TEST_HOLD_CHECKPOINT=N, the checkpoint of step N announces that
    its files are written but not yet renamed into place, and waits there, so a test can kill the
    engine inside that window deterministically."""
    if os.environ.get("LMCOCKPIT_TEST_HOLD_CHECKPOINT") == str(step):
        (Path(os.path.realpath(tmp)).parent.parent / "checkpoint-held").write_text(tmp.name)  # tmp: pinned
        threading.Event().wait()


SPIKED = "spiked-"  # a checkpoint set aside: its weights gave a spike the run ended on


def set_aside_from(ckpt_root: Path, step: int) -> list[str]:
    """Rename the complete checkpoints at `step` and after out of the listing (`spiked-step_N`,
    kept for a look, never resumed from nor pruned) and point `latest` at the last one before;
    their names. Through a descriptor of `ckpt_root`, as a save is."""
    if not os.path.lexists(ckpt_root):
        return []
    with pinned_dir(ckpt_root, make=False) as root:
        moved = [path.name for at, path in step_dirs(root) if at >= step and (path / "state.json").is_file()]
        for name in moved:
            aside, n = root / f"{SPIKED}{name}", 1
            while os.path.lexists(aside):  # one set aside before, by an earlier stop at the same step
                aside, n = root / f"{SPIKED}{name}.{n}", n + 1
            os.rename(root / name, aside)
        if kept := list_checkpoints(root):
            _write_latest(root, kept[-1].name)
        else:
            (root / LATEST).unlink(missing_ok=True)
    return moved


def _write_latest(ckpt_root: Path, name: str) -> None:
    # Through a fresh mkstemp name, never a guessable one another account could plant a link at.
    write_whole(ckpt_root / LATEST, name + "\n", fsync=True)
    _fsync_dir(ckpt_root)  # the rename itself, durable


def _clean_partial(ckpt_root: Path) -> None:
    for p in ckpt_root.glob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True)
    # write_whole's leftovers from a kill, and those of the fixed names written before it.
    for pattern in (f".{LATEST}.*.tmp", f".{LATEST}.tmp-*"):
        for p in ckpt_root.glob(pattern):
            p.unlink(missing_ok=True)


def _prune(ckpt_root: Path, keep: int) -> None:
    remove_checkpoints(ckpt_root, list_checkpoints(ckpt_root)[:-keep],
                       hold=lambda name: _test_hold_prune(ckpt_root, name))


def _test_hold_prune(ckpt_root: Path, name: str) -> None:
    """Tests only: with LMCOCKPIT_TEST_HOLD_PRUNE=step_N, the deletion of that checkpoint announces
    that it is renamed out of sight but not yet deleted, and waits there, for a kill."""
    if os.environ.get("LMCOCKPIT_TEST_HOLD_PRUNE") == name:
        (Path(os.path.realpath(ckpt_root)).parent / "prune-held").write_text(name)  # ckpt_root: pinned
        threading.Event().wait()


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextlib.contextmanager
def _dcp_errors():
    """DCP raises CheckpointException, a BaseException that `except Exception` lets through: make
    it a CheckpointError naming the first rank's real error. And one process is not a mistake:
    DCP's warning that it runs without a process group is noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as e:
            rank, err = sorted(e.failures.items())[0]
            err = err[0] if isinstance(err, tuple) else getattr(err, "exc", err)  # (exception, its stack)
            if isinstance(err, ConfigError):  # a refusal (the allow-list's, an entry's): its one line says it all
                raise err from None
            if isinstance(err, OSError) and err.errno in DISK_FULL:
                raise NoSpace(f"the disk filled while rank {rank} wrote its shards ({err.strerror})") from None
            raise CheckpointError(f"rank {rank}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None


class _AllowListUnpickler(AllowListUnpickler):
    """The metadata's allowed names, as the real classes."""

    def resolve(self, module: str, name: str) -> Any:
        target, attr = ALLOWED[(module, name)].split(":")
        return getattr(importlib.import_module(target), attr)


def unpickle_metadata(file: BinaryIO, where: str) -> Metadata:
    """A DCP metadata pickle, unpickled through the allow-list (run.checkpoint_pickle): a
    ConfigError for one that names anything else, is damaged, or points outside its folder."""
    try:
        metadata = _AllowListUnpickler(file, where).load()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged pickle fails in any of a dozen ways
        raise ConfigError(damaged(where, e)) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise ConfigError(damaged(where, f"it holds a {type(metadata).__name__}, not a checkpoint's Metadata"))
    for info in metadata.storage_data.values():
        if problem := shard_problem(where, getattr(info, "relative_path", None)):
            raise ConfigError(problem)
    return metadata


class _CheckedReader(FileSystemReader):
    """DCP's file reader, its metadata read through the allow-list: DCP's own unpickles it with
    pickle.load, which runs whatever the file names."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        with self.fs.create_stream(path, "rb") as fh:
            metadata = unpickle_metadata(fh, f"{path.parent.parent}: {path.parent.name}/{path.name}")
        # As FileSystemReader.read_metadata leaves it.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _PlainDataPlanner(DefaultLoadPlanner):
    """DCP's load planner, its entries that are not tensors (optimizer settings: learning rates,
    betas, flags) loaded with weights_only=True: plain data only. DCP's own loads them with
    weights_only off, which runs whatever the entry's pickle names."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise ConfigError(self.refused(fqn, value)) from None
        # Where DefaultLoadPlanner.load_bytes puts it.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded

    def refused(self, fqn: str, value: io.BytesIO) -> str:
        """The entry's one line, naming what it holds beyond plain data where torch can tell
        (its own message is a page that suggests loading it anyway)."""
        where = f"{self.where} entry {fqn}"
        value.seek(0)
        try:
            names = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(value))
        except Exception:  # noqa: BLE001 - not torch.save's zip format: nothing more to name
            names = []
        if names:
            module, _, name = names[0].rpartition(".")
            return refusal(where, module, name)
        return f"{where} is not plain data: refused (nothing in it was run)"


def load(path: Path, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """Load weights and optimizer state into `model` and `optimizers` (resharded to however many
    processes hold them now); return state.json. Every rank calls this. Nothing in the checkpoint
    is run: its metadata is read through the allow-list, its other entries as plain data; its
    state.json and files are checked first (checkpoint_folder.check_checkpoint), as every reader's are."""
    check_checkpoint(path)
    model_sd, optim_sd = get_state_dict(model, optimizers)
    both = {"model": model_sd, "optim": optim_sd}
    reader = _CheckedReader(path / TRAIN_STATE)
    # Read once before DCP does, so a refusal is raised here as it is: inside dcp.load it would be
    # logged with a traceback, then retried on a rank's own metadata file, then wrapped.
    reader.read_metadata()
    with _dcp_errors():
        dcp.load(both, storage_reader=reader, planner=_PlainDataPlanner(f"{path}: {TRAIN_STATE}"),
                 no_dist=not _distributed())
    set_state_dict(model, optimizers, model_state_dict=both["model"], optim_state_dict=both["optim"])
    return json.loads((path / "state.json").read_text())

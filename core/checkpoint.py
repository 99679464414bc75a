"""Checkpoints that survive a kill at any moment.

`checkpoints/step_NNNNNN/` holds `model.safetensors`, `optimizer.pt` and `state.json`. It is
written into a temporary folder, every file fsynced, the folder renamed into place, and only then
is the `latest` pointer replaced (atomically, by rename). A kill at any point leaves either the
new checkpoint complete or the previous one untouched; leftover `.tmp-*` folders are ignored and
cleaned up by the next writer.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .resume import FORMAT_VERSION
from .runfolder import CONFIG, list_checkpoints

LATEST = "latest"


class CheckpointError(RuntimeError):
    pass


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


def rng_state() -> dict[str, Any]:
    b64 = lambda t: base64.b64encode(t.numpy().tobytes()).decode()  # noqa: E731
    np_state = np.random.get_state()
    state = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    unb64 = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)  # noqa: E731
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npst = state["numpy"]
    np.random.set_state((npst[0], np.asarray(npst[1], dtype=np.uint32), *npst[2:]))
    torch.set_rng_state(unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([unb64(s) for s in state["cuda"]])


def estimate_bytes(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for opt in optimizers:
        for st in opt.state.values():
            total += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return total


def check_free_space(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < need:
        raise CheckpointError(f"not enough free disk for a checkpoint in {folder}: {free / 2**30:.2f} GiB free, "
                              f"about {need / 2**30:.2f} GiB needed; free some space (older runs, "
                              "checkpoint.keep) and resume")


def save(ckpt_root: Path, step: int, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
         state: dict[str, Any], config_toml: str, keep: int) -> Path:
    """Write checkpoint `step` atomically; a checkpoint folder is self-contained (its own config)."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    _clean_partial(ckpt_root)
    check_free_space(ckpt_root, int(estimate_bytes(model, optimizers) * 1.1) + (1 << 20))
    final = ckpt_root / step_dir_name(step)
    tmp = ckpt_root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, tmp / "model.safetensors")
    torch.save([opt.state_dict() for opt in optimizers], tmp / "optimizer.pt")
    full_state = {"format": FORMAT_VERSION, "step": step, **state, "rng": rng_state()}
    (tmp / CONFIG).write_text(config_toml)
    (tmp / "state.json").write_text(json.dumps(full_state, indent=1))
    _test_hold(tmp, step)
    for f in tmp.iterdir():
        _fsync_file(f)
    _fsync_dir(tmp)
    if final.exists():  # a second save of the same step (checkpoint now, then the final one)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(ckpt_root)
    _write_latest(ckpt_root, final.name)
    _prune(ckpt_root, keep)
    return final


def _test_hold(tmp: Path, step: int) -> None:
    """Tests only: with LMCOCKPIT_TEST_HOLD_CHECKPOINT=N, the checkpoint of step N announces that
    its files are written but not yet renamed into place, and waits there, so a test can kill the
    engine inside that window deterministically."""
    if os.environ.get("LMCOCKPIT_TEST_HOLD_CHECKPOINT") == str(step):
        (tmp.parent.parent / "checkpoint-held").write_text(tmp.name)
        threading.Event().wait()


def _write_latest(ckpt_root: Path, name: str) -> None:
    tmp = ckpt_root / f".{LATEST}.tmp-{os.getpid()}"
    tmp.write_text(name + "\n")
    _fsync_file(tmp)
    os.replace(tmp, ckpt_root / LATEST)
    _fsync_dir(ckpt_root)


def _clean_partial(ckpt_root: Path) -> None:
    for p in ckpt_root.glob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in ckpt_root.glob(f".{LATEST}.tmp-*"):
        p.unlink(missing_ok=True)


def latest_step(ckpt_root: Path) -> int | None:
    found = list_checkpoints(ckpt_root)
    return int(found[-1].name.split("_")[1]) if found else None


def _prune(ckpt_root: Path, keep: int) -> None:
    for old in list_checkpoints(ckpt_root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load(path: Path, map_location: str | torch.device = "cpu") -> tuple[dict, list[dict], dict]:
    """(model weights, optimizer states, state.json) of one checkpoint folder."""
    weights = load_file(str(path / "model.safetensors"), device=str(map_location))
    opt_states = torch.load(path / "optimizer.pt", map_location=map_location, weights_only=True)
    state = json.loads((path / "state.json").read_text())
    return weights, opt_states, state

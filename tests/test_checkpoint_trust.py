"""A checkpoint from elsewhere is data, never code: pickles in it that would run something are
refused, in one line, by the front-end's check, the CLI, the engine's loader and the trainer,
and what they would have run never runs."""

from __future__ import annotations

import dataclasses
import os
import pickle
import shlex
import shutil
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict

from lmcockpit.core import protocol as P
from lmcockpit.core.config import ConfigError
from lmcockpit.core.run.checkpoint_pickle import ALLOWED, DTYPES
from lmcockpit.core.run.checkpoint_folder import check_checkpoint, checkpoint_config
from lmcockpit.core.run.folder import create_run_dir
from lmcockpit.core.run.resume import ResumePlan
from lmcockpit.core.train import checkpoint_io

from .helpers import SHIPPED, cli, drive_engine, model_and_optimizers

class RunsCommand:
    """Unpickled, runs `command` through the shell: what a crafted checkpoint would carry."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def touching(marker: Path) -> RunsCommand:
    return RunsCommand(f"touch {shlex.quote(str(marker))}")


def metadata_of(ckpt: Path):
    """The checkpoint's metadata as DCP reads it: plain pickle, fine for one this suite wrote."""
    return pickle.loads((ckpt / "train_state" / ".metadata").read_bytes())


def write_metadata(ckpt: Path, metadata) -> None:
    (ckpt / "train_state" / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.fixture
def copied(trained_run, tmp_path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained_run[0] / "checkpoints" / SHIPPED, ckpt)
    return ckpt


@pytest.fixture
def crafted(copied, tmp_path) -> tuple[Path, Path]:
    """A copy whose metadata is whole, a Metadata to any plain reader, with a command inside that
    touches the marker file; (checkpoint, marker)."""
    marker = tmp_path / "ran"
    metadata = metadata_of(copied)
    metadata.storage_meta.modules = [touching(marker)]
    write_metadata(copied, metadata)
    return copied, marker


def assert_refused_in_one_line(message: str, ckpt: Path, where: str, names: str = "posix.system") -> None:
    assert message == (f"{ckpt}: {where} names {names}, which no lmcockpit checkpoint holds: refused (nothing in "
                       "it was run)"), message


def test_a_metadata_that_runs_a_command_is_refused_by_the_check(crafted):
    ckpt, marker = crafted
    # The premise: DCP's own reader unpickles the metadata with pickle.load, and runs it.
    FileSystemReader(ckpt / "train_state").read_metadata()
    assert marker.exists()
    marker.unlink()
    with pytest.raises(ConfigError) as refused:
        check_checkpoint(ckpt)
    assert_refused_in_one_line(str(refused.value), ckpt, "train_state/.metadata")
    assert not marker.exists()


@pytest.mark.slow
def test_the_check_imports_nothing_a_metadata_names(crafted, trained_run):
    """Not even torch: the check gives each allowed name a stand-in, and refuses the rest unlooked-up."""
    ckpt, marker = crafted
    real = trained_run[0] / "checkpoints" / SHIPPED
    probe = ("import sys\n"
             "from pathlib import Path\n"
             "from lmcockpit.core.config import ConfigError\n"
             "from lmcockpit.core.run.checkpoint_folder import check_checkpoint\n"
             f"assert check_checkpoint(Path({str(real)!r})) == 6\n"
             "try:\n"
             f"    check_checkpoint(Path({str(ckpt)!r}))\n"
             "except ConfigError as e:\n"
             "    print(e)\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    refused, imported = proc.stdout.splitlines()
    assert_refused_in_one_line(refused, ckpt, "train_state/.metadata")
    assert imported == "[]" and not marker.exists()


@pytest.mark.slow
def test_a_metadata_that_runs_a_command_is_refused_by_resume_before_any_engine(crafted, tmp_path):
    ckpt, marker = crafted
    out = tmp_path / "continued"
    proc = cli("--run", "--resume", str(ckpt), "--out", str(out))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error:"), proc.stderr
    assert "names posix.system, which no lmcockpit checkpoint holds: refused (nothing in it was run)" in errors[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not marker.exists() and not out.exists()


def test_a_metadata_that_runs_a_command_is_refused_by_the_engines_loader(crafted):
    ckpt, marker = crafted
    model, optimizers = model_and_optimizers(ckpt)
    with pytest.raises(ConfigError) as refused:
        checkpoint_io.load(ckpt, model, optimizers)
    assert_refused_in_one_line(str(refused.value), ckpt, "train_state/.metadata")
    assert not marker.exists()


@pytest.mark.slow
def test_a_metadata_that_runs_a_command_and_reaches_the_engine_fails_it_in_one_line(crafted, tmp_path):
    """Past the front-end's check somehow (a plan made without it): the trainer refuses it with
    the same line, a user error (exit 2), not a traceback."""
    ckpt, marker = crafted
    cfg = checkpoint_config(ckpt)
    plan = ResumePlan(cfg, create_run_dir(cfg, "test", str(tmp_path / "out")), ckpt, 6, in_place=False)
    engine, events = drive_engine(cfg, plan.run_dir, resume=plan)
    failures = [e for e in events if isinstance(e, P.Failure)]
    assert engine.final_state == P.FAILED and len(failures) == 1, events
    assert failures[0].user_error and not failures[0].traceback
    assert_refused_in_one_line(failures[0].message, ckpt, "train_state/.metadata")
    assert not marker.exists()


@pytest.fixture
def crafted_entry(copied, tmp_path) -> tuple[Path, Path]:
    """A copy whose train_state DCP's own writer wrote from a state dict holding, as a learning
    rate, an object that runs a command when unpickled; (checkpoint, marker)."""
    marker = tmp_path / "ran"
    model, optimizers = model_and_optimizers(copied)
    model_sd, optim_sd = get_state_dict(model, optimizers)
    optim_sd["param_groups"][0]["lr"] = touching(marker)
    shutil.rmtree(copied / "train_state")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=copied / "train_state", no_dist=True)
    return copied, marker


@pytest.mark.slow
def test_an_entry_that_runs_a_command_is_refused_by_the_engines_loader(crafted_entry):
    ckpt, marker = crafted_entry
    # The premise: DCP's own planner loads an entry that is no tensor with weights_only=False,
    # and runs it.
    model, optimizers = model_and_optimizers(ckpt)
    model_sd, optim_sd = get_state_dict(model, optimizers)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt / "train_state", no_dist=True)
    assert marker.exists()
    marker.unlink()
    check_checkpoint(ckpt)  # its metadata is DCP's own: nothing in it to refuse
    model, optimizers = model_and_optimizers(ckpt)
    with pytest.raises(ConfigError) as refused:
        checkpoint_io.load(ckpt, model, optimizers)
    assert_refused_in_one_line(str(refused.value), ckpt, "train_state entry optim.param_groups.0.lr")
    assert not marker.exists()


@pytest.mark.parametrize("damage", [
    lambda data: data[:len(data) // 2],  # cut short
    lambda data: b"this is not a pickle at all",
    lambda data: pickle.dumps({"state_dict_metadata": {}}),  # a pickle, of something else
])
def test_a_damaged_metadata_is_one_line_from_the_check_and_the_loader(copied, damage):
    path = copied / "train_state" / ".metadata"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ConfigError) as checked:
        check_checkpoint(copied)
    with pytest.raises(ConfigError) as loaded:
        checkpoint_io.load(copied, *model_and_optimizers(copied))
    for refused in (checked, loaded):
        message = str(refused.value)
        assert message.startswith(f"{copied}: train_state/.metadata is not a checkpoint's metadata (")
        assert message.endswith("); the checkpoint is damaged") and "\n" not in message


def test_a_metadata_pointing_outside_its_folder_is_refused(copied):
    """A shard named ../state.json would have the load read any file the user can (a FIFO: for ever)."""
    metadata = metadata_of(copied)
    metadata.storage_data = {k: dataclasses.replace(v, relative_path="../state.json")
                             for k, v in metadata.storage_data.items()}
    write_metadata(copied, metadata)
    expected = (f"{copied}: train_state/.metadata points to the shard file '../state.json', outside its own "
                "folder: refused")
    for attempt in (lambda: check_checkpoint(copied), lambda: checkpoint_io.load(copied, *model_and_optimizers(copied))):
        with pytest.raises(ConfigError) as refused:
            attempt()
        assert str(refused.value) == expected


@pytest.mark.slow
def test_a_metadata_written_under_python_3_13_is_read_by_both(copied, monkeypatch):
    """Python 3.13 pickles PosixPath from pathlib._local, which older Pythons lack: both readers
    take it as this Python's pathlib.PosixPath (DCP's own reader fails on it here)."""
    written_by_313 = types.ModuleType("pathlib._local")
    written_by_313.PosixPath = type("PosixPath", (Path(".").__class__,), {"__module__": "pathlib._local"})
    monkeypatch.setitem(sys.modules, "pathlib._local", written_by_313)
    metadata = metadata_of(copied)
    metadata.storage_meta.checkpoint_id = written_by_313.PosixPath("/where/it/was/written")
    write_metadata(copied, metadata)
    assert b"pathlib._local" in (copied / "train_state" / ".metadata").read_bytes()
    monkeypatch.delitem(sys.modules, "pathlib._local")
    with pytest.raises(ModuleNotFoundError):
        FileSystemReader(copied / "train_state").read_metadata()
    assert check_checkpoint(copied) == 6
    checkpoint_io.load(copied, *model_and_optimizers(copied))
    with open(copied / "train_state" / ".metadata", "rb") as fh:
        read = checkpoint_io.unpickle_metadata(fh, "here")
    assert type(read.storage_meta.checkpoint_id) is Path(".").__class__


class Recording(pickle.Unpickler):
    """Plain unpickling (of a checkpoint this suite wrote), noting each global it looks up."""

    def __init__(self, file):
        super().__init__(file)
        self.found: set[tuple[str, str]] = set()

    def find_class(self, module, name):
        self.found.add((module, name))
        return super().find_class(module, name)


def test_the_allow_list_is_what_dcp_writes(trained_run):
    """Every name a real checkpoint's metadata holds is allowed, and every allowed name but the
    dtypes a tiny run does not use (and 3.13's other home of PosixPath) is one it holds."""
    found = set()
    for ckpt in sorted((trained_run[0] / "checkpoints").glob("step_*")):
        with open(ckpt / "train_state" / ".metadata", "rb") as fh:
            recording = Recording(fh)
            recording.load()
        found |= recording.found
        check_checkpoint(ckpt)
    assert found <= ALLOWED.keys(), found - ALLOWED.keys()
    expected = {k for k in ALLOWED if not (k[0] == "torch" and k[1] in DTYPES) and k[0] != "pathlib._local"}
    assert expected <= found, expected - found
    # Each dtype by the name torch pickles it as (the CI's torch, 2.13, defines them all).
    assert all(getattr(torch, d).__reduce__() == d for d in DTYPES)

"""The folders a run writes into (#50, 3): a run folder another account can write, where that
account plants a link at `checkpoints/`, `tensorboard/`, `nan_debug/`, `wandb/` or `tokenizer/`
pointing to a folder of the user's that only the user may write. Without the checks, the run wrote
its checkpoints there and pruned (deleted) old step folders and whatever else lay there, wrote
`latest` over the victim's, and TensorBoard's event files landed in it. The other account acts for
real (tests/other_account.py), the engine and the CLI are the real ones.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from lmcockpit.core import protocol as P
from lmcockpit.core.config import ConfigError
from lmcockpit.core.run.folder import (CHECKPOINTS, NAN_DEBUG, RUN_FOLDERS, TENSORBOARD, create_run_dir,
                                      hold_run_dir, list_checkpoints)
from lmcockpit.core.run.safe_files import NotOwnFile, pinned_dir
from lmcockpit.core.train import checkpoint_io, nan_debug

from .helpers import cli, drive_engine, tiny_config
from .other_account import other_account, run_as_other

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def shared() -> Path:
    """A folder in /tmp that every account may write in, as a lab's shared scratch space is."""
    path = Path(tempfile.mkdtemp(prefix="lmcockpit-links-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def victim(shared) -> Path:
    """A folder of the user's that no other account may enter, holding what a pruning or a
    checkpoint would destroy: a step folder, notes, a backup, and a `latest` of its own."""
    path = shared / "private"
    path.mkdir(mode=0o700)
    (path / "step_000001").mkdir()
    (path / "step_000001" / "state.json").write_text('{"step": 1}')
    (path / ".tmp-notes").mkdir()
    (path / ".tmp-notes" / "notes.txt").write_text("notes")
    (path / ".pruned-backup").mkdir()
    (path / ".pruned-backup" / "data.bin").write_bytes(b"\0" * 10)
    (path / "latest").write_text("mine\n")
    return path


def snapshot(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def writable_run(shared: Path, *overrides: str) -> Path:
    run = create_run_dir(tiny_config(*overrides), "test", str(shared / "run"))
    run.chmod(0o777)
    return run


def plant_link(run: Path, name: str, target: Path) -> None:
    """As the other account: `run/name` made a link to `target` (a folder it has never seen inside)."""
    def plant(where: str, to: str) -> None:
        if os.path.lexists(where):  # the user's own folder: renamed away (allowed in a folder it can write)
            os.rename(where, where + ".old")
        os.symlink(to, where)
    run_as_other(plant, str(run / name), str(target))


@pytest.mark.parametrize("name", RUN_FOLDERS)
def test_a_link_planted_at_a_folder_the_run_writes_stops_it_in_one_line(shared, victim, name):
    run = writable_run(shared)
    before = snapshot(victim)
    plant_link(run, name, victim)
    with pytest.raises(ConfigError, match=f"{name}: a symbolic link where lmcockpit keeps a folder of its own"):
        hold_run_dir(run)
    assert snapshot(victim) == before


def test_a_folder_another_account_made_at_checkpoints_stops_the_run(shared):
    run = writable_run(shared)
    run_as_other(os.mkdir, str(run / CHECKPOINTS))
    with pytest.raises(ConfigError, match=f"{CHECKPOINTS}: owned by uid {other_account().pw_uid}"):
        hold_run_dir(run)


def test_a_checkpoint_never_writes_nor_prunes_through_a_link_planted_once_the_run_started(shared, victim):
    """The run held its folder before the link came: its next checkpoint refuses to write, and
    deletes nothing in the folder the link names."""
    run = writable_run(shared)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    checkpoint_io.save(run / CHECKPOINTS, 1, model, [optimizer], {"tokens_seen": 0}, "", keep=1)
    before = snapshot(victim)
    plant_link(run, CHECKPOINTS, victim)
    with pytest.raises(NotOwnFile, match="a symbolic link"):
        checkpoint_io.save(run / CHECKPOINTS, 2, model, [optimizer], {"tokens_seen": 0}, "", keep=1)
    assert snapshot(victim) == before
    # the run's own checkpoint, where the other account moved it, kept whole
    assert [p.name for p in list_checkpoints(run / f"{CHECKPOINTS}.old")] == ["step_000001"]


def test_what_goes_through_a_pinned_folder_stays_there_when_a_link_replaces_it(shared, victim):
    """The window between the check and the writes: a link swapped in at the name while a
    checkpoint is being written changes nothing about where the writes and deletions land."""
    run = writable_run(shared)
    before = snapshot(victim)
    with pinned_dir(run / CHECKPOINTS) as at:
        (at / "step_000003").mkdir()
        plant_link(run, CHECKPOINTS, victim)
        (at / "step_000003" / "state.json").write_text("{}")
        (at / "latest").write_text("step_000003\n")
        shutil.rmtree(at / "step_000003")
    assert snapshot(victim) == before
    assert (run / f"{CHECKPOINTS}.old" / "latest").read_text() == "step_000003\n"


def test_a_nan_report_refuses_a_link_at_nan_debug(shared, victim):
    run = writable_run(shared)
    before = snapshot(victim)
    plant_link(run, NAN_DEBUG, victim)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(NotOwnFile, match=f"{NAN_DEBUG}: a symbolic link"):
        nan_debug.dump(run, 7, model, [(torch.zeros(1, 2), torch.zeros(1, 2))], float("nan"), 1.0, 0.1)
    assert snapshot(victim) == before


@pytest.mark.slow
@pytest.mark.parametrize("name,overrides", [(CHECKPOINTS, ()), (TENSORBOARD, ("logging.tensorboard=true",))])
def test_the_engine_refuses_a_link_planted_before_it_starts_and_writes_nothing_there(shared, victim, name,
                                                                                     overrides):
    cfg = tiny_config("training.max_steps=4", "checkpoint.every=2", "eval.every=0", *overrides)
    run = writable_run(shared, "training.max_steps=4")
    before = snapshot(victim)
    plant_link(run, name, victim)
    engine, _ = drive_engine(None, None, resume=_Plan(cfg, run))
    assert engine.final_state == P.FAILED and engine.failure is not None and engine.failure.user_error
    assert f"{name}: a symbolic link" in engine.failure.message
    assert snapshot(victim) == before


class _Plan:
    """What drive_engine takes to start on a folder made already (a resume plan's fields)."""

    def __init__(self, cfg, run_dir):
        self.cfg, self.run_dir, self.checkpoint = cfg, run_dir, None


@pytest.mark.slow
def test_a_resume_in_place_refuses_a_link_at_checkpoints_in_one_line(shared, victim, trained_run):
    """`--resume` of a run folder where the other account replaced checkpoints/ by a link: one
    line, exit 2, and the later checkpoints a resume in place deletes are not looked for there."""
    source, made = trained_run
    assert made.returncode == 0, made.stdout + made.stderr
    run = shared / "copied"
    shutil.copytree(source, run)
    run.chmod(0o777)
    before = snapshot(victim)
    plant_link(run, CHECKPOINTS, victim)
    proc = cli("--run", "--resume", str(run), "--set", "training.max_steps=20")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"{CHECKPOINTS}: a symbolic link" in proc.stderr
    assert snapshot(victim) == before


def test_tensorboard_s_event_files_stay_in_the_folder_it_opened_when_a_link_replaces_it(shared, victim):
    from lmcockpit.core.train.loggers import TensorBoardLogger

    run = writable_run(shared)
    before = snapshot(victim)
    logger = TensorBoardLogger(run, 0)
    plant_link(run, TENSORBOARD, victim)
    logger.write(1, {"train/loss": 3.0})
    logger.close(failed=False)
    assert snapshot(victim) == before
    assert list((run / f"{TENSORBOARD}.old").glob("events.out.tfevents.*"))

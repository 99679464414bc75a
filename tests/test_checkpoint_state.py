"""A checkpoint's extras from elsewhere (#50, 6): a FIFO in place of a shard once hung `--resume`
past SIGTERM; a state.json with a negative step, a random state of the wrong type or no
`tokens_seen` gave the engine a traceback (exit 1); chat, export and eval took `step: 2**70` or
`-5` without a word. Each is one line now (exit 2), from the front-end's check and the engine's
loader alike."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from lmcockpit.core.config import ConfigError
from lmcockpit.core.run.checkpoint_folder import STATE, TRAIN_STATE, check_checkpoint
from lmcockpit.core.train import checkpoint_io

from .helpers import SHIPPED, cli, model_and_optimizers


@pytest.fixture
def copied(trained_run, tmp_path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained_run[0] / "checkpoints" / SHIPPED, ckpt)
    return ckpt


def one_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: "), proc.stderr
    return errors[0]


def a_shard(ckpt: Path) -> Path:
    return next(p for p in (ckpt / TRAIN_STATE).iterdir() if p.suffix == ".distcp")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["a FIFO", "a link"])
def test_a_shard_that_is_no_regular_file_is_refused_not_waited_on(copied, tmp_path, how):
    shard = a_shard(copied)
    kept = tmp_path / "kept.distcp"
    shard.rename(kept)
    if how == "a FIFO":
        os.mkfifo(shard)
    else:
        shard.symlink_to(kept)
    kind = "a symbolic link" if how == "a link" else "not a regular file"
    expected = f"{copied}: {TRAIN_STATE}/{shard.name} is {kind}: refused"
    with pytest.raises(ConfigError, match=expected):
        check_checkpoint(copied)
    with pytest.raises(ConfigError, match=expected):
        checkpoint_io.load(copied, *model_and_optimizers(copied))
    # the CLI: a FIFO once held it for ever (the timeout fails the test)
    line = one_error_line(cli("--run", "--resume", str(copied), "--out", str(tmp_path / "out"), timeout=120))
    assert expected in line and not (tmp_path / "out").exists()


def damage_state(ckpt: Path, change) -> None:
    path = ckpt / STATE
    state = json.loads(path.read_text())
    change(state)
    path.write_text(json.dumps(state))


DAMAGE = {
    "negative step": (lambda s: s.update(step=-5), "step is not a step"),
    "step 2**70": (lambda s: s.update(step=2**70), "step is not a step"),
    "step text": (lambda s: s.update(step="6"), "step is not a step"),
    "no tokens_seen": (lambda s: s.pop("tokens_seen"), "no tokens_seen"),
    "rng text": (lambda s: s.update(rng="random"), "rng is not the random states"),
    "rng of numbers": (lambda s: s["rng"].update(python=[3, "abc", None]), "rng is not the random states"),
    "world 0": (lambda s: s.update(world=0), "world is not a count of processes"),
    "data_unit text": (lambda s: s.update(data_unit="8x1"), "data_unit is not"),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_state_json_a_resume_cannot_read_is_refused_by_the_check_and_the_loader(copied, damage):
    change, words = DAMAGE[damage]
    damage_state(copied, change)
    for attempt in (lambda: check_checkpoint(copied), lambda: checkpoint_io.load(copied, *model_and_optimizers(copied))):
        with pytest.raises(ConfigError) as refused:
            attempt()
        message = str(refused.value)
        assert message.startswith(f"{copied}: {STATE}: {words}") and "\n" not in message, message
        assert message.endswith("the checkpoint is damaged, or not lmcockpit's")


@pytest.mark.slow
@pytest.mark.parametrize("command", [
    ("--run", "--resume", "{ckpt}", "--out", "{out}"),
    ("chat", "{ckpt}", "--prompt", "def "),
    ("export", "{ckpt}", "{out}"),
    ("eval", "{ckpt}", "--max-per-task", "2"),
], ids=["resume", "chat", "export", "eval"])
@pytest.mark.parametrize("step", [2**70, -5])
def test_every_reader_of_a_checkpoint_refuses_a_step_out_of_range_in_one_line(copied, tmp_path, command, step):
    damage_state(copied, lambda s: s.update(step=step))
    args = [a.format(ckpt=copied, out=tmp_path / "out") for a in command]
    line = one_error_line(cli(*args))
    assert f"{copied}: {STATE}: step is not a step" in line, line
    assert not (tmp_path / "out").exists()

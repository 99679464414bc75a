"""A disk that fills in the middle of a run, met by the real engine on a real filesystem of its own
(a small tmpfs): training goes on, no metrics row is lost, train.log says what it missed, and the
last checkpoint waits for room rather than end the run without it."""

from __future__ import annotations

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.run.folder import CHECKPOINTS, METRICS, TRAIN_LOG, list_checkpoints, read_metrics

from .helpers import drive_engine, fill, tiny_config

pytestmark = pytest.mark.slow


def full_run(disk, when_waiting, *overrides: str):
    """A tiny run of 12 steps on `disk`, checkpointing every 6, paused before its first step while
    the disk is filled; `when_waiting(engine, filler)` once its last checkpoint waits for room."""
    filler = None
    lines: list[str] = []

    def on_event(engine, ev):
        nonlocal filler
        if isinstance(ev, P.StateChanged) and ev.state == P.PAUSED and filler is None:
            filler = fill(disk, disk / "run" / METRICS, disk / "run" / TRAIN_LOG)
            engine.send(P.Resume())
        if isinstance(ev, P.LogLine):
            lines.append(ev.text.removeprefix("rank0: "))
            if lines[-1].startswith("checkpoint: waiting for disk space") and filler.exists():
                when_waiting(engine, filler)

    engine, events = drive_engine(tiny_config("checkpoint.every=6", *overrides), disk / "run", on_event,
                                  queued=[P.Pause()])
    return disk / "run", events, lines


def final_state(events) -> str:
    return [e.state for e in events if isinstance(e, P.StateChanged)][-1]


def test_a_disk_that_fills_mid_run_costs_no_step_no_row_and_not_the_last_checkpoint(small_disk):
    """Under two processes (DDP on gloo): every rank hears rank 0's verdict on the disk alike, where
    one that raised alone would leave the other waiting for it in a collective for good. (One
    process: the next test.)"""
    def free_it(engine, filler):
        filler.unlink()
        engine.send(P.CheckpointNow())  # try again now, not in 30 s

    run, events, lines = full_run(small_disk, free_it, "distributed.nproc=2")
    assert final_state(events) == P.FINISHED
    assert [e.step for e in events if isinstance(e, P.StepMetrics)] == list(range(1, 13))
    # The checkpoint at step 6 found no room: said, and training went on.
    assert any(line.startswith("warning: checkpoint of step 6 not written: not enough free disk") and
               line.endswith("the last written is none; training goes on") for line in lines), lines
    assert [p.name for p in list_checkpoints(run / CHECKPOINTS)] == ["step_000012"]
    assert not [p.name for p in (run / CHECKPOINTS).iterdir() if p.name.startswith(".")]
    # Every row made while the disk was full reached metrics.jsonl once there was room again.
    assert [r["step"] for r in read_metrics(run, "step")] == list(range(1, 13))
    assert [r["step"] for r in read_metrics(run, "eval")] == [6, 12]
    assert [r["step"] for r in read_metrics(run, "checkpoint")] == [12]
    # train.log lost the lines of those steps, and says so where they are missing (more than once
    # where a failed checkpoint's removal freed a little room for a while); all is written after.
    log = (run / TRAIN_LOG).read_text()
    assert "lines missing here: the disk was full]" in log
    assert "checkpoint: step 12 written to" in log.rsplit("lines missing here", 1)[1]


def test_an_abort_without_saving_gives_up_the_last_checkpoint_that_waits_for_room(small_disk):
    run, events, lines = full_run(small_disk, lambda engine, filler: engine.send(P.Abort(save=False)))
    assert final_state(events) == P.ABORTED
    assert [e.step for e in events if isinstance(e, P.StepMetrics)] == list(range(1, 13))
    assert any(line.startswith("warning: checkpoint of step 6 not written: not enough free disk") for line in lines)
    assert "checkpoint: step 12 given up, not written; the last written is none" in lines
    assert list_checkpoints(run / CHECKPOINTS) == []


def test_a_token_cache_that_fills_its_disk_says_so_and_where(small_disk, tmp_path):
    """Out of room in a worker's shard: a message naming the cache's disk and the cure, not the
    worker's traceback; the pieces finished stay for the next preparation."""
    from lmcockpit.core.config import ConfigError
    from lmcockpit.core.data.prepare import prepare

    from .helpers import records, write_jsonl

    source = write_jsonl(tmp_path / "corpus.jsonl", records(3000))
    cfg = tiny_config(f"data.source=\"{source}\"", f"data.cache_dir=\"{small_disk / 'cache'}\"", "data.workers=2",
                      "tokenizer.vocab_size=300", "tokenizer.train_bytes=100_000", "data.shard_bytes=100_000")
    filled = []

    def progress(stage, done, total, unit):
        if stage == "tokenizing" and not filled:
            filled.append(fill(small_disk))

    with pytest.raises(ConfigError, match=rf"^data: the disk holding the token cache is full \({small_disk / 'cache'}: "
                                          r"No space left on device\); free some space there, or point data.cache_dir"):
        prepare(cfg, lambda line: None, progress)
    filled[0].unlink()
    assert prepare(cfg, lambda line: None, lambda *a: None).train is not None

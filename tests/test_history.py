"""The bounded history (core/run/history.py) and its summary beside metrics.jsonl (history_file.py):
at every resolution the same minimum, maximum and mean as a direct computation over the raw rows;
the last steps and every evaluation exact; a run that went back (a rollback in the file, a resume
that dropped rows) the same as if built from scratch; the size the same at 100k and 1M rows."""

from __future__ import annotations

import gc
import json
import math
import random
import sys
import types

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.run import history_file
from lmcockpit.core.run.rows import event_of
from lmcockpit.core.run.folder import METRICS, MetricsLog
from lmcockpit.core.run.history import CAP, TAIL_MIN, History
from lmcockpit.core.run.resume import truncate_metrics


def losses(n: int, seed: int = 0) -> list[tuple[int, float]]:
    rng = random.Random(seed)
    return [(s, 3 + 5 / math.sqrt(s) + rng.random() * 0.2) for s in range(1, n + 1)]


def step_row(step: int, loss: float) -> dict:
    """A step row as the engine writes it (trainer.py through MetricsLog)."""
    return {"kind": "step", "time": 1.7e9 + step, "step": step, "loss": loss, "lr": 1e-3 * (1 + step % 7),
            "grad_norm": 0.5, "tokens_per_s": 1000.0 + step % 13, "dt": 0.25 + step % 3 / 100, "mfu": None,
            "mem": {"allocated": 1, "peak": 2}}


def eval_row(step: int) -> dict:
    return {"kind": "eval", "time": 1.7e9 + step, "step": step, "val_loss": 3 + 1 / step, "val_bpb": 1.0,
            "tasks": {"piqa": {"accuracy": 0.5 + step / 1e7, "centered": 0.0, "items": 10}}}


def fold(rows: list[dict], checkpoint_every: int = 0) -> History:
    h = History()
    for row in rows:
        h.fold(row)
        if checkpoint_every and row["kind"] == "step" and row["step"] % checkpoint_every == 0:
            h.fold({"kind": "checkpoint", "step": row["step"], "path": f"step_{row['step']}"})
    return h


def run_rows(n: int, eval_every: int = 250, checkpoint_every: int = 1000, seed: int = 0) -> list[dict]:
    rows = []
    for s, loss in losses(n, seed):
        rows.append(step_row(s, loss))
        if s % eval_every == 0:
            rows.append(eval_row(s))
        if s % checkpoint_every == 0:
            rows.append({"kind": "checkpoint", "time": 1.7e9 + s, "step": s, "path": f"step_{s}"})
    return rows


def curve(h: History) -> list:
    """What a chart can show of `h`: every resolution, the exact rows, the evaluations."""
    return [[h.resolution(m) for m in range(5)], h.recent(), h.evals, h.tasks, h.checkpoints, h.count, h.last_step,
            h.loss, h.ema, h.time]


def test_every_resolution_is_a_direct_computation_over_the_rows():
    rows = run_rows(100_000)
    h = fold(rows)
    steps = [r for r in rows if r["kind"] == "step"]
    assert 1 < h.width and CAP // 2 <= len(h.resolution(0)) <= CAP
    for m in range(5):
        width = h.width * 2**m
        groups: dict[int, list[dict]] = {}
        for r in steps:
            groups.setdefault(r["step"] // width, []).append(r)
        points = h.resolution(m)
        assert len(points) == len(groups)
        for point, (_, rs) in zip(points, sorted(groups.items())):
            ls = [r["loss"] for r in rs]
            assert point.n == len(rs) and (point.first_step, point.last_step) == (rs[0]["step"], rs[-1]["step"])
            assert point.loss_min == min(ls) and point.loss_max == max(ls)
            assert point.loss == pytest.approx(sum(ls) / len(ls), rel=1e-12)
            assert point.step == pytest.approx(sum(r["step"] for r in rs) / len(rs), rel=1e-12)
            assert point.lr == pytest.approx(sum(r["lr"] for r in rs) / len(rs), rel=1e-12)
    # The smoothed loss carried forward is the EMA over every row; the last rows and evaluations exact.
    ema = 0.0
    for i, r in enumerate(steps, 1):
        ema = 0.9 * ema + 0.1 * r["loss"]
    assert h.ema == pytest.approx(ema / (1 - 0.9 ** len(steps)), rel=1e-9)
    assert [(r.step, r.loss) for r in h.recent()][-TAIL_MIN:] == [(r["step"], r["loss"]) for r in steps[-TAIL_MIN:]]
    assert h.time == pytest.approx(sum(r["dt"] for r in steps), rel=1e-9)
    evals = [r for r in rows if r["kind"] == "eval"]
    assert h.evals == [(r["step"], r["val_loss"], r["val_bpb"]) for r in evals]
    assert h.tasks["piqa"] == [(r["step"], r["tasks"]["piqa"]["accuracy"]) for r in evals]


def test_a_chart_gets_at_most_the_points_it_asks_for_exact_rows_where_they_fit():
    h = fold(run_rows(100_000))
    for most in (1, 80, 240, 1000):
        points = h.points(most)
        assert 0 < len(points) <= most and points[0].first_step == 1 and points[-1].last_step == 100_000
        assert sum(p.n for p in points) == 100_000
    short = fold(run_rows(300))
    assert [(p.step, p.loss) for p in short.points(600)] == [(r.step, r.loss) for r in short.recent()]
    zoomed = h.points(200, lo=90_000, hi=95_000)
    assert len(zoomed) <= 200 and zoomed[0].first_step <= 90_000 <= zoomed[0].last_step + h.width
    assert zoomed[-1].last_step >= 95_000 and all(p.last_step - p.first_step < 64 for p in zoomed)


@pytest.mark.slow
def test_a_rollback_folds_as_if_the_redone_steps_were_never_there():
    """A rollback goes back to the last checkpoint and redoes the steps after it on other batches:
    metrics.jsonl holds both. The rows since that checkpoint are in the exact tail, so the cut
    is exact: the history equals the one folded from the rows that stand, spikes kept."""
    rows = run_rows(49_700)  # checkpoints every 1000: the last at 49,000
    redone = [dict(r, loss=r["loss"] + 1) if r["kind"] == "step" else r
              for r in run_rows(60_000, seed=1) if r["step"] > 49_000]
    spike = {"kind": "spike", "time": 0, "step": 49_700, "loss": 99.0, "mean_loss": 3.0, "z": 9.0,
             "grad_norm": 1.0, "z_grad": None, "action": "rollback"}
    live = fold(rows + [spike] + redone)
    reference = fold([r for r in rows if r["step"] <= 49_000] + redone)
    assert curve(live) == curve(reference)
    assert live.spikes == [(49_700, 99.0, "rollback")]
    # Behind the rows the tail keeps, a cut cannot be undone in place, and says so.
    assert not fold(run_rows(20_000)).cut(3000)


def write_metrics(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.slow
def test_a_folder_read_whole_or_from_its_summary_is_the_same_history(tmp_path):
    rows = run_rows(30_000, checkpoint_every=40_000)  # no checkpoint: a rollback behind the tail
    redone = [r for r in run_rows(35_000, seed=1) if r["step"] > 5_000]
    write_metrics(tmp_path / METRICS, rows + redone)
    reference = fold([r for r in rows if r["step"] <= 5_000] + redone)
    whole, offset, _ = history_file.load(tmp_path)
    assert curve(whole) == curve(reference)
    assert offset == (tmp_path / METRICS).stat().st_size
    assert (tmp_path / history_file.SUMMARY).is_file()  # written for the next reader: 35k rows were folded
    # More rows, and a row being written: the summary plus the rows after it, not the half line.
    more = run_rows(36_000, seed=2)[-1200:]
    with open(tmp_path / METRICS, "a") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in more) + '{"kind": "step", "ste')
    again, _, _ = history_file.load(tmp_path)
    assert curve(again) == curve(fold([r for r in rows if r["step"] <= 5_000] + redone + more))


@pytest.mark.slow
def test_a_folder_s_rows_fold_as_read_metrics_reads_them_one_by_one(tmp_path):
    """An older run's first reading folds every row, each through the one reader of rows
    (rows.read: orjson, and json for the NaN it refuses). A folder of the engine's own rows with a
    rollback, and lines in other layouts or that the schema refuses, reads as those rows folded
    one by one."""
    from lmcockpit.core.run import rows as row_schema
    from lmcockpit.core.run.folder import read_metrics

    log = MetricsLog(tmp_path / METRICS)
    for s, loss in [*losses(3_000), *losses(3_200, seed=1)[2_500:]]:  # steps 2,501 on redone
        log.write(P.StepMetrics(s, loss, 1e-3 * (1 + s % 7), 0.5 + s % 5, 1e3 + s % 13, None if s % 2 else 0.41,
                                0.25 + s % 3 / 100, 96 * s,
                                None if s % 3 else {"allocated": 9_000_000 + s, "reserved": 10**10, "peak": 2 * 10**9}))
        if s % 500 == 0:
            log.write(P.EvalMetrics(s, 3 + 1 / s, 1.0))
    log.write(P.StepMetrics(3_201, float("nan"), 1e-3, 0.5, 1e3, None, 0.25, None, None))
    log.close()
    engine_line = (tmp_path / METRICS).read_bytes().split(b"\n")[0] + b"\n"
    assert row_schema.event_of(row_schema.read(engine_line)) == P.StepMetrics(
        1, losses(1)[0][1], 2e-3, 1.5, 1001.0, None, 0.26, 96, None)
    others = [  # json's path: folded as before...
        '{"kind": "step", "time": 1.0, "step": 3202, "loss": 2.5, "lr": 0.001, "grad_norm": 0.5, "tokens_per_s": 1.0, '
        '"mfu": null, "dt": 0.25, "mem": {"allocated": 1.5}, "skipped": 0}',  # a field more, a float
        '{"step": 3203, "kind": "step", "loss": 2.4, "lr": 0.001, "grad_norm": 0.5, "tokens_per_s": 2.0, "dt": 0.5}',
        '{"kind":"step","time":1.0,"step":3204,"loss":2.3,"lr":0.001,"grad_norm":0.5,"tokens_per_s":3.0,"mfu":null,'
        '"dt":0.75,"mem":null}',  # the same row, other spacing
        # ...or refused as before (past the last step: one folded would be counted)
        '{"kind": "step", "time": 1.0, "step": 03205, "loss": 3.0, "lr": 0.001, "grad_norm": 0.5, "tokens_per_s": 1.0, '
        '"mfu": null, "dt": 0.25, "mem": null}',  # not JSON
        '{"kind": "step", "time": 1.0, "step": 3205, "loss": 3.0, "lr": 0.001, "grad_norm": null, "tokens_per_s": 1.0, '
        '"mfu": null, "dt": 0.25, "mem": null}',  # no grad norm
        '{"kind": "step", "time": 1.0, "step": 3205, "loss": true, "lr": 0.001, "grad_norm": 0.5, "tokens_per_s": 1.0, '
        '"mfu": null, "dt": 0.25, "mem": null}',  # a bool for a loss
    ]
    with open(tmp_path / METRICS, "a") as fh:
        fh.write("".join(line + "\n" for line in others))
    rows = read_metrics(tmp_path)  # json.loads and well_formed, row by row
    assert [r["step"] for r in rows if r["kind"] == "step"][-3:] == [3202, 3203, 3204]
    reference = fold(rows)
    read, _, _ = history_file.load(tmp_path, write=False)
    same = repr(curve(read)) == repr(curve(reference))  # repr: step 3,201's NaN loss is no equal of itself
    assert same, "the curves differ"  # (pytest's diff of the two would take minutes)
    assert read.last == reference.last
    assert read.count == 3_204  # steps 2,501 on once (redone); the three refused lines not at all
    # The engine's rows alone (the redone steps cut where they go back), and the last step read whole.
    only_engine = tmp_path / "engine"
    only_engine.mkdir()
    (only_engine / METRICS).write_bytes(b"".join((tmp_path / METRICS).read_bytes().splitlines(True)[:-7]))
    read, _, _ = history_file.load(only_engine, write=False)
    reference = fold(read_metrics(only_engine))
    same = repr(curve(read)) == repr(curve(reference))
    assert same, "the curves differ"
    assert read.last == reference.last
    assert read.count == 3_200 and read.last.grad_norm == 0.5 and isinstance(read.last, P.StepMetrics)  # read whole


@pytest.mark.slow
def test_the_engines_summary_survives_a_resume_and_a_rewritten_file_is_noticed(tmp_path):
    """The engine folds each row it writes and saves at each checkpoint row. A resume from that
    checkpoint drops the rows past it (truncate_metrics): the summary still fits, and the folder
    reads as if built from scratch. A resume from an older checkpoint rewrites the file under the
    summary: noticed, and folded whole."""
    rows = run_rows(12_000, checkpoint_every=5000)
    summary = history_file.Summarised(tmp_path)
    log = MetricsLog(tmp_path / METRICS, summary.written)
    for row in rows:
        log.write(event_of(row))
    log.close()
    saved = json.loads((tmp_path / history_file.SUMMARY).read_text())
    assert saved["history"]["last"]["step"] == 10_000  # saved with the checkpoint row at 10,000
    written = [json.loads(line) for line in (tmp_path / METRICS).read_text().splitlines()]
    for step in (10_000, 5000):
        truncate_metrics(tmp_path / METRICS, step)
        history, _, _ = history_file.load(tmp_path, write=False)
        assert curve(history) == curve(fold([r for r in written if r["step"] <= step]))


def deep_size(obj: object) -> int:
    """Bytes held by `obj` and everything it refers to (types and modules aside)."""
    seen, stack, total = set(), [obj], 0
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        stack.extend(gc.get_referents(o))
    return total


@pytest.mark.slow
def test_memory_does_not_grow_with_the_rows():
    def size(n: int) -> int:
        h = History()
        for s, loss in losses(n):
            h.add_step(s, loss, 1e-3, 0.25, 1000.0)
            if s % 1000 == 0:
                h.add_checkpoint(s, "c")
        h.points(400)  # what a chart keeps of it too
        assert h.count == n
        return deep_size(h)

    small, large = size(100_000), size(1_000_000)
    assert large < 1.3 * small, (small, large)
    assert large < 4_000_000


@pytest.mark.slow
def test_the_engine_keeps_the_summary_through_a_run_and_its_resume(tmp_path):
    """A real engine run: history.json is written with its checkpoint rows, ends at one, and reads
    (with the rows after it) as metrics.jsonl folded whole; after a resume in place, the same."""
    from lmcockpit.core import protocol as P
    from lmcockpit.core.run.folder import read_metrics
    from lmcockpit.core.run.resume import plan_resume

    from .helpers import drive_engine, tiny_config

    engine, _ = drive_engine(tiny_config("training.max_steps=10", "checkpoint.every=4", "eval.every=5"), tmp_path)
    assert engine.final_state == P.FINISHED, engine.failure
    run = engine.run_dir

    def as_folded_whole() -> None:
        saved = json.loads((run / history_file.SUMMARY).read_text())
        assert json.loads(saved["line"])["kind"] == "checkpoint"
        assert curve(history_file.load(run, write=False)[0]) == curve(fold(read_metrics(run)))

    as_folded_whole()
    engine, _ = drive_engine(None, None, resume=plan_resume(str(run), ["training.max_steps=14"], None))
    assert engine.final_state == P.FINISHED, engine.failure
    assert [r["step"] for r in read_metrics(run, "step")] == list(range(1, 15))
    as_folded_whole()


@pytest.mark.slow
@pytest.mark.parametrize("damage", [
    lambda d: d["history"].update(width=0),  # would divide by zero at the next row
    lambda d: d["history"].update(buckets=[[1, 2]]),
    lambda d: d["history"].update(tail="x"),
    lambda d: d.update(offset="far"),
    lambda d: d.update(history=None),
])
def test_a_damaged_summary_is_passed_over_for_the_rows(tmp_path, damage):
    rows = run_rows(12_000)
    write_metrics(tmp_path / METRICS, rows)
    history_file.load(tmp_path)  # writes the summary
    data = json.loads((tmp_path / history_file.SUMMARY).read_text())
    damage(data)
    (tmp_path / history_file.SUMMARY).write_text(json.dumps(data))
    history, _, _ = history_file.load(tmp_path, write=False)
    assert curve(history) == curve(fold(rows))
    history.add_step(12_001, 3.0, 1e-3, 0.1, 1.0)


def test_an_older_folder_resumed_gets_its_summary_before_the_first_checkpoint(tmp_path):
    """The engine resuming a run from before history.json folds its metrics.jsonl whole, and writes
    the summary at once: a viewer attaching meanwhile does not fold it all again."""
    rows = run_rows(12_000)
    write_metrics(tmp_path / METRICS, rows)
    summary = history_file.Summarised(tmp_path)
    saved = json.loads((tmp_path / history_file.SUMMARY).read_text())
    assert saved["offset"] == summary.offset == (tmp_path / METRICS).stat().st_size
    assert curve(history_file.load(tmp_path, write=False)[0]) == curve(fold(rows))


@pytest.mark.slow
def test_the_engine_s_history_after_a_rollback_behind_its_exact_rows_is_the_file_s(tmp_path):
    """Checkpoints further apart than the rows kept exact: a rollback to the last one cuts into
    buckets. The engine's history folds the file again, so the summary it saves next is the run's."""
    rows = run_rows(20_000, checkpoint_every=1000)[:-1]  # ...the last checkpoint at 19,000
    rows = [r for r in rows if r["kind"] != "checkpoint" or r["step"] == 1000]  # one checkpoint: 1,000
    redone = [dict(step_row(s, 9.0 + s / 1e6)) for s in range(1001, 1011)]
    summary = history_file.Summarised(tmp_path)
    log = MetricsLog(tmp_path / METRICS, summary.written)
    for row in rows + redone + [{"kind": "checkpoint", "step": 1010, "path": "step_1010"}]:
        log.write(event_of(row))
    log.close()
    standing = [r for r in rows if r["step"] <= 1000] + redone + [{"kind": "checkpoint", "step": 1010, "path": "step_1010"}]
    assert curve(summary.history) == curve(fold(standing))
    assert curve(history_file.load(tmp_path, write=False)[0]) == curve(fold(standing))


def test_a_history_handed_to_a_viewer_is_the_same_curve_without_the_chart_s_cache():
    """A run host pickles its history for each viewer that joins: what arrives draws the same
    curve and keeps the same last step, and the sender's cache of chart points stays behind."""
    import pickle

    h = History()
    for s in range(1, 5001):
        h.add(P.StepMetrics(s, 3 + 100 / (s + 30), 1e-3, 0.5, 5000.0, 0.2, 0.1, s * 512, {}))
    h.add_checkpoint(4000, "checkpoints/step_004000")
    drawn = h.points(200)
    assert h._cache, "drawing fills the cache"
    copy = pickle.loads(pickle.dumps(h))
    assert copy._cache == {}
    assert copy.points(200) == drawn and copy.state() == h.state() and copy.last == h.last
    assert len(pickle.dumps(copy)) == len(pickle.dumps(h))  # the cache never travels

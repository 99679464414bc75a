"""metrics.jsonl's rows are protocol events: written, checked and read back from the dataclasses alone."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.run import rows
from lmcockpit.core.run.folder import METRICS, MetricsLog, read_metrics

REPO = Path(__file__).resolve().parents[1]

EVENTS = [
    P.StepMetrics(7, 2.5, 1e-3, 0.5, 1234.5, 0.41, 0.25, 7 * 96, {"allocated": 2**30, "reserved": 2**31, "peak": 5}),
    P.StepMetrics(8, 2.4, 1e-3, 0.5, 1234.5, None, 0.25, 8 * 96, {}),
    P.EvalMetrics(8, 3.1, 1.2),
    P.EvalMetrics(8, None, None, {"arc-easy": {"accuracy": 0.5, "centered": 0.33, "items": 40}}, 0.12),
    P.CheckpointWritten(8, "runs/x/checkpoints/step_8"),
    P.SpikeSeen(9, 41.5, "rollback", 3.0, 12.5, 0.8, None),
    P.RolledBack(9, 8, 1, 1, 0.5, 100),
    P.TargetReached(12, "val_loss", 3.1, 3.2, 61.5),
    P.Sampled(12, "def f(", "x):"),
    P.Ended(12, P.FINISHED),
    P.Failed(12, "out of memory"),
    P.Note("3 rows not written: the disk was full"),
    P.Profiled(3, 2, "profiles/step_3/trace.json.gz", 0.5, {"matmul": 0.2, "idle": 0.1}, {"aten::mm": 0.2}),
    P.LayerStats(10, [0.5, 0.25], [0.01, 0.02], 0.75, 0.005),
]


def test_every_row_event_is_written_and_read_back_as_itself(tmp_path):
    assert {type(e) for e in EVENTS} == set(rows.ROW_EVENTS)
    log = MetricsLog(tmp_path / METRICS)
    for event in EVENTS:
        log.write(event)
    log.close()
    lines = (tmp_path / METRICS).read_bytes().splitlines(keepends=True)
    assert [rows.event_of(rows.read(line)) for line in lines] == EVENTS
    first = json.loads(lines[0])
    # kind and time first, then the event's fields in the dataclass's order
    assert list(first) == ["kind", "time", *(f.name for f in dataclasses.fields(P.StepMetrics))]
    assert [r["kind"] for r in read_metrics(tmp_path)] == [type(e).kind for e in EVENTS]


def test_a_field_only_the_queue_carries_is_not_written():
    row = rows.row_of(P.SpikeSeen(9, 41.5, "warn", 3.0, 12.5, 0.8, 4.0, live=False))
    assert "live" not in row and rows.event_of(row).live is True


STEP = rows.row_of(EVENTS[0])


@pytest.mark.parametrize("change, why", [
    ({"loss": True}, "a bool is no number"),
    ({"loss": "2.5"}, "a string is no number"),
    ({"step": -1}, "a step counts from 0"),
    ({"step": 2**63}, "past what a row of ours holds"),
    ({"dt": None}, "dt may not be null"),
    ({"mem": {"allocated": "1 GiB"}}, "memory in bytes"),
    ({"mem": [1, 2]}, "memory is a mapping"),
    ({"tokens_seen": 1.5}, "tokens are counted"),
])
def test_a_step_row_whose_field_is_not_of_its_type_is_refused(change, why):
    assert rows.well_formed(STEP)
    assert not rows.well_formed({**STEP, **change}), why


def test_what_a_row_may_lack_is_read_off_the_dataclass():
    """A field whose type admits None, or with a default, may be absent (rows from before it was
    written); any other is required. Fields beyond the event's are let be."""
    lacking = {k: v for k, v in STEP.items() if k not in ("mfu", "mem", "tokens_seen", "time")}
    assert rows.event_of({**lacking, "newer": 1}) == P.StepMetrics(7, 2.5, 1e-3, 0.5, 1234.5, None, 0.25, None)
    for required in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "dt"):
        assert not rows.well_formed({k: v for k, v in STEP.items() if k != required}), required
    spike = rows.row_of(EVENTS[5])
    assert not rows.well_formed({**spike, "action": "panic"})  # the field's choices
    assert not rows.well_formed({"kind": "end", "step": 3, "state": P.FAILED})  # a failure has its own row
    assert not rows.well_formed({"kind": "eval", "step": 3})  # says nothing: neither loss nor tasks
    assert not rows.well_formed({"kind": "eval", "step": 3, "tasks": {"arc": {"accuracy": 0.5}}})  # TaskScores
    assert rows.well_formed({"kind": "someday", "step": 3}) and not rows.well_formed({"kind": "someday", "step": -3})


def test_a_field_added_to_an_event_is_checked_with_no_other_change():
    @dataclasses.dataclass(frozen=True)
    class Timed(P.StepMetrics):
        phases: dict[str, float] | None = None

    fields = {f.name: f for f in rows._row_fields(Timed)}
    assert fields["phases"].may_lack and fields["phases"].fits({"forward": 0.1}) and not fields["phases"].fits([0.1])
    with pytest.raises(TypeError, match="no row check"):
        rows.check_of(set[int])  # a list is checked by its items (a layers row's), a set never written


def test_a_line_json_reads_and_orjson_refuses_is_read():
    line = json.dumps({**STEP, "grad_norm": float("inf")}).encode()  # an overflowed gradient: Infinity
    assert rows.read(line)["grad_norm"] == float("inf")
    assert rows.read(b'{"kind": "step", "ste') is None and rows.read(b"[" * 5000) is None


def _calls(tree: ast.AST, method: str) -> list[str]:
    """The protocol classes built in calls `X.method(P.Class(...))`."""
    return [node.args[0].func.attr for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method
            and node.args and isinstance(node.args[0], ast.Call) and isinstance(node.args[0].func, ast.Attribute)]


def test_the_trainer_records_a_row_event_once_rather_than_writing_then_sending_it():
    tree = ast.Module(body=[node for path in sorted((REPO / "core/train").glob("*.py"))
                            for node in ast.parse(path.read_text()).body], type_ignores=[])
    kinds = {cls.__name__ for cls in rows.ROW_EVENTS}
    # ...but a stop at a step saved already says again that it is on disk: its row was written then.
    said_again = {"CheckpointWritten"}
    assert not kinds & set(_calls(tree, "emit")) - said_again, "a row event sent without its row: use record()"
    written = set(_calls(tree, "write"))
    assert written <= {"Sampled"}, f"{written}: a row event written without being sent: use record()"


def test_a_step_row_s_field_names_are_spelt_in_one_module_of_core_and_of_tui_at_most():
    for package in ("core", "tui"):
        spelt: dict[str, set[str]] = {}
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in ("tokens_per_s", "mfu", "grad_norm"):
                    spelt.setdefault(node.value, set()).add(str(path.relative_to(REPO)))
        modules = set().union(*spelt.values()) if spelt else set()
        assert len(modules) <= 1, f"{package}: {spelt}"


def test_the_written_out_check_agrees_with_each_field_s_own():
    """rows.CHECKS (one function per kind, written out for speed) says what the fields' checks say,
    for every field of every kind given each of a set of values, or left out."""
    def by_fields(row: dict) -> bool:
        for f in rows.FIELDS[row["kind"]]:
            if f.name in row and not f.fits(row[f.name]) or f.name not in row and not f.may_lack:
                return False
        needs = getattr(rows.KINDS[row["kind"]], "needs_one_of", ())
        return not needs or any(row.get(n) is not None for n in needs)

    values = [None, True, 0, -1, 7, 2**63, -(2**63), 1.5, float("nan"), "x", "warn", P.FINISHED, {}, [],
              {"a": 1}, {"a": "b"}, {"t": {"accuracy": 0.5, "centered": 0.1, "items": 3}}]
    tried = 0
    for event in EVENTS:
        row = rows.row_of(event)
        for name in row.keys() - {"kind", "time"}:
            for changed in [{k: v for k, v in row.items() if k != name}, *({**row, name: v} for v in values)]:
                assert rows.well_formed(changed) == by_fields(changed), (changed, name)
                tried += 1
    assert tried > 500

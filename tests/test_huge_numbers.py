"""A metrics row with an integer of more digits than Python reads (#50, 4): json.loads and int()
raise ValueError past 4,300 digits (not JSONDecodeError), and an integer below that limit may
still be too large for what a step is stored in. Such a row, in any run under runs/ or in a live
run's folder, once stopped the cockpit at start, crashed `compare` and the history reader, and
silently killed an attached viewer's receive thread. Every reader passes over it as over any
malformed line."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
from textual.widgets import DataTable

from lmcockpit.core import protocol as P
from lmcockpit.core.process import host, live
from lmcockpit.core.process.viewer import RunViewer
from lmcockpit.core.run import history_file
from lmcockpit.core.run.folder import METRICS, TRAIN_LOG, UNREADABLE, read_metrics, run_summary, tail_rows, write_config
from lmcockpit.core.run.resume import truncate_metrics
from lmcockpit.tui.app import CockpitApp
from lmcockpit.tui.screens.launch import LaunchScreen

from .helpers import QUICK_BUILD, as_set, cli, one_error, tiny_config

HUGE = "9" * 5000  # past int()'s 4,300-digit limit: ValueError
LARGE = "9" * 4000  # read by json, but no step: past what a step is held in (a signed 64-bit integer)


def step_row(step: int | str, loss: float = 4.0) -> str:
    """A step row exactly as the engine writes it (the history reader's fast path), with `step`
    spelled as given."""
    row = {"kind": "step", "time": 1.0, "step": 0, "loss": loss, "lr": 0.001, "grad_norm": 1.0,
           "tokens_per_s": 10.0, "mfu": None, "dt": 0.1, "mem": None}
    return json.dumps(row).replace('"step": 0', f'"step": {step}') + "\n"


# Lines json cannot read: passed over as a half-written line is.
UNREADABLE_LINES = [
    step_row(HUGE),  # the engine's own layout
    '{"kind": "eval", "time": 1.0, "step": ' + HUGE + ', "val_loss": 3.0}\n',
    '{"kind": "eval", "time": 1.0, "step": 2, "val_loss": ' + HUGE + '}\n',
    '{"kind": "step", "time": 1.0, "step": 3, "loss": 1, "lr": 1, "grad_norm": 1, "tokens_per_s": ' + HUGE
    + ', "mfu": null, "dt": 1, "mem": {"peak": ' + HUGE + '}}\n',
]
# Rows json reads whose integers no row of lmcockpit's holds: not the engine's rows.
FOREIGN_ROWS = [
    step_row(LARGE),
    step_row(-3),
    '{"kind": "checkpoint", "time": 1.0, "step": ' + LARGE + ', "path": "x"}\n',
    '{"kind": "step", "time": 1.0, "step": 3, "loss": ' + LARGE + ', "lr": 1, "grad_norm": 1, "tokens_per_s": 1, '
    '"mfu": null, "dt": 1, "mem": null}\n',
    '{"kind": "step", "time": 1.0, "step": 3, "loss": 1, "lr": 1, "grad_norm": 1, "tokens_per_s": 1, '
    '"mfu": ' + LARGE + ', "dt": 1, "mem": {"peak": ' + LARGE + '}}\n',
]


def hostile_run(path: Path, lines: list[str]) -> Path:
    """A run folder of the user's: steps 1 and 2, the lines given, then step 3."""
    path.mkdir(parents=True)
    write_config(tiny_config("training.max_steps=10"), path / "config.toml")
    (path / METRICS).write_text(step_row(1, 5.0) + step_row(2, 4.5) + "".join(lines) + step_row(3, 4.0))
    return path


@pytest.mark.parametrize("lines", [UNREADABLE_LINES, FOREIGN_ROWS], ids=["unreadable", "foreign"])
def test_the_readers_of_a_run_folder_pass_over_a_row_with_a_huge_integer(tmp_path, lines):
    run = hostile_run(tmp_path / "run", lines)
    assert [r["step"] for r in read_metrics(run, "step")] == [1, 2, 3]
    assert [r["step"] for r in tail_rows(run / METRICS) if r["kind"] == "step"] == [1, 2, 3]
    history, _, _ = history_file.load(run, write=False)
    assert history.count == 3 and history.last_step == 3
    assert [p.loss for p in history.points(10)] == [5.0, 4.5, 4.0]
    # the launch screen's line: a line json cannot read is passed over as a half-written one is;
    # rows that are not the engine's mark the file as damaged (as a bare step row does)
    summary = run_summary(run)
    assert (summary["status"], summary["step"]) == (("stopped", 3) if lines is UNREADABLE_LINES else (UNREADABLE, 0))


def test_a_resume_s_truncation_passes_over_a_row_with_a_huge_integer(tmp_path):
    run = hostile_run(tmp_path / "run", UNREADABLE_LINES + FOREIGN_ROWS)
    truncate_metrics(run / METRICS, 2)
    assert [r["step"] for r in read_metrics(run, "step")] == [1, 2]


@pytest.mark.slow
def test_compare_reads_a_run_with_a_huge_integer(tmp_path):
    a, b = hostile_run(tmp_path / "a", UNREADABLE_LINES), hostile_run(tmp_path / "b", FOREIGN_ROWS)
    proc = cli("compare", str(a), str(b))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.asyncio
async def test_the_cockpit_starts_with_a_run_whose_metrics_hold_a_huge_integer(tmp_path):
    runs = tmp_path / "runs"
    huge = hostile_run(runs / "huge", UNREADABLE_LINES)
    foreign = hostile_run(runs / "foreign", FOREIGN_ROWS)
    app = CockpitApp(runs_root=runs, telemetry=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert isinstance(app.screen, LaunchScreen)
        table = app.screen.query_one("#runs", DataTable)
        shown = {key.value: [str(cell) for cell in table.get_row(key)] for key in table.rows}
        assert shown[str(huge)] == ["huge", "3/10", "4.000", "stopped"]  # run, step, loss, status
        assert shown[str(foreign)][::3] == ["foreign", "unreadable metrics.jsonl"]


def test_an_attached_viewer_reads_a_live_run_whose_metrics_hold_a_huge_integer(tmp_path):
    """The run host reads the history as it starts, and hands it to each viewer that attaches: the
    row once ended the viewer's receiving thread (which read it then) without a word, and the
    dashboard waited at step 0 while the run trained."""
    run = hostile_run(tmp_path / "run", UNREADABLE_LINES + FOREIGN_ROWS)
    (run / TRAIN_LOG).touch()
    server = host.RunServer(run, on_command=lambda c: None, log=lambda text: None, run=host.run_so_far(run))
    try:
        live.LiveRecord(str(run.resolve()), os.getpid(), socket.gethostname(), str(server.path)).write()
        viewer = RunViewer(run)
        try:
            read = None
            while read is None:
                event = viewer.poll(timeout=30)
                assert event is not None, "the viewer heard nothing: its receiving thread ended"
                read = event.history if isinstance(event, P.HistoryRead) else None
            assert read.count == 3 and read.last_step == 3
        finally:
            viewer.close()
    finally:
        server.close(grace=1)


@pytest.mark.slow
def test_a_corpus_line_with_a_huge_integer_is_refused_naming_file_and_line(tmp_path):
    """As a line nested thousands deep is: the build stops at it, naming where, in one line."""
    source = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": f"document {i} " * 40}) for i in range(20)]
    lines.insert(12, '{"text": "big", "id": ' + HUGE + "}")
    source.write_text("\n".join(lines) + "\n")
    line = one_error(cli("data", "prepare", "debug",
                         *as_set(f'data.source="{source}"', f'data.cache_dir="{tmp_path / "c"}"', *QUICK_BUILD)),
                     f"{source}:13: not readable as JSON", "expected an object with a string field 'text'")
    assert len(line) < 400, line

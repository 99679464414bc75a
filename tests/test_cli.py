"""`lmcockpit --run` as a user runs it: a real process, piped or on a terminal, with real files."""

import re

import pytest

from lmcockpit.core.run.folder import latest_checkpoint, read_metrics

from .helpers import TINY, TRAINED_RUN, as_flags, cli, trained_cache

XTERM = {"TERM": "xterm-256color"}


def test_piped_run_prints_plain_lines_and_where_the_run_is(trained_run):
    run, proc = trained_run
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for expected in ["step 1/12 | loss", "step 4/12 | loss", "step 12/12 | loss", "eval step 6 | val loss",
                     f"run folder: {run}", f"lmcockpit chat {run}", "finished 12 steps",
                     "compiling the model (torch.compile)", "compile on"]:
        assert expected in out, expected
    assert "\x1b[" not in out and "\r" not in out  # no terminal control when piped
    assert "step 3/12" not in out  # one line per log interval, not per step


def test_set_overrides_land_in_the_resolved_config(trained_run):
    run, _ = trained_run
    text = (run / "config.toml").read_text()
    assert "max_steps = 12" in text and 'device = "cpu"' in text and "every = 6" in text
    assert "d_model = 64" in text and "compile = true" in text


@pytest.mark.slow
def test_the_same_run_again_reuses_the_data_cache_and_repeats_every_loss(trained_run, tmp_path):
    """Compiled, too: torch.compile on CPU scatters the embedding gradient with atomic adds unless
    deterministic algorithms are on, and without them these losses differ around 1e-4 by step 6."""
    proc = cli(*TRAINED_RUN, "--out", str(tmp_path / "again"),
               env={"XDG_CACHE_HOME": str(trained_cache(trained_run[0]).parent)})
    assert proc.returncode == 0, proc.stderr
    assert "reusing token cache" in proc.stdout
    assert "trained a byte-level BPE" not in proc.stdout
    again = [r["loss"] for r in read_metrics(tmp_path / "again", "step")]
    assert len(again) == 12 and again == [r["loss"] for r in read_metrics(trained_run[0], "step")]


def preset_file(tmp_path, text):
    p = tmp_path / "mine.toml"
    p.write_text(text)
    return str(p)


def small_corpus(tmp_path):
    folder = tmp_path / "small"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.txt").write_text("short text " * 3)
    return f"data.source=\"{folder}\""


@pytest.mark.slow
@pytest.mark.parametrize("make_args, message", [
    (lambda t: ["--run", preset_file(t, "[training]\nmax_steps = = 3\n")], "TOML syntax error"),
    (lambda t: ["--run", preset_file(t, "[trainig]\n")], "unknown section [trainig] (did you mean training?)"),
    (lambda t: ["--run", "debug", "--set", "training.seed=\"x\""], "training.seed must be an integer, got a string"),
    (lambda t: ["--run", "debug", "--set", "training.max_steps=-1"], "training.max_steps = -1 must be a positive"),
    (lambda t: ["--run", "debug", "--set", "model.n_head=6"], "model.n_head = 6 must divide model.d_model = 64"),
    (lambda t: ["--run", "debug", "--set", "training.seq_len=128"], "above the model's context"),
    (lambda t: ["--run", "debug", "--set", f"data.source=\"{(t / 'empty').mkdir() or t / 'empty'}\""],
     "no text found there (empty)"),
    (lambda t: ["--run", "debug", "--set", small_corpus(t), "--set", "data.max_bytes=0",
                "--set", "data.val_fraction=0.4", "--set", "tokenizer.vocab_size=300"], "fewer than one sequence"),
])
def test_each_bad_input_exits_2_with_its_message(tmp_path, make_args, message):
    proc = cli(*make_args(tmp_path), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--run", "nosuchpreset"], "preset 'nosuchpreset' not found"),
    (["--run", "debug", "--set", "training.max_steps"], "expected SECTION.KEY=VALUE"),
    (["--run", "debug", "--set", "training.maxsteps=3"], "did you mean training.max_steps"),
    (["--run", "debug", "--set", "model.n_kv_head=3"], "model.n_kv_head = 3 must divide"),
    (["--run", "debug", "--bogus"], "unrecognized arguments: --bogus"),
    (["--run", "debug", "--set", "data.source=\"/nonexistent/corpus\""], "no such file or folder"),
])
def test_user_mistakes_exit_2_with_one_message(args, message, tmp_path):
    proc = cli(*args, "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_version_prints_the_installed_version():
    import lmcockpit

    proc = cli("--version")
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout == f"lmcockpit {lmcockpit.__version__}\n"


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["debug", "--run", "cpu"], "give the preset once: either `lmcockpit debug` or `--run cpu`"),
    (["--run"], "--run needs a preset (a TOML path or a shipped name such as `cpu`)"),
    (["--run", "debug", "--gpu", "-1"], "--gpu -1: expected a GPU index, 0 or more"),
    (["debug", "--gpu", "-1"], "--gpu -1: expected a GPU index, 0 or more"),
])
def test_usage_mistakes_are_one_error_line_before_anything_starts(tmp_path, args, message):
    proc = cli(*args, "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == f"error: {message}\n" and proc.stdout == ""
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_non_empty_out_is_refused_and_left_alone(tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    proc = cli("--run", "debug", "--out", str(out))
    assert proc.returncode == 2 and "already exists and is not an empty folder" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["nosuchpreset"], "preset 'nosuchpreset' not found"),
    (["debug", "--set", "training.max_steps=0"], "training.max_steps = 0 must be a positive integer"),
    (["--resume", "/nonexistent/run"], "neither a run folder"),
])
def test_the_cockpit_form_refuses_bad_input_before_it_opens(args, message):
    proc = cli(*args)
    assert proc.returncode == 2 and message in proc.stderr
    assert "Traceback" not in proc.stderr and "\x1b[?1049h" not in proc.stdout + proc.stderr  # no alt screen


def ended_cockpit(term, notice: str) -> str:
    """What the terminal showed until the cockpit's footer offered n (the run has ended) and the
    notice came, in whichever order the two were drawn."""
    shown = term.expect("New run", timeout=180)
    return shown if notice in shown else shown + term.expect(notice, timeout=30)


@pytest.mark.slow
def test_lmcockpit_preset_and_resume_open_the_cockpit_on_a_terminal(tmp_path, terminal):
    """`lmcockpit PRESET` opens the cockpit on the run, started at once; once it has finished
    (the footer offers n), q quits and the terminal gets the run's folder. `lmcockpit --resume
    RUN --set ...` continues it in the cockpit the same way."""
    out = tmp_path / "run"
    term = terminal("debug", *as_flags([*TINY, "training.max_steps=3", "eval.every=0"]), "--out", str(out),
                    size=(100, 30), env=XTERM)
    shown = ended_cockpit(term, "run finished at step 3")
    assert "\x1b[?1049h" in shown  # the alternate screen, the notice
    term.type("q")
    code, rest = term.end(timeout=60)
    assert code == 0, rest
    assert rest.endswith(f"run folder: {out} (finished at step 3)\r\n"), rest[-300:]
    assert "\x1b[?1049l" in rest.rpartition("run folder: ")[0]  # said on the terminal, once the cockpit left it
    assert [r["step"] for r in read_metrics(out, "step")] == [1, 2, 3]

    term = terminal("--resume", str(out), "--set", "training.max_steps=5", size=(100, 30), env=XTERM)
    ended_cockpit(term, "run finished at step 5")
    term.type("q")
    code, rest = term.end(timeout=60)
    assert code == 0 and rest.endswith(f"run folder: {out} (finished at step 5)\r\n"), rest[-300:]
    assert [r["step"] for r in read_metrics(out, "step")] == [1, 2, 3, 4, 5]
    assert latest_checkpoint(out).name == "step_000005"


# ------------------------------------------------------------------ the live progress line
def progressed_view(steps: int = 45, max_steps: int = 400, mfu: float | None = None):
    from lmcockpit.core import protocol as P
    from lmcockpit.core.run.state import RunState

    view = RunState()
    view.apply(P.RunStarted("run", {}, 1000, "cpu", "fp32", 0, max_steps, 4096))
    view.apply(P.StateChanged(P.RUNNING))
    for step in range(1, steps + 1):
        view.apply(P.StepMetrics(step, 5.2847, 1e-3, 1.0, 4096 / 0.8, mfu, 0.8, step * 4096))
    return view


@pytest.mark.slow
def test_a_run_on_a_terminal_is_one_live_progress_line(tmp_path, terminal):
    """`lmcockpit --run` on a real terminal (a pty): the progress is one line redrawn in place
    (carriage return, erase line), not a line per log interval; log lines still print above it,
    and once the run ends the line is cleared for the summary."""
    out = tmp_path / "run"
    term = terminal("--run", "debug", *as_flags([*TINY, "eval.every=0"]), "--out", str(out),
                    size=(120, 30), env=XTERM)
    code, shown = term.end(timeout=180)
    assert code == 0, shown[-2000:]
    live = re.compile(r"\r\x1b\[2K(step (\d+)/12 \[[ ▏▎▍▌▋▊▉█]{10}\] +\d+%( [A-Z]+)? \| loss \d+\.\d{4} \| "
                      r"ETA [\d:–]+ \| [\d.k–]+ tok/s[^\r\n]*)")
    drawn = live.findall(shown)
    assert drawn, shown[-2000:]
    assert drawn[-1][0].startswith("step 12/12 [██████████] 100% FINISHED | loss "), drawn[-1]
    assert " | lr " not in shown and "step 4/12 | loss" not in shown  # no plain step lines
    assert re.search(r"\r\x1b\[2Kmodel: [^\r\n]*parameters[^\r\n]*\r\n", shown)  # a log line, on a line of its own
    # the live line is cleared (cursor up, erase) and the summary follows
    tail = shown.rpartition("FINISHED | loss")[2]
    assert "\x1b[2K" in tail.partition("finished 12 steps")[0]
    assert f"run folder: {out}\r\n" in tail and latest_checkpoint(out).name == "step_000012"


def test_the_progress_line_of_a_cpu_run_shows_what_matters_within_80_columns():
    from lmcockpit.tui.headless import progress_line

    line = progress_line(progressed_view(), None, None)
    assert "VRAM" not in line and "GPU" not in line and "MFU" not in line and "–" not in line
    shown = line[:80]
    for field in ["step 45/400", "11%", "loss 5.2847", "ETA 0:04:44", "5.1k tok/s"]:
        assert field in shown, (field, line)
    # the least useful fields go last; the longest counts still keep the four within 80 columns
    assert line.index("loss") < line.index("ETA") < line.index("tok/s") < line.index("step/s")
    long = progress_line(progressed_view(3, 100000), None, None)
    assert "tok/s" in long[:80] and "ETA" in long[:80]


def test_the_progress_line_counts_what_the_preparation_counts():
    from lmcockpit.core import protocol as P
    from lmcockpit.tui.headless import progress_line
    from lmcockpit.core.run.state import RunState

    view = RunState()
    view.apply(P.Progress("sizing the files", 1234, 4936, "files"))
    assert progress_line(view, None, None) == "Preparing data: sizing the files [█████               ] 25% (1,234/4,936 files)"
    view.apply(P.Progress("tokenizing", 2_500_000, 10_000_000, "bytes"))
    assert progress_line(view, None, None) == "Preparing data: tokenizing [█████               ] 25% (2.5/10.0 MB)"


def test_the_progress_line_shows_gpu_fields_when_known_and_says_a_pause_up_front():
    from lmcockpit.core import protocol as P
    from lmcockpit.core.hardware.telemetry import GPUReading, Reading
    from lmcockpit.tui.headless import progress_line

    view = progressed_view(mfu=0.41)
    gpu = GPUReading(0, "Card", 97.0, 50.0, 3_100_000_000, 24_000_000_000, 60.0, 300.0, 1800)
    line = progress_line(view, Reading(10.0, 1, 2, [gpu]), 0)
    assert line.endswith("| VRAM 3.1/24.0GB | GPU 97% | MFU 41%"), line
    view.apply(P.StateChanged(P.PAUSED))
    assert progress_line(view, None, None).startswith("step 45/400 [█▏        ] 11% PAUSED | loss 5.2847 |")
    fresh = progressed_view(1)  # the first step's rate is compilation's: no rate yet
    assert progress_line(fresh, None, None).endswith("| loss 5.2847 | ETA – | – tok/s")


def test_evaluations_read_back_print_their_scores_and_one_of_tasks_alone_leaves_the_val_loss_shown(tmp_path):
    """An evaluation may hold the validation loss, the task scores (their own cadence) or both:
    each prints what it holds, and the val loss the progress line and panels show stays the last
    one measured."""
    import json

    from lmcockpit.core import protocol as P
    from lmcockpit.core.process.host import run_so_far
    from lmcockpit.tui.headless import eval_line
    from lmcockpit.tui.widgets.glance import step_text
    from lmcockpit.tui.widgets.panels import throughput_rows

    scores = {"python-functions": {"accuracy": 0.43, "centered": 0.24, "items": 111}}
    later = {"python-functions": {"accuracy": 0.45, "centered": 0.27, "items": 111},
             "arc-easy": {"accuracy": 0.5, "centered": 0.33, "items": 40}}
    rows = [{"kind": "eval", "time": 1.0, "step": 20, "val_loss": 3.41, "val_bpb": 1.2},
            {"kind": "eval", "time": 2.0, "step": 30, "tasks": scores},
            {"kind": "eval", "time": 3.0, "step": 40, "val_loss": 3.2, "val_bpb": 1.1, "tasks": later, "core": 0.12}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [P.EvalMetrics(r["step"], r.get("val_loss"), r.get("val_bpb"), r.get("tasks") or {}, r.get("core"))
             for r in rows]
    assert [eval_line(e) for e in evals] == [
        "eval step 20 | val loss 3.4100 | val bpb 1.2000",
        "eval step 30 | python-functions 0.430",
        "eval step 40 | val loss 3.2000 | val bpb 1.1000 | python-functions 0.450 | arc-easy 0.500 | CORE 0.120"]

    view = progressed_view()
    for ev in evals[:2]:
        view.apply(ev)
    assert view.last_eval == evals[0] and (view.val_steps, view.val_losses) == ([20], [3.41])
    assert view.tasks == {"python-functions": [(30, 0.43)]} and view.last_tasks == scores and view.last_core is None
    assert "val 3.4100" in step_text(view, 200).plain and ("val loss", "3.4100 @ 20") in throughput_rows(view)
    view.apply(evals[2])
    assert view.last_eval == evals[2] and (view.val_steps, view.val_losses) == ([20, 40], [3.41, 3.2])
    assert view.tasks == {"python-functions": [(30, 0.43), (40, 0.45)], "arc-easy": [(40, 0.5)]}
    assert view.last_tasks == later and view.last_core == 0.12
    # A viewer attaching reads the same from the folder.
    (read,) = [e for e in run_so_far(tmp_path).catchup("attached") if isinstance(e, P.HistoryRead)]
    attached = progressed_view()
    attached.apply(read)
    assert (attached.last_eval.step, attached.last_eval.val_loss) == (40, 3.2)
    assert (attached.val_steps, attached.val_losses, attached.tasks) == (view.val_steps, view.val_losses, view.tasks)
    assert attached.last_tasks == later and attached.last_core == 0.12

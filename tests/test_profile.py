"""A profile of a few steps while the run trains on (core/train/profiling.py): asked for by the
config (profile.at_step) or a front-end's command, it writes a Chrome trace and a summary, and the
steps after it are as fast as those before."""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.run import history_file
from lmcockpit.core.run.folder import read_metrics
from lmcockpit.core.train.profiling import kind_of

from lmcockpit.tui.app import CockpitApp

from .helpers import dashboard, drive_engine, request, tiny_config, wait_for


def trace_names(path: Path) -> dict[str, set[str]]:
    """The trace's event names by category (cpu_op, python_function, ...): it must be Chrome-trace JSON."""
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        trace = json.load(fh)
    names: dict[str, set[str]] = {}
    for event in trace["traceEvents"]:
        names.setdefault(event.get("cat", ""), set()).add(event.get("name", ""))
    return names


def step_times(events, steps: range) -> list[float]:
    return [e.dt for e in events if isinstance(e, P.StepMetrics) and e.step in steps]


@pytest.mark.parametrize("name, kind", [
    ("aten::mm", "matmul"), ("aten::addmm", "matmul"), ("autograd::engine::evaluate_function: MmBackward0", "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("autograd::engine::evaluate_function: ScaledDotProductFlashAttentionForCpuBackward0", "attention"),
    ("aten::mul", "elementwise"), ("autograd::engine::evaluate_function: SiluBackward0", "elementwise"),
    ("aten::copy_", "copies"), ("aten::_to_copy", "copies"), ("c10d::allreduce_", "communication"),
    ("nccl:all_reduce", "communication"), ("nn.Module: Block_0", "idle"), ("ProfilerStep#3", "idle"),
    ("trainer.py(280): run", "idle"), ("aten::empty", "other"),
])
def test_each_operator_is_sorted_into_its_kind_of_work(name, kind):
    assert kind_of(name, in_optimizer=False) == kind


def test_everything_inside_an_optimizer_step_is_the_optimizer_s():
    assert kind_of("aten::mul", in_optimizer=True) == kind_of("aten::_foreach_add_", in_optimizer=True) == "optimizer"


@pytest.mark.slow
def test_profile_at_step_writes_a_chrome_trace_and_a_summary_and_the_run_goes_on(tmp_path):
    cfg = tiny_config("training.max_steps=8", "eval.every=0", "profile.at_step=3", "profile.steps=2")
    engine, events = drive_engine(cfg, tmp_path / "run")
    assert engine.final_state == P.FINISHED
    run = tmp_path / "run"
    (profile,) = [e for e in events if isinstance(e, P.Profiled)]
    trace = run / "profiles" / "step_3" / "trace.json.gz"
    assert (profile.step, profile.steps, profile.trace, profile.memory) == (3, 2, str(trace), "")
    names = trace_names(trace)
    assert names["cpu_op"] & {"aten::mm", "aten::addmm"}  # the CPU's operators
    assert any(n.startswith("nn.Module: ") for n in names["python_function"])  # and the model's modules
    assert profile.kinds["matmul"] > 0 and profile.kinds["optimizer"] > 0
    assert set(profile.kinds) == {"matmul", "attention", "elementwise", "optimizer", "communication", "copies",
                                  "other", "idle"}
    # the kinds cover the profiled steps' wall time, which is about the two steps' own
    assert sum(profile.kinds.values()) == pytest.approx(profile.seconds, rel=0.1)
    profiled = sum(step_times(events, range(3, 5)))
    assert 0.5 * profiled < profile.seconds < 2 * profiled + 0.5
    assert len(profile.top) == 10 and all(not n.startswith(("nn.Module", "ProfilerStep")) for n in profile.top)
    assert profile.top_cuda == {}  # a CPU run
    logged = [e.text for e in events if isinstance(e, P.LogLine) and e.text.startswith("profile: ")]
    assert logged[0] == f"profile: recording steps 3-4 after a warm-up step; the trace goes to {trace}"
    assert any(line.startswith("profile: steps 3-4 took ") and "matmul" in line for line in logged)
    assert any(line.startswith("profile: top CPU operators by self time: ") for line in logged)
    assert [r for r in read_metrics(run) if r["kind"] == "profile"][0]["trace"] == str(trace)
    assert history_file.load(run, write=False)[0].profile == profile  # what a cockpit attaching later is handed
    assert f"profile: steps 3-4 took {profile.seconds:.3f} s" in (run / "train.log").read_text()
    assert [e.step for e in events if isinstance(e, P.StepMetrics)] == list(range(1, 9))


@pytest.mark.slow
def test_the_profile_command_profiles_the_next_steps_once_refuses_a_second_and_leaves_no_overhead(tmp_path):
    cfg = tiny_config("training.max_steps=32", "eval.every=0")
    sent = []

    def ask_at_step_10(engine, event):
        if isinstance(event, P.StepMetrics) and event.step == 10 and not sent:
            engine.send(P.Profile(steps=0))  # refused: a profile of nothing
            engine.send(P.Profile(steps=3, memory=True))
            engine.send(P.Profile())  # while the first is taken: refused
            sent.append(event.step)

    engine, events = drive_engine(cfg, tmp_path / "run", on_event=ask_at_step_10)
    assert engine.final_state == P.FINISHED
    (profile,) = [e for e in events if isinstance(e, P.Profiled)]
    first = profile.step
    assert first > 11 and profile.steps == 3 and profile.memory == ""  # no CUDA memory history on a CPU
    trace = tmp_path / "run" / "profiles" / f"step_{first}" / "trace.json.gz"
    assert profile.trace == str(trace) and "aten::mm" in trace_names(trace)["cpu_op"]
    logged = [e.text for e in events if isinstance(e, P.LogLine) and e.text.startswith("profile: ")]
    assert "profile: the memory history is the CUDA allocator's: none on this run's CPU" in logged
    assert "profile: 0 steps asked for; a profile records 1 to 1000: refused" in logged
    assert any("one is being taken already" in line and "this request is refused" in line for line in logged)
    # torch.profiler's own "USDT: ... profiler_start" on stderr: in train.log, not among the log pane's lines
    said = [e.text for e in events if isinstance(e, P.LogLine)]
    assert not [line for line in said if "] profiler_st" in line], said
    assert sorted(p.name for p in (tmp_path / "run" / "profiles").iterdir()) == [f"step_{first}"]
    # The profiler is off after its steps: the ten steps right after them are as fast as those
    # before (a profiler left recording, as a schedule that repeats its cycle leaves it, made
    # them 15 times slower here; the bound leaves room for a machine others share).
    before = statistics.median(step_times(events, range(3, first - 1)))
    after = statistics.median(step_times(events, range(first + 3, first + 13)))
    assert after < 3 * before, (before, after)


@pytest.mark.slow
def test_a_link_planted_at_profiles_once_the_run_started_gets_no_trace_and_the_run_goes_on(tmp_path):
    """The run folder's writes never follow a link (safe_files): planted after the run claimed its
    folder, while it waits paused before its first step, the link is refused when the trace is written."""
    cfg = tiny_config("training.max_steps=6", "eval.every=0", "profile.at_step=3", "profile.steps=2")
    victim = tmp_path / "victim"
    victim.mkdir()

    def plant_then_resume(engine, event):
        if isinstance(event, P.StateChanged) and event.state == P.PAUSED and not (tmp_path / "run" / "profiles").exists():
            (tmp_path / "run" / "profiles").symlink_to(victim)
            engine.send(P.Resume())

    engine, events = drive_engine(cfg, tmp_path / "run", on_event=plant_then_resume, queued=[P.Pause()])
    assert engine.final_state == P.FINISHED and list(victim.iterdir()) == []
    (profile,) = [e for e in events if isinstance(e, P.Profiled)]
    assert profile.trace == "" and profile.kinds["matmul"] > 0  # the summary is still told
    assert any(isinstance(e, P.LogLine) and e.text.startswith("warning: profile: not written to ")
               and "symbolic link" in e.text for e in events)


@pytest.mark.slow
async def test_f_in_the_cockpit_profiles_the_next_steps_and_the_log_shows_the_summary(tmp_path):
    """The key sends Profile through the run host, as an attached viewer's would: the run trains on."""
    app = CockpitApp(request(tmp_path, "training.max_steps=100000", "checkpoint.every=0"), telemetry=False)
    try:
        async with app.run_test(size=(120, 40), notifications=True) as pilot:
            dash = dashboard(app)
            await wait_for(pilot, lambda: dash.view.step >= 2, what="training to start")
            await pilot.press("f")
            assert any("profile: the next 5 steps" in n.message for n in app._notifications)
            profiles = tmp_path / "run" / "profiles"
            await wait_for(pilot, lambda: any(line.startswith("profile: steps ") for line in dash.view.log_tail),
                           what="the profile's summary in the log")
            (folder,) = profiles.iterdir()
            assert (folder / "trace.json.gz").is_file()
            first = int(folder.name.removeprefix("step_"))
            await wait_for(pilot, lambda: dash.view.step >= first + 8, what="steps after the profile")
            assert dash.view.state == P.RUNNING
    finally:
        app.stop_runs(timeout=60)


def test_the_last_profile_is_in_the_history_a_viewer_is_handed_and_in_history_json():
    """Folded from its row (a folder's reader) and applied as an event (the run host, a cockpit),
    kept through the saved summary: a cockpit that attaches later has it."""
    from lmcockpit.core.run import rows
    from lmcockpit.core.run.history import History
    from lmcockpit.core.run.state import RunState

    profile = P.Profiled(12, 5, "runs/x/profiles/step_12/trace.json.gz", 0.75, {"matmul": 0.5, "idle": 0.25},
                         {"aten::mm": 0.5}, {}, "")
    folded = History()
    folded.fold(rows.row_of(profile))
    view = RunState()
    view.apply(profile)
    assert folded.profile == view.history.profile == profile
    assert History.from_state(json.loads(json.dumps(folded.state()))).profile == profile
    assert History.from_state(json.loads(json.dumps(History().state()))).profile is None
    before = History().state()
    del before["profile"]  # a history.json from before profiles
    assert History.from_state(before).profile is None


@pytest.mark.slow
def test_under_two_processes_rank_0_alone_profiles_and_the_run_finishes(tmp_path):
    cfg = tiny_config("training.max_steps=6", "eval.every=0", "distributed.nproc=2", "profile.at_step=3",
                      "profile.steps=2")
    engine, events = drive_engine(cfg, tmp_path / "run")
    assert engine.final_state == P.FINISHED
    (profile,) = [e for e in events if isinstance(e, P.Profiled)]
    assert [p.name for p in (tmp_path / "run" / "profiles").iterdir()] == ["step_3"]
    assert "aten::mm" in trace_names(Path(profile.trace))["cpu_op"]
    assert profile.kinds["communication"] > 0  # DDP's all-reduce of the gradients
    log = (tmp_path / "run" / "train.log").read_text()
    assert "rank0: profile: steps 3-4 took " in log and "rank1: profile" not in log


@pytest.mark.slow
def test_a_resume_may_set_profile_at_step_its_first_step_has_no_warm_up_and_one_behind_it_is_said(tmp_path):
    from lmcockpit.core.run.resume import plan_resume

    run = tmp_path / "run"
    engine, _ = drive_engine(tiny_config("training.max_steps=4", "eval.every=0"), run)
    assert engine.final_state == P.FINISHED
    engine, events = drive_engine(None, None, resume=plan_resume(str(run), ["training.max_steps=6",
                                                                          "profile.at_step=2"], None))
    assert "profile: profile.at_step = 2 is behind the run (step 4): no profile" in [
        e.text for e in events if isinstance(e, P.LogLine)]
    assert not [e for e in events if isinstance(e, P.Profiled)]
    engine, events = drive_engine(None, None, resume=plan_resume(str(run), ["training.max_steps=8",
                                                                          "profile.at_step=7", "profile.steps=2"], None))
    assert engine.final_state == P.FINISHED
    (profile,) = [e for e in events if isinstance(e, P.Profiled)]
    assert profile.step == 7 and (run / "profiles" / "step_7" / "trace.json.gz").is_file()
    assert f"profile: recording steps 7-8; the trace goes to {run / 'profiles' / 'step_7' / 'trace.json.gz'}" in [
        e.text for e in events if isinstance(e, P.LogLine)]

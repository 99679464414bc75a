"""`lmcockpit chat`: one-shot flags, the REPL driven through stdin, bad input, and the chat engine."""

import shutil
import subprocess
import threading
import time

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.infer.chat_engine import ChatEngine
from lmcockpit.core.infer.load import load
from lmcockpit.core.model.sampling import generate
from lmcockpit.core.run.checkpoint_folder import find_checkpoint
from lmcockpit.tui.commands.chat import HELP

from .helpers import NO_GPU, cli, engines_of


@pytest.fixture(scope="module")
def run(trained_run):
    run, proc = trained_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run


@pytest.fixture(scope="module")
def greedy(run):
    """prompt → its greedy continuation, computed here in the test process."""
    loaded = load(find_checkpoint(str(run)), "cpu")

    def continuation(prompt: str, n: int) -> str:
        ids = loaded.tokenizer.encode(prompt).ids
        out = [t for (t,) in generate(loaded.model, ids, n, greedy=True, eos_id=loaded.eos_id) if t is not None]
        return loaded.tokenizer.decode(out)
    return continuation


def chat(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`lmcockpit chat` on the CPU, whatever the machine: its text is compared with what this
    process computes there (on a GPU, "auto" would sample in bf16)."""
    return cli("chat", *args, env=NO_GPU, input=stdin)


@pytest.mark.slow
def test_one_shot_greedy_prints_exactly_the_prompt_and_its_greedy_continuation(run, greedy):
    proc = chat(str(run), "--greedy", "--prompt", "def ", "--max-new-tokens", "40")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "def " + greedy("def ", 40) + "\n"


@pytest.mark.slow
def test_one_shot_sampling_flags_and_seeds(run, greedy):
    # Each flag alone makes a draw at a high temperature greedy, where the defaults (temperature
    # 0.8, top-k 50, top-p 1) would sample: so each must reach the sampler.
    expected = "import " + greedy("import ", 16) + "\n"
    for alone in (["--temperature", "0"], ["--temperature", "2", "--top-k", "1"],
                  ["--temperature", "2", "--top-k", "0", "--top-p", "1e-6"]):
        proc = chat(str(run), "--prompt", "import ", "--max-new-tokens", "16", "--seed", "3", *alone)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == expected, alone

    flags = ["--prompt", "import ", "--num-samples", "3", "--temperature", "1.2", "--top-k", "40", "--top-p", "0.95",
             "--max-new-tokens", "16", "--device", "cpu"]
    a = chat(str(run), *flags, "--seed", "5")
    assert a.returncode == 0, a.stderr
    blocks = a.stdout.split("--- sample ")[1:]
    assert [b.split(" ---\n")[0] for b in blocks] == ["1 of 3", "2 of 3", "3 of 3"]
    assert all(b.split(" ---\n", 1)[1].startswith("import ") for b in blocks)
    assert len(set(b.split(" ---\n", 1)[1] for b in blocks)) > 1
    # a checkpoint folder works as well as its run folder; another seed, other text
    b = chat(str(run / "checkpoints" / "step_000012"), *flags, "--seed", "6")
    assert b.returncode == 0 and b.stdout.count("--- sample ") == 3 and b.stdout != a.stdout


@pytest.mark.slow
def test_repl_commands_through_stdin(run, greedy):
    script = "\n".join(["settings", "set temperature 0", "set max_new_tokens 12", "set bogus 1", "set top_p 2",
                        "set batch 2", "greedy def ", "batch class ", "help", "def ", "quit", "never sampled"]) + "\n"
    proc = chat(str(run), stdin=script)
    assert proc.returncode == 0, proc.stderr
    out, err = proc.stdout, proc.stderr
    assert "temperature = 0.8" in out and "top_p = 1.0" in out and "batch = 4" in out
    assert "error: set bogus: unknown setting" in err and "error: set top_p: expected a number in (0, 1]" in err
    # `greedy def ` and `def ` at temperature 0 give the same greedy text
    assert out.count("def " + greedy("def ", 12) + "\n") == 2
    assert "--- sample 1 of 2 ---\nclass " in out and "--- sample 2 of 2 ---\nclass " in out
    assert "greedy TEXT" in out and "set KEY VALUE" in out
    assert "never sampled" not in out
    assert "step 12" in err and "Traceback" not in err


@pytest.mark.slow
def test_bad_input_exits_2_with_a_message(run, tmp_path):
    no_ckpt = tmp_path / "fresh"
    (no_ckpt / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "config.toml", no_ckpt / "config.toml")
    cases = {
        (str(tmp_path / "missing"), "--prompt", "x"): "no such run folder",
        (str(tmp_path), "--prompt", "x"): "neither a run folder",
        (str(no_ckpt), "--prompt", "x"): "no complete checkpoint",
        (str(run), "--temperature", "-1"): "--temperature: expected a number, 0 or more",
        (str(run), "--top-p", "0"): "--top-p: expected a number in (0, 1]",
        (str(run), "--top-p", "1.5"): "--top-p",
        (str(run), "--num-samples", "0"): "--num-samples: expected an integer from 1 to 64",
        (str(run), "--max-new-tokens", "lots"): "--max-new-tokens: expected a positive integer",
        (str(run), "--device", "tpu"): "--device",
        (str(run), "--frobnicate"): "unrecognized arguments",
        (): "RUN_OR_CHECKPOINT",
    }
    for args, message in cases.items():
        proc = chat(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert "error: " in proc.stderr and message in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.slow
def test_a_damaged_checkpoint_exits_2_from_the_engine(run, tmp_path):
    ckpt = tmp_path / "run" / "checkpoints" / "step_000012"
    shutil.copytree(run / "checkpoints" / "step_000012", ckpt)
    shutil.copytree(run / "tokenizer", tmp_path / "run" / "tokenizer")
    (ckpt / "model.safetensors").write_bytes(b"not a tensor file")
    proc = chat(str(ckpt), "--prompt", "def ")
    assert proc.returncode == 2, proc.stderr
    assert "model.safetensors" in proc.stderr and "damaged" in proc.stderr and "Traceback" not in proc.stderr


def events_until(engine: ChatEngine, *wanted, timeout: float = 120) -> list:
    """Events until each of the `wanted` predicates has matched one (log lines arrive on a path of
    their own, so not necessarily in order with the rest)."""
    out, missing = [], list(wanted)
    deadline = time.monotonic() + timeout
    while missing:
        assert time.monotonic() < deadline, f"no end in {timeout}s: {out[-5:]}"
        ev = engine.poll(timeout=0.5)
        if ev is not None:
            out.append(ev)
            missing = [w for w in missing if not w(ev)]
    return out


def state(*states):
    return lambda e: isinstance(e, P.StateChanged) and e.state in states


def done(e) -> bool:
    return isinstance(e, P.SampleText) and e.done


@pytest.mark.slow
def test_chat_engine_answers_streamed_samples_until_aborted(run):
    engine = ChatEngine(run / "checkpoints" / "step_000012", "cpu")
    engine.start()
    try:
        ready = events_until(engine, state(P.RUNNING))
        assert isinstance(ready[0], P.StateChanged) and ready[0].state == P.PREPARING
        assert engine.loaded.start_step == 12 and engine.loaded.device == "cpu" and engine.loaded.n_params > 0
        engine.send(P.Sample("q1", "def ", max_new_tokens=24, temperature=1.0, num_samples=2, seed=1))
        got = events_until(engine, done)
        pieces = [e for e in got if isinstance(e, P.SampleText)]
        assert all(e.request_id == "q1" and e.step == 12 for e in pieces)
        assert len(pieces) > 3 and {e.row for e in pieces[:-1]} == {0, 1} and all(e.text for e in pieces[:-1])
        engine.send(P.Sample("q2", "def ", top_p=0.0))  # refused, logged, still done
        events_until(engine, done, lambda e: isinstance(e, P.LogLine) and "refused" in e.text and "top_p" in e.text)
        engine.send(P.Abort(save=False))
        events_until(engine, state(*P.TERMINAL_STATES))
        ended = time.monotonic()
        engine.process.join(timeout=30)
        # gone at once (exit_now: 0.02 s here): the interpreter's teardown took 0.5 s, which the
        # chat window's close waited for
        assert time.monotonic() - ended < 0.25
        assert engine.final_state == P.FINISHED and engine.process.exitcode == 0
    finally:
        engine.close()


def test_chat_engine_reports_a_missing_checkpoint_as_a_user_error(tmp_path):
    engine = ChatEngine(tmp_path / "nowhere", "cpu")
    engine.start()
    try:
        got = events_until(engine, state(*P.TERMINAL_STATES))
        failure = next(e for e in got if isinstance(e, P.Failure))
        assert failure.user_error and "no such run folder" in failure.message
        engine.process.join(timeout=30)
        assert engine.final_state == P.FAILED and engine.process.exitcode == 1
    finally:
        engine.close()


@pytest.mark.slow
def test_chat_engine_stops_a_generation_on_cancel_and_on_abort(run):
    """Commands are heard while a (here practically endless) generation runs: a Cancel ends it at
    once with its done marker and the engine answers the next request; an Abort ends the engine."""
    engine = ChatEngine(run, "cpu")
    engine.start()
    try:
        events_until(engine, state(P.RUNNING))
        engine.send(P.Sample("long", "def ", max_new_tokens=10_000_000, greedy=True))
        engine.send(P.Sample("queued", "class ", max_new_tokens=10_000_000, greedy=True))
        events_until(engine, lambda e: isinstance(e, P.SampleText) and e.request_id == "long" and e.text)
        engine.send(P.Cancel("queued"))  # waiting behind "long": dropped, still marked done
        engine.cancel("long")
        got = events_until(engine, lambda e: done(e) and e.request_id == "long",
                           lambda e: done(e) and e.request_id == "queued", timeout=30)
        assert not [e for e in got if isinstance(e, P.SampleText) and e.request_id == "queued" and e.text]
        engine.send(P.Sample("next", "import ", max_new_tokens=4))
        events_until(engine, lambda e: done(e) and e.request_id == "next", timeout=30)
        engine.send(P.Sample("endless", "def ", max_new_tokens=10_000_000, greedy=True))
        events_until(engine, lambda e: isinstance(e, P.SampleText) and e.request_id == "endless" and e.text)
        engine.send(P.Abort(save=False))
        events_until(engine, state(*P.TERMINAL_STATES), timeout=30)
        engine.process.join(timeout=30)
        assert engine.final_state == P.FINISHED and engine.process.exitcode == 0
    finally:
        engine.close()


@pytest.mark.slow
def test_repl_says_what_greedy_and_batch_expect_and_takes_the_cockpits_slash_commands(run, greedy):
    script = ("greedy\nbatch \n/set temperature 0\n/set max_new_tokens 12\n/set batch 2\n/settings\n"
              "/greedy def \n/batch class \n/frobnicate\n/help\n/quit\nnever sampled\n")
    proc = chat(str(run), stdin=script)
    assert proc.returncode == 0, proc.stderr
    out, err = proc.stdout, proc.stderr
    assert "error: greedy: expected the text to continue after it (greedy TEXT)" in err
    assert "error: batch: expected the text to continue after it (batch TEXT)" in err
    assert "error: /frobnicate: not a command" in err
    assert "temperature = 0.0" in out and "max_new_tokens = 12" in out and "batch = 2" in out
    assert out.count("def " + greedy("def ", 12) + "\n") == 1
    assert "--- sample 2 of 2 ---\nclass " in out and "set KEY VALUE" in out
    assert out.count("Commands (also with a leading /") == 1
    sampled = [line for line in out.replace(HELP, "").splitlines() if " = " not in line]
    assert not [line for line in sampled if line.startswith(("greedy", "batch", "/", "never"))], sampled
    assert "Traceback" not in err


# --------------------------------------------------------------- the REPL on a terminal
@pytest.mark.slow
def test_ctrl_c_stops_a_generation_and_the_repl_goes_on(run, terminal):
    term = terminal("chat", str(run))
    term.expect("> ")
    term.type("set max_new_tokens 10000000\n")
    term.expect("> ")
    term.type("greedy def \n")
    term.expect("def ")  # the echo of what was typed
    term.expect("def ")  # the prompt, streamed back before its continuation
    term.read(40)  # text is coming
    engine = engines_of(term.pid)
    term.type("\x03")
    # Ten million tokens never end within the deadline: the prompt comes back only if Ctrl-C
    # stopped the generation (it used to wait for it 10 s, then quit).
    stopped = term.expect("\n> ", timeout=60)
    assert "stopped by Ctrl-C" in stopped
    term.type("set max_new_tokens 4\n")
    term.expect("> ")
    term.type("greedy class \n")  # the same engine answers the next request
    term.expect("class ")
    answered = term.expect("\n> ")
    assert "class " in answered and "stopped by Ctrl-C" not in answered
    assert engines_of(term.pid) == engine and engine[0].is_running()
    term.type("quit\n")
    code, rest = term.end()
    assert code == 0, rest
    assert "Traceback" not in rest


@pytest.mark.slow
@pytest.mark.parametrize("key, code", [("\x04", 0), ("\x03", 130)])
def test_ctrl_d_and_ctrl_c_at_the_prompt_leave_the_shell_a_line_of_its_own(run, terminal, key, code):
    term = terminal("chat", str(run))
    term.expect("> ")
    term.wait_blocked_reading()
    term.type(key)
    got, rest = term.end()
    assert got == code, rest
    assert rest.endswith("\n") and "Traceback" not in rest, repr(rest)


# ----------------------------------------------------------------- the cockpit's chat screen
async def open_chat(pilot, app):
    from lmcockpit.tui.screens.checkpoint_chat import ChatScreen

    launch = app.screen
    launch.query_one("#runs").focus()
    await pilot.press("o")
    chat = app.screen
    assert isinstance(chat, ChatScreen) and chat.engine.pid is not None
    return launch, chat


def notes(app) -> list[str]:
    return [n.message for n in app._notifications]


@pytest.mark.slow
async def test_cockpit_chat_says_it_is_still_loading_and_closes_at_once_on_a_busy_engine(run, monkeypatch):
    """A prompt typed while the checkpoint loads is not blamed on an ended run; and Esc returns at
    once even when the engine does not answer (its load held for good here, as a long load or one
    slow token would hold it), which is killed in the background."""
    from lmcockpit.tui.app import CockpitApp
    from lmcockpit.tui.widgets.chat_pane import ChatPane

    from .helpers import wait_for

    monkeypatch.setenv("LMCOCKPIT_TEST_HOLD_LOAD", "1")  # the engine takes it from the app, as it starts
    app = CockpitApp(runs_root=run.parent, telemetry=False)
    async with app.run_test(size=(100, 30)) as pilot:
        launch, chat = await open_chat(pilot, app)
        await pilot.press(*"def ", "enter")
        assert chat.engine.loaded is None  # so the prompt really came while loading
        assert "still loading the checkpoint; try again in a moment" in notes(app)
        assert not [n for n in notes(app) if "nothing is listening" in n]
        assert not chat.query_one(ChatPane).history
        await pilot.press("escape")
        # Back on the launch screen while the held engine still lives: nothing waited for it on
        # the way (Esc used to wait 10 s); the closer thread ends it in the background.
        assert app.screen is launch
        assert chat.engine.process.is_alive(), "Esc waited for the engine"
        assert any(t.name == "lmcockpit-chat-close" and t.is_alive() for t in threading.enumerate())
        await wait_for(pilot, lambda: not chat.engine.process.is_alive(), timeout=30, what="the engine to end")


@pytest.mark.slow
async def test_cockpit_chat_closes_promptly_during_a_long_generation(run):
    from lmcockpit.tui.app import CockpitApp
    from lmcockpit.tui.widgets.chat_pane import ChatPane

    from .helpers import wait_for

    app = CockpitApp(runs_root=run.parent, telemetry=False)
    async with app.run_test(size=(100, 30)) as pilot:
        launch, chat = await open_chat(pilot, app)
        await wait_for(pilot, lambda: chat.engine.loaded is not None, what="the checkpoint to load")
        pane = chat.query_one(ChatPane)
        await pilot.press(*"/set max_new_tokens 10000000", "enter", *"/greedy def ", "enter")
        await wait_for(pilot, lambda: any(len(r) > 20 for e in pane.history.values() for r in e.rows.values()),
                       what="text to come")
        await pilot.press("escape")
        assert app.screen is launch
        await wait_for(pilot, lambda: not chat.engine.process.is_alive(), timeout=30, what="the engine to end")
        # it stopped on its own within the closer's grace (a generation that went on would be killed)
        assert chat.engine.process.exitcode == 0


@pytest.mark.slow
async def test_cockpit_chat_says_why_a_checkpoint_could_not_be_loaded(run, tmp_path):
    from lmcockpit.tui.app import CockpitApp
    from lmcockpit.tui.widgets.chat_pane import ChatPane

    from .helpers import wait_for

    copy = tmp_path / "runs" / "damaged"
    shutil.copytree(run, copy)
    for weights in copy.glob("checkpoints/step_*/model.safetensors"):
        weights.write_bytes(b"not a tensor file")
    app = CockpitApp(runs_root=copy.parent, telemetry=False)
    async with app.run_test(size=(100, 30)) as pilot:
        _, chat = await open_chat(pilot, app)
        await wait_for(pilot, lambda: chat.engine.done, what="the load to fail")
        await pilot.press(*"def ", "enter")
        said = [n for n in notes(app) if n.startswith("the checkpoint could not be loaded: ")]
        assert said and "model.safetensors" in said[0] and "damaged" in said[0], notes(app)
        assert not chat.query_one(ChatPane).history

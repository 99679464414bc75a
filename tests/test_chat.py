"""`lmcockpit chat`: one-shot flags, the REPL driven through stdin, bad input, and the chat engine."""

import shutil
import subprocess
import sys
import time

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.chat_engine import ChatEngine
from lmcockpit.core.inference import find_checkpoint, load
from lmcockpit.core.sampling import generate

from .conftest import cli


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
    if stdin is None:
        return cli("chat", *args)
    return subprocess.run([sys.executable, "-m", "lmcockpit.tui.cli", "chat", *args], input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_one_shot_greedy_prints_exactly_the_prompt_and_its_greedy_continuation(run, greedy):
    proc = chat(str(run), "--greedy", "--prompt", "def ", "--max-new-tokens", "40")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "def " + greedy("def ", 40) + "\n"


def test_one_shot_sampling_flags_and_seeds(run):
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
        engine.process.join(timeout=30)
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

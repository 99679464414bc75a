"""Shared fixtures: an isolated cache, tiny configs, and helpers that drive the real engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.config import Config, load_config
from lmcockpit.core.run.folder import create_run_dir

# Small everywhere: a 1 MB slice of the stdlib, a 512-token BPE, a 2-layer model of width 64.
TINY = [
    "training.max_steps=12", "training.log_every=4", "eval.every=6", "eval.batches=2",
    "sample.prompts=[]", "checkpoint.keep=2", "hardware.device=\"cpu\"",
]


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory) -> Path:
    """Every test (and every engine process they start) shares one token cache of its own."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    return cache / "lmcockpit"


def tiny_config(*overrides: str) -> Config:
    cfg, _ = load_config("debug", [*TINY, *overrides])
    return cfg


def drive_engine(cfg: Config, run_dir: Path, on_event=None, timeout: float = 300, resume=None, queued=(),
                 on_start=None):
    """Run the real engine process to its end; returns (engine, every event in order).
    `on_event(engine, event)` may send commands as events arrive; `queued` commands wait for the
    engine before it starts, so it takes them before its first step; `on_start(engine)` runs the
    moment it has started. `resume`: a resume.ResumePlan, whose run folder and checkpoint are used."""
    import time

    from lmcockpit.core.process.runner import EngineProcess

    if resume is not None:
        cfg, run_dir = resume.cfg, resume.run_dir
    else:
        run_dir = create_run_dir(cfg, "test", str(run_dir))
    engine = EngineProcess(cfg, run_dir, resume.checkpoint if resume is not None else None)
    for command in queued:
        engine.commands.put(command)
    engine.start()
    if on_start:
        on_start(engine)
    events = []
    deadline = time.monotonic() + timeout
    try:
        while not engine.done:
            assert time.monotonic() < deadline, f"engine did not finish in {timeout}s"
            ev = engine.poll(timeout=0.5)
            if ev is not None:
                events.append(ev)
                if on_event:
                    on_event(engine, ev)
    finally:
        engine.join(timeout=60)  # it exits on its own right after its last event
        engine.kill()  # only if a failed assertion left it running
        engine.join(timeout=30)
    return engine, events


def losses(events) -> list[float]:
    return [e.loss for e in events if isinstance(e, P.StepMetrics)]


def cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The real `lmcockpit` command, piped (so plain lines), as a user runs it."""
    return subprocess.run([sys.executable, "-m", "lmcockpit.tui.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


# The cpu preset shrunk to the debug preset's sizes; everything else (compile on) stays as shipped.
SHRINK_CPU = [
    "model.n_layer=2", "model.d_model=64", "model.mlp_hidden=0", "model.max_seq_len=64", "training.seq_len=64",
    "training.micro_batch_size=8", "data.max_bytes=1_000_000", "tokenizer.vocab_size=512",
    "tokenizer.train_bytes=300_000", "sample.max_new_tokens=16",
]


def as_flags(overrides: list[str]) -> list[str]:
    return [a for s in overrides for a in ("--set", s)]


def start_cli_run(out: Path, *overrides: str, until: str = "step 4/") -> subprocess.Popen:
    """A long tiny run through the real CLI, piped; returns once it printed a line starting with
    `until` (so training is really under way), the rest of its output still to be read."""
    proc = subprocess.Popen([sys.executable, "-m", "lmcockpit.tui.cli", "--run", "debug",
                             *as_flags([*TINY, "training.max_steps=100000", "eval.every=0", *overrides]),
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith(until):
            break
    return proc


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One shrunk cpu-preset run through the CLI, compiled, shared by the tests that only read
    what it left behind."""
    out = tmp_path_factory.mktemp("trained") / "run"
    proc = cli("--run", "cpu", *as_flags([*SHRINK_CPU, *TINY, "sample.prompts=[\"def \"]", "checkpoint.every=6"]),
               "--out", str(out))
    return out, proc

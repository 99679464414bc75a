"""What goes wrong around a run, as a user meets it through the real command: hang-ups under
nohup, runs that fail at their start (in the foreground or detached), closed pipes, damaged
files, Ctrl-C and hosts that never answer. Real processes, real files; waits poll the state they
wait for, with deadlines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from .conftest import TINY, as_flags


def cli_popen(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lmcockpit.tui.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def read_until(proc: subprocess.Popen, prefix: str) -> bool:
    """Read the command's stdout up to a line starting with `prefix`; False if it ended first."""
    for line in proc.stdout:
        if line.startswith(prefix):
            return True
    return False


# ----------------------------------------------------------------------------------- nohup
def test_a_run_started_with_hang_ups_ignored_trains_on_through_one(tmp_path):
    """`nohup lmcockpit --run ... &` and the SSH session drops: the hang-up reaches the whole job,
    front-end and engine, and both leave it ignored, as nohup asked."""
    out = tmp_path / "run"
    proc = cli_popen("--run", "debug", *as_flags([*TINY, "training.max_steps=100000", "eval.every=0"]),
                     "--out", str(out), start_new_session=True,
                     preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        assert read_until(proc, "step 4/"), proc.stderr.read()
        os.killpg(proc.pid, signal.SIGHUP)
        assert read_until(proc, "step 16/"), "the run stopped after the hang-up"
        proc.send_signal(signal.SIGTERM)  # still running: stopped here, in order
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "SIGHUP" not in rest + err + (out / "train.log").read_text()
    assert "SIGTERM: finishing this step" in rest

"""The tests' own CLI server (tests/cli_zygote.py): a forked command's engine comes from the server's
forkserver when the command's environment allows it, and from the command's own otherwise, as a
user's would. What makes the suite's hundreds of commands cheap is held here, not assumed."""

from __future__ import annotations

import signal

import pytest

from . import cli_zygote
from .helpers import engine_of, start_cli_run


@pytest.mark.slow
@pytest.mark.parametrize(("env", "shared"), [({}, True), ({"OMP_NUM_THREADS": "2"}, False)],
                         ids=["the server's environment", "one torch reads otherwise"])
def test_a_forked_command_s_engine_comes_from_the_server_s_forkserver_unless_its_environment_differs(
        tmp_path, env, shared):
    out = tmp_path / "run"
    proc = start_cli_run(out, env=env)
    try:
        forkserver = engine_of(out).parent()
        assert "multiprocessing.forkserver" in " ".join(forkserver.cmdline())
        assert forkserver.ppid() == (cli_zygote._the_server().proc.pid if shared else proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err

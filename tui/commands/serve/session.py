"""One browser tab's cockpit, as `lmcockpit serve` starts it, quitting if the server dies.

It runs the bare `lmcockpit` command (the launch screen), which also quits if the server dies without telling it to.

textual-serve tells each cockpit to quit when its tab closes or the server stops; a server that is
killed outright cannot, and Textual's web driver does not quit when its input ends, so the cockpit
would be left running with no one to see it. Linux can send a process a signal when its parent
dies: SIGTERM, which the web driver turns into a quit, as SIGHUP is for a closed terminal (a run
it started still stops with a checkpoint).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def quit_with_server() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: there the cockpit outlives a killed server
        pass


if __name__ == "__main__":  # python -m lmcockpit.tui.commands.serve.session SERVER_PID
    quit_with_server()
    if sys.argv[1:] != [str(os.getppid())]:
        sys.exit(0)  # the server died before prctl took effect: no one is left to see this cockpit
    from ...cli import main

    sys.exit(main([]))

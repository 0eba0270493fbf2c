"""The leash: a managed server's process group dies with the process that launched it.

Why: `ManagedServer` starts vLLM/SGLang in a process group of its own (so `stop()` reaches their
forked engine-core children), which also means nothing ends that group when the launching run is
SIGKILLed: the server, its workers and their memory stay (seen: two vLLM servers left by a killed
test run). PR_SET_PDEATHSIG would reach the leader only, and fires when the launching *thread*
exits, not the process.

Concept: this script (stdlib only, run by path with the launcher's interpreter) is the group
leader. It starts the server as its child in the same group and blocks on a pipe whose write end
only the launching process holds: end of file means the launcher is gone, and the leash sends the
group SIGTERM, then SIGKILL after a grace period. Otherwise it waits for the server and exits as
the server did (the same code, or the same signal), so the launcher reads the server's status.
Signals sent to the group reach the server directly; the leash ignores SIGTERM/SIGINT so it
outlives a graceful stop long enough to report the server's status.

Usage: `python _leash.py FD GRACE_S -- argv...`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time


def _watch(fd: int, grace_s: float) -> None:
    while os.read(fd, 4096):
        pass
    os.killpg(0, signal.SIGTERM)
    os.killpg(0, signal.SIGCONT)  # a stopped server handles the TERM now
    time.sleep(grace_s)
    os.killpg(0, signal.SIGKILL)


def main(argv: list[str]) -> None:
    fd, grace_s, sep, *command = argv
    assert sep == "--" and command, "usage: _leash.py FD GRACE_S -- argv..."
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    child = subprocess.Popen(command, restore_signals=True, preexec_fn=_default_signals)  # noqa: PLW1509
    threading.Thread(target=_watch, args=(int(fd), float(grace_s)), daemon=True).start()
    code = child.wait()
    if code < 0:  # mirror a death by signal (SIGKILL and SIGSTOP have no handler to reset)
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def _default_signals() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


if __name__ == "__main__":
    main(sys.argv[1:])

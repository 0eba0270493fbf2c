"""start_entrypoint(): run an image's ENTRYPOINT in a new sandbox, as Harbor's `docker compose up` does.

Concept: Harbor starts a task's container with its image's ENTRYPOINT and the command
`sh -c "sleep infinity"` (harbor/environments/docker/docker-compose-build.yaml overrides CMD, not
ENTRYPOINT). Tasks rely on it: an entrypoint that writes /etc/hosts and starts a server in the
background, then `exec "$@"`, sets the state the verifier checks. A docker sandbox gets this from
the engine at start, but before our workspace volume is seeded, so the docker provider resets it
and, like the local provider (bubblewrap over the unpacked root), calls this once the sandbox is
up and seeded: one exec starts `ENTRYPOINT sh -c "sleep infinity"` in the background (as
the image's USER, with its ENV and WORKDIR, as every exec) and waits until it is either running
the command it was given (it exec'd into `sh -c "sleep infinity"`, or that shell into `sleep`) or
has ended. It keeps running until the sandbox closes, as every process an exec starts.

- An entrypoint that ends with status 0 before that (a setup script that does not exec "$@") is
  fine: what it set up is there.
- One that ends with another status fails the sandbox's creation with its last output lines (a
  container would have stopped: Harbor's `up` fails too).
- One still doing something else after `ready_s` is left running, and the sandbox is used (Harbor
  waits for `exec true`, not for the entrypoint).

Its output goes to a file that is removed once it is ready (the process keeps writing to it, within
the sandbox's disk quota); nothing of this stays in the sandbox's files.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from miles_env.errors import SandboxError
from miles_env.sandbox import Sandbox

__all__ = ["HARBOR_COMMAND", "start_entrypoint"]

HARBOR_COMMAND = ("sh", "-c", "sleep infinity")  # the command Harbor's compose file gives every task
# $1: seconds to wait; then the entrypoint and its arguments. Prints "ready", "exited N" (and the
# output's last lines) or "waiting".
_STARTER = r"""
wait_s=$1; shift
log=$(mktemp)
"$@" </dev/null >"$log" 2>&1 &
pid=$!
n=0
while [ "$n" -lt $((wait_s * 10)) ]; do
  cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)
  case "$cmd" in
    "sh -c sleep infinity "|"sleep infinity ") rm -f "$log"; echo ready; exit 0 ;;
    "") wait "$pid"; rc=$?; echo "exited $rc"; tail -n 20 "$log"; rm -f "$log"; exit 0 ;;
  esac
  sleep 0.1
  n=$((n + 1))
done
rm -f "$log"
echo waiting
"""


async def start_entrypoint(sandbox: Sandbox, entrypoint: Sequence[str], ready_s: int = 30) -> str:
    """Start `entrypoint` + HARBOR_COMMAND in `sandbox`; "ready", "exited 0" or "waiting".
    SandboxError when it ends with another status (its last output lines in the message)."""
    if not entrypoint:
        return "none"
    argv = ["/bin/sh", "-c", _STARTER, "miles-env-entrypoint", str(ready_s), *entrypoint, *HARBOR_COMMAND]
    r = await sandbox.exec(argv, timeout=ready_s + 30)
    head, _, tail = r.stdout.strip().partition("\n")
    if r.exit_code != 0 or not head:
        how = (
            "timed out"
            if r.timed_out
            else f"killed_by_limit={r.killed_by_limit}"
            if r.killed_by_limit
            else ""
        )
        raise SandboxError(
            f"starting the image's ENTRYPOINT {shlex.join(entrypoint)} failed (exit {r.exit_code}"
            f"{', ' + how if how else ''}, after {r.duration_s:.1f}s): {(r.stderr or r.stdout).strip()[-500:]}"
        )
    if head.startswith("exited ") and head != "exited 0":
        raise SandboxError(
            f"the image's ENTRYPOINT {shlex.join(entrypoint)} {head} before running its command: "
            f"{tail.strip()[-800:] or 'no output'}"
        )
    return head

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
- One still doing something else after `ready_s` seconds (wall time) is left running, and the
  sandbox is used (Harbor waits for `exec true`, not for the entrypoint).

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
# output's last lines) or "waiting". The wait is wall time (/proc/uptime, in centiseconds, read by a
# builtin), not a count of polls: under load a poll (a fork of `tr`, a `sleep 0.1`) takes far more
# than 0.1 s, and a count would outlast the exec's timeout. An empty cmdline is not an end: the
# kernel shows one while the process is inside execve (the entrypoint's own exec, its `exec "$@"`,
# `sh -c` exec'ing `sleep`), a window a loaded machine stretches; read as an end, the starter
# `wait`ed on a live process until the exec's timeout SIGKILLed it (exit -9). Ended means /proc says
# so: a zombie, or no /proc entry (the shell reaped it while waiting for a poll's child).
_STARTER = r"""
wait_s=$1; shift
log=$(mktemp)
"$@" </dev/null >"$log" 2>&1 &
pid=$!
read -r up _ </proc/uptime
deadline=$(( ${up%.*}${up#*.} + wait_s * 100 ))
while :; do
  cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)
  case "$cmd" in
    "sh -c sleep infinity "|"sleep infinity ") rm -f "$log"; echo ready; exit 0 ;;
  esac
  state=Z
  if read -r stat 2>/dev/null <"/proc/$pid/stat"; then state=${stat##*) }; state=${state%% *}; fi
  if [ "$state" = Z ]; then
    wait "$pid"; rc=$?; echo "exited $rc"; tail -n 20 "$log"; rm -f "$log"; exit 0
  fi
  read -r up _ </proc/uptime
  [ "${up%.*}${up#*.}" -lt "$deadline" ] || break
  sleep 0.1
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

"""The raw outcome of one exec and how every provider reads it.

Concept: a provider runs a command its own way (a bwrap process, a Docker exec, a
framed script on a cloud backend) and reduces what happened to one `RawResult`:
the exit status as the runner saw it, the capped output, and whether our own
deadline or output cap ended it. `classify` then turns that into the contract's
`ExecResult.exit_code` and `killed_by_limit`, the same way for all of them, since
every provider applies the same rlimits (soft CPU < hard CPU, so SIGXCPU names
the cause; RLIMIT_FSIZE -> SIGXFSZ) and so sees the same signals and messages.

Invariant: a status of 128+N (how a shell or bwrap reports death by signal N)
is reported as -N, the way subprocess reports signals.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

__all__ = ["RawResult", "classify"]

_MEMORY_HINTS = re.compile(
    rb"MemoryError|Cannot allocate memory|std::bad_alloc|out of memory|memory exhausted"
    rb"|failed to reserve",
    re.IGNORECASE,
)
_FORK_HINTS = re.compile(rb"Cannot fork|fork: (retry|Resource temporarily unavailable)|can't fork")
_DISK_HINTS = re.compile(rb"No space left on device|Disk quota exceeded|File too large")


@dataclass(frozen=True, slots=True)
class RawResult:
    returncode: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    output_killed: bool
    truncated: bool
    duration_s: float


def classify(raw: RawResult, procs_refused: bool) -> tuple[int, str | None]:
    """Turn the runner's status into (exit_code, killed_by_limit).

    `procs_refused`: the provider saw its process limit refuse a fork (the local
    provider's pids cgroup counts those); others pass False and rely on the message.
    """
    code = raw.returncode
    if 128 < code < 160:
        code = -(code - 128)
    if raw.timed_out:
        return code, None
    if raw.output_killed:
        return code, "output"
    if code == -signal.SIGXCPU:
        return code, "cpu"
    if code == -signal.SIGXFSZ:
        return code, "disk"
    if code != 0 and (procs_refused or _FORK_HINTS.search(raw.stderr)):
        return code, "procs"
    if code != 0 and _DISK_HINTS.search(raw.stderr):  # the quota (a full tmpfs), not one file's size
        return code, "disk"
    if code != 0 and _MEMORY_HINTS.search(raw.stderr):
        return code, "memory"
    return code, None

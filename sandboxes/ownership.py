"""Ownership labels: who made a sandbox, when, and for how long it may live.

Every remote or containerised sandbox carries these labels (and the local
provider's workspaces an `owner.json` with the same keys), so a reaper can tell
a sandbox of a live run from one left behind by a crashed run:
stale = the owner process on this host is dead (pid gone, or the pid now
belongs to a process that started at another time) or the sandbox is older
than its TTL. Sandboxes of other hosts are judged by TTL only.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Ownership", "owner_labels", "is_stale", "pid_start_time", "PREFIX", "DEFAULT_TTL_S"]

PREFIX = "miles-env."
DEFAULT_TTL_S = 6 * 3600.0  # how long a sandbox may live when its maker names no TTL


def pid_start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), None if no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]


@dataclass(frozen=True, slots=True)
class Ownership:
    run_id: str
    host: str
    pid: int
    pid_start: str
    ttl_s: float

    @classmethod
    def here(cls, run_id: str | None, ttl_s: float) -> Ownership:
        pid = os.getpid()
        return cls(
            run_id=run_id or os.environ.get("MILES_ENV_RUN_ID") or secrets.token_hex(4),
            host=socket.gethostname(),
            pid=pid,
            pid_start=pid_start_time(pid) or "",
            ttl_s=ttl_s,
        )


def owner_labels(owner: Ownership, lifetime_s: float | None = None, **extra: str) -> dict[str, str]:
    """The labels of one sandbox; `lifetime_s` (its task's agent + verifier + margin, see
    miles_env/limits.py) raises the TTL recorded for it above the owner's, never lowers it."""
    ttl_s = owner.ttl_s if lifetime_s is None else max(owner.ttl_s, lifetime_s)
    labels = {
        "managed": "1",
        "run-id": owner.run_id,
        "owner-host": owner.host,
        "owner-pid": str(owner.pid),
        "owner-start": owner.pid_start,
        "created-at": f"{time.time():.3f}",
        "ttl-s": f"{ttl_s:g}",
    }
    labels.update({k.replace("_", "-"): v for k, v in extra.items()})
    return {PREFIX + k: v for k, v in labels.items()}


def is_stale(labels: Mapping[str, str], ttl_s: float | None = None, now: float | None = None) -> bool:
    """True when the sandbox these labels describe may be removed.

    ttl_s overrides the TTL recorded at creation (`miles-env sandbox gc --ttl`).
    """
    get = lambda k: labels.get(PREFIX + k, "")  # noqa: E731
    now = time.time() if now is None else now
    try:
        age = now - float(get("created-at"))
        ttl = ttl_s if ttl_s is not None else float(get("ttl-s"))
    except ValueError:
        return False  # not ours, or unreadable: never remove
    if age > ttl:
        return True
    if get("owner-host") != socket.gethostname() or not get("owner-pid").isdigit():
        return False
    start = pid_start_time(int(get("owner-pid")))
    return start is None or (get("owner-start") != "" and start != get("owner-start"))

"""Errors of task images: a build that failed, a base image that cannot be had.

Both are SandboxErrors (a sandbox could not be made from the task's image), so a rollout records
the episode as failed and the run goes on. Messages are one line first (what failed, naming the
Dockerfile or the image; for a build whose RUN step could not reach a host, that host: `unreached`),
then, for a failed build, the tail of the builder's log.
"""

from __future__ import annotations

import re

from miles_env.errors import SandboxError

__all__ = ["ImageError", "BaseUnavailable", "unreached"]


class ImageError(SandboxError):
    """A task image could not be built, pulled or unpacked."""


class BaseUnavailable(ImageError):
    """A base image is neither in a registry we reach, nor a mirror, nor an alias; or it is pinned."""


# What a download in a RUN step prints when its host is not reachable: curl (6), wget, apt, pip,
# go modules; the host named where the tool names it.
_UNREACHED = (
    re.compile(r"curl: \(6\) Could not resolve host: (\S+)"),
    re.compile(r"unable to resolve host address ['‘](\S+?)['’]"),
    re.compile(r"Temporary failure resolving ['‘](\S+?)['’]"),
    re.compile(r"dial tcp: lookup (\S+?)(?: on \S+)?: no such host"),
    re.compile(r"Failed to establish a new connection|Temporary failure in name resolution"),
)


_STEP = re.compile(r"^(?:STEP|Step) \d+/\d+ ?:", re.M)  # buildah's and dockerd's step headers


def unreached(log: str) -> str | None:
    """`a RUN step needs <host>, which this machine does not reach` when the failing (last) step's
    output says it could not resolve a host (the last one named), else None. A build has the
    network the host has (ImagesConfig.build_network): that host is out of reach, not the task
    broken. An earlier step's swallowed failure (`curl ... | sh` exits 0) is not the cause."""
    steps = list(_STEP.finditer(log))
    log = log[steps[-1].start() :] if steps else log
    hosts = [(m.start(), m.group(1) if m.groups() else None) for rx in _UNREACHED for m in rx.finditer(log)]
    if not hosts:
        return None
    host = max(hosts, key=lambda h: h[0])[1]
    return f"a RUN step needs {host or 'a host'}, which this machine does not reach (no route or name)"

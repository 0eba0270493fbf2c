"""Errors of task images: a build that failed, a base image that cannot be had.

Both are SandboxErrors (a sandbox could not be made from the task's image), so a rollout records
the episode as failed and the run goes on. Messages are one line first (what failed, naming the
Dockerfile or the image), then, for a failed build, the tail of the builder's log.
"""

from __future__ import annotations

from miles_env.errors import SandboxError

__all__ = ["ImageError", "BaseUnavailable"]


class ImageError(SandboxError):
    """A task image could not be built, pulled or unpacked."""


class BaseUnavailable(ImageError):
    """A base image is neither in a registry we reach, nor a mirror, nor an alias; or it is pinned."""

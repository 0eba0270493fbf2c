"""Calls into the Docker SDK from async code, and its errors translated once.

The SDK is synchronous: `call()` runs one call in a worker thread and turns an
engine error (refused, not found, unreachable) into a SandboxError naming the
operation (`map_error`); nothing above this module sees a docker or requests
exception.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import docker
import docker.errors
import requests.exceptions

from miles_env.errors import SandboxError

__all__ = ["ENGINE_ERRORS", "call", "map_error"]

T = TypeVar("T")
# What an SDK call raises when the engine refuses, misses a resource or cannot be reached.
ENGINE_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException, OSError)


def map_error(e: BaseException, what: str) -> SandboxError:
    """The SandboxError for engine error `e` during `what` (a SandboxError passes through)."""
    if isinstance(e, SandboxError):
        return e
    if isinstance(e, docker.errors.NotFound):
        return SandboxError(f"{what}: not found on the engine ({e.explanation or e})")
    if isinstance(e, docker.errors.APIError):
        return SandboxError(f"{what}: engine refused: {e.explanation or e}")
    if isinstance(e, requests.exceptions.RequestException | OSError):
        return SandboxError(f"{what}: engine unreachable: {e}")
    return SandboxError(f"{what}: {type(e).__name__}: {e}")


async def call(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` in a worker thread; an engine error becomes map_error(e, what)."""
    try:
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))
    except ENGINE_ERRORS as e:
        raise map_error(e, what) from e

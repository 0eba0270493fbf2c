"""The docker provider ("docker"): one container per sandbox on any Docker-API engine.

Use: `async with await DockerSandboxProvider().create(spec) as sb: await sb.exec("echo hi")`.
Layout (as sandboxes/local/): config.py (the config, no SDK needed), provider.py
(containers, images, the reaper), sandbox.py (the Sandbox), exec.py (Docker exec
with caps and kill-by-token), files.py (archive API), engine.py (SDK calls in
worker threads, errors mapped once).

The `docker` SDK is imported only when the provider or the sandbox is first
named, so `miles_env.sandboxes.docker.config` (and this package) imports without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import DEFAULT_IMAGE, DockerSandboxConfig

if TYPE_CHECKING:
    from .provider import DockerSandboxProvider
    from .sandbox import DockerSandbox

__all__ = ["DEFAULT_IMAGE", "DockerSandbox", "DockerSandboxConfig", "DockerSandboxProvider"]

_LAZY = {"DockerSandboxProvider": ".provider", "DockerSandbox": ".sandbox"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)

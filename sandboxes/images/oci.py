"""ImageConfig: the part of an OCI image config that a sandbox applies to its execs.

Concept: a container runs each `docker exec` with the image's `Env` (PATH included), as its
`User`, in its `WorkingDir`; a sandbox built from the same image must do the same, unless the
caller sets them. `ImageConfig.from_oci` reads the `config` object of an OCI image config
(the image-spec's `config.json`, or `docker image inspect`'s `.Config`); missing fields stay
None / empty, meaning "the provider's default". `entrypoint` is the image's ENTRYPOINT, which a
sandbox starts as Harbor's `docker compose up` does (entrypoint.py); a task's CMD is never run
(Harbor replaces it with `sh -c "sleep infinity"`), a compose sidecar's is, unless its service
gives a `command` (sandboxes/local/sidecars.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ImageConfig"]


@dataclass(frozen=True, slots=True)
class ImageConfig:
    env: Mapping[str, str] = field(default_factory=dict)  # the image's ENV, in order
    user: str | None = None  # "name", "uid", "uid:gid" or "name:group", as in USER
    workdir: str | None = None  # WORKDIR (absolute)
    entrypoint: tuple[str, ...] = ()  # ENTRYPOINT (exec form; a shell form is ["/bin/sh", "-c", ...])
    cmd: tuple[str, ...] = ()  # CMD, in the same forms

    @classmethod
    def from_oci(cls, config: Mapping[str, Any] | None) -> ImageConfig:
        """From an OCI config's `config` object (`Env` as "K=V" strings, `User`, `WorkingDir`,
        `Entrypoint`, `Cmd`)."""
        config = config or {}
        env: dict[str, str] = {}
        for item in config.get("Env") or []:
            key, sep, value = str(item).partition("=")
            if key and sep:
                env[key] = value
        return cls(
            env=env,
            user=config.get("User") or None,
            workdir=config.get("WorkingDir") or None,
            entrypoint=tuple(str(a) for a in config.get("Entrypoint") or ()),
            cmd=tuple(str(a) for a in config.get("Cmd") or ()),
        )

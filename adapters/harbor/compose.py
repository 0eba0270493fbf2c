"""A Harbor task's `environment/docker-compose.yaml`: the sidecar services beside the task's container.

Concept: Harbor merges the task's compose file over its own, where service `main` is the task's
container (built from environment/Dockerfile); every other service is a sidecar the task needs
running (a database, an API server the solution talks to by its service name). `sidecars(dir)`
reads them: name, image or build context (relative to the compose file), environment, command,
healthcheck. A sandbox that can run sidecars (`miles_env.sandbox.RunsSidecars`: the docker
and local providers) starts them in the task container's network namespace, each name resolving to it;
others refuse the task by name, before any step runs.

Invariant: reading is pure; a malformed file is a TaskError naming it and the service.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from miles_env.errors import TaskError

__all__ = ["Sidecar", "sidecars"]


@dataclass(frozen=True, slots=True)
class Sidecar:
    name: str
    image: str | None = None
    build: str | None = None  # an absolute build context directory
    dockerfile: str | None = None
    environment: dict[str, str] = field(default_factory=dict)
    command: list[str] | str | None = None
    healthcheck: list[str] | str | None = None  # compose's `test`, e.g. ["CMD", "curl", ...]


def _env(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, dict):
        return {str(k): "" if v is None else str(v) for k, v in value.items()}
    if isinstance(value, list):
        return dict(str(item).partition("=")[::2] for item in value)
    raise TaskError(f"{where}: environment: expected a mapping or a list of KEY=VALUE")


def _service(name: str, svc: Any, base: Path, where: str) -> Sidecar:
    if not isinstance(svc, dict):
        raise TaskError(f"{where}: services.{name}: expected a mapping")
    build = svc.get("build")
    context, dockerfile = None, None
    if isinstance(build, str):
        context = build
    elif isinstance(build, dict):
        context, dockerfile = build.get("context", "."), build.get("dockerfile")
    if context is None and not svc.get("image"):
        raise TaskError(f"{where}: services.{name}: needs an image or a build")
    health = svc.get("healthcheck") or {}
    return Sidecar(
        name=name,
        image=svc.get("image") if context is None else None,
        build=str((base / context).resolve()) if context is not None else None,
        dockerfile=dockerfile,
        environment=_env(svc.get("environment"), f"{where}: services.{name}"),
        command=svc.get("command"),
        healthcheck=health.get("test") if isinstance(health, dict) else None,
    )


def sidecars(env_dir: Path) -> list[Sidecar]:
    """The services of environment/docker-compose.yaml other than `main` ([] without the file)."""
    path = next(
        (env_dir / n for n in ("docker-compose.yaml", "docker-compose.yml") if (env_dir / n).is_file()), None
    )
    if path is None:
        return []
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise TaskError(f"{path}: {e}") from e
    services = doc.get("services") or {} if isinstance(doc, dict) else None
    if not isinstance(services, dict):
        raise TaskError(f"{path}: services: expected a mapping")
    return [_service(str(n), s, path.parent, str(path)) for n, s in services.items() if n != "main"]

"""The daytona provider ("daytona"): Daytona sandboxes through the `daytona` SDK's AsyncDaytona.

Credentials: DAYTONA_API_KEY (and optionally DAYTONA_API_URL, DAYTONA_TARGET).
Mapping: spec.image -> CreateSandboxFromImageParams(image=...); spec.build (a Docker build
context) -> image=Image.from_dockerfile(<context>/Dockerfile), which Daytona builds with the
context's files; else the default snapshot; ownership labels -> labels (the reaper lists by them); spec.env ->
env_vars; network NONE -> network_block_all=True (public, host: the service's network); the task's cpus (else
config.cpus), memory_mb and disk_mb -> Resources(cpu, memory GiB, disk GiB; rounded
up); lifetime (sizing.py: TTL, at least the task's timeouts) -> auto_stop_interval (minutes). Exec output is one combined stream on
Daytona; the framing in cloud.py separates stdout and stderr again.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import Field

from miles_env.errors import SandboxUnavailable
from miles_env.types import NetworkPolicy, SandboxSpec

from .cloud import CloudConfig, CloudSandboxProvider, env_credential
from .sizing import sizing

__all__ = ["DaytonaSandboxConfig", "DaytonaSandboxProvider", "DaytonaAdapter"]


class DaytonaSandboxConfig(CloudConfig):
    api_key: str | None = Field(None, description="None = $DAYTONA_API_KEY")
    api_url: str | None = Field(None, description="None = $DAYTONA_API_URL or the SDK's default")
    target: str | None = None


class DaytonaAdapter:
    def __init__(self, config: DaytonaSandboxConfig, sdk: Any) -> None:
        self.config = config
        self.sdk = sdk
        self.api_key = config.api_key or env_credential("DAYTONA_API_KEY")
        self._client: Any = None

    def client(self) -> Any:
        if self._client is None:
            cfg = self.sdk.DaytonaConfig(
                api_key=self.api_key,
                api_url=self.config.api_url or env_credential("DAYTONA_API_URL"),
                target=self.config.target or env_credential("DAYTONA_TARGET"),
            )
            self._client = self.sdk.AsyncDaytona(cfg)
        return self._client

    def create_params(self, spec: SandboxSpec, labels: dict[str, str]) -> Any:
        size = sizing(spec, self.config.cpus, self.config.ttl_s)
        common: dict[str, Any] = {
            "labels": labels,
            "env_vars": dict(spec.env),
            "network_block_all": spec.network is NetworkPolicy.NONE,
            "auto_stop_interval": max(1, math.ceil(size.lifetime_s / 60)),
        }
        image: Any = spec.image or self.config.image
        if spec.image is None and spec.build is not None:  # Daytona builds the task's Dockerfile
            image = self.sdk.Image.from_dockerfile(Path(spec.build) / "Dockerfile")
        if image is None:
            return self.sdk.CreateSandboxFromSnapshotParams(**common)
        resources = self.sdk.Resources(
            cpu=max(1, math.ceil(size.cpus)),
            memory=max(1, math.ceil(size.memory_mb / 1024)),
            disk=max(1, math.ceil(size.disk_mb / 1024)),
        )
        return self.sdk.CreateSandboxFromImageParams(image=image, resources=resources, **common)

    async def create(self, spec: SandboxSpec, labels: dict[str, str]) -> Any:
        return await self.client().create(
            self.create_params(spec, labels), timeout=self.config.create_timeout_s
        )

    async def run(self, handle: Any, script: str, timeout: float) -> tuple[int, str]:
        response = await handle.process.exec(script, cwd="/", timeout=math.ceil(timeout))
        return int(response.exit_code), str(response.result)

    async def delete(self, handle: Any) -> None:
        await self.client().delete(handle)

    def sandbox_id(self, handle: Any) -> str:
        return str(handle.id)

    async def list_owned(self) -> list[tuple[str, dict[str, str]]]:
        page = await self.client().list(labels={"miles-env.managed": "1"})
        items = getattr(page, "items", page)
        return [(str(s.id), dict(s.labels or {})) for s in items]

    async def delete_id(self, sandbox_id: str) -> None:
        client = self.client()
        await client.delete(await client.get(sandbox_id))


class DaytonaSandboxProvider(CloudSandboxProvider):
    name = "daytona"

    def __init__(self, config: DaytonaSandboxConfig | None = None, *, sdk: Any = None) -> None:
        config = config or DaytonaSandboxConfig()
        if sdk is None and not (config.api_key or env_credential("DAYTONA_API_KEY")):
            raise SandboxUnavailable("the daytona provider needs credentials: set DAYTONA_API_KEY")
        if sdk is None:
            try:
                import daytona as sdk_module
            except ImportError as e:
                raise SandboxUnavailable(
                    "the daytona provider needs the `daytona` package: pip install daytona"
                ) from e
            sdk = sdk_module
        adapter = DaytonaAdapter(config, sdk)
        if not adapter.api_key:
            raise SandboxUnavailable("the daytona provider needs credentials: set DAYTONA_API_KEY")
        super().__init__(config, adapter)

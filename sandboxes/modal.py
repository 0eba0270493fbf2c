"""The modal provider ("modal"): Modal sandboxes through the `modal` SDK's `.aio` interface.

Credentials: MODAL_TOKEN_ID and MODAL_TOKEN_SECRET (or ~/.modal.toml).
Mapping: spec.image (else config.image, else debian_slim) -> Image.from_registry; spec.build (a
Docker build context) -> Image.from_dockerfile(<context>/Dockerfile, context_dir=<context>), which
Modal builds;
network NONE -> block_network=True (public, host: the service's network); memory_mb -> memory (MiB); the task's cpus
(else config.cpus) -> cpu; lifetime (sizing.py: TTL, at least the task's timeouts) -> timeout;
disk_mb has no create argument in the pinned SDK (the sandbox's own disk, capped per exec by
RLIMIT_FSIZE); ownership labels -> sandbox tags (the reaper lists by them);
the sandbox runs `sleep infinity` and each exec is `sb.exec("sh", "-c", ...)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from miles_env.errors import SandboxUnavailable
from miles_env.types import NetworkPolicy, SandboxSpec

from .cloud import CloudConfig, CloudSandboxProvider, env_credential
from .sizing import sizing

__all__ = ["ModalSandboxConfig", "ModalSandboxProvider", "ModalAdapter"]


class ModalSandboxConfig(CloudConfig):
    app_name: str = Field("miles-env-sandboxes", description="Modal app the sandboxes belong to")


class ModalAdapter:
    def __init__(self, config: ModalSandboxConfig, sdk: Any) -> None:
        self.config = config
        self.sdk = sdk
        self._app: Any = None

    async def app(self) -> Any:
        if self._app is None:
            self._app = await self.sdk.App.lookup.aio(self.config.app_name, create_if_missing=True)
        return self._app

    def create_params(self, spec: SandboxSpec) -> dict[str, Any]:
        image = spec.image or self.config.image
        size = sizing(spec, self.config.cpus, self.config.ttl_s)
        if spec.image is None and spec.build is not None:  # Modal builds the task's Dockerfile
            built = self.sdk.Image.from_dockerfile(Path(spec.build) / "Dockerfile", context_dir=spec.build)
        else:
            built = self.sdk.Image.from_registry(image) if image else self.sdk.Image.debian_slim()
        return {
            "image": built,
            "block_network": spec.network is NetworkPolicy.NONE,
            "timeout": int(size.lifetime_s),
            "cpu": size.cpus,
            "memory": size.memory_mb,
            "env": dict(spec.env),
        }

    async def create(self, spec: SandboxSpec, labels: dict[str, str]) -> Any:
        sb = await self.sdk.Sandbox.create.aio(
            "sleep", "infinity", app=await self.app(), **self.create_params(spec)
        )
        try:
            await sb.set_tags.aio(labels)
        except BaseException:
            await sb.terminate.aio()
            raise
        return sb

    async def run(self, handle: Any, script: str, timeout: float) -> tuple[int, str]:
        process = await handle.exec.aio("sh", "-c", script, timeout=int(timeout) + 1)
        out = await process.stdout.read.aio()
        code = await process.wait.aio()
        return int(code), out if isinstance(out, str) else out.decode("utf-8", "replace")

    async def delete(self, handle: Any) -> None:
        await handle.terminate.aio()

    def sandbox_id(self, handle: Any) -> str:
        return str(handle.object_id)

    async def list_owned(self) -> list[tuple[str, dict[str, str]]]:
        app = await self.app()
        found = []
        async for sb in self.sdk.Sandbox.list.aio(app_id=app.app_id, tags={"miles-env.managed": "1"}):
            found.append((str(sb.object_id), dict(await sb.get_tags.aio())))
        return found

    async def delete_id(self, sandbox_id: str) -> None:
        sb = await self.sdk.Sandbox.from_id.aio(sandbox_id)
        await sb.terminate.aio()


class ModalSandboxProvider(CloudSandboxProvider):
    name = "modal"

    def __init__(self, config: ModalSandboxConfig | None = None, *, sdk: Any = None) -> None:
        config = config or ModalSandboxConfig()
        if sdk is None:
            if not (env_credential("MODAL_TOKEN_ID") and env_credential("MODAL_TOKEN_SECRET")):
                raise SandboxUnavailable(
                    "the modal provider needs credentials: set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET"
                )
            try:
                import modal as sdk_module
            except ImportError as e:
                raise SandboxUnavailable(
                    "the modal provider needs the `modal` package: pip install modal"
                ) from e
            sdk = sdk_module
        super().__init__(config, ModalAdapter(config, sdk))

"""The e2b provider ("e2b"): E2B cloud sandboxes through the `e2b` SDK's AsyncSandbox.

Credentials: E2B_API_KEY (or config.api_key). The SDK is imported when the
provider is built, so the rest of miles-env never needs it. Mapping: spec.image
(else config.image, else E2B's "base" template) -> template; ownership labels ->
metadata (listed and filtered by the reaper); spec.env -> envs; network NONE ->
allow_internet_access=False (public, host: True; no cloud sandbox shares this host's network); lifetime (sizing.py: TTL, at least the task's timeouts)
-> the sandbox's own timeout. A build context (SandboxSpec.build) needs a template built from it
first (E2B builds templates, not Dockerfiles at create): a ConfigError says so. CPU, memory and
disk are the template's (E2B sizes at template build, not at create): pick a template sized for
the task. expose() needs
config.expose_url (E2B sandboxes cannot reach this host).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from miles_env.errors import ConfigError, SandboxUnavailable
from miles_env.types import NetworkPolicy, SandboxSpec

from .cloud import CloudConfig, CloudSandboxProvider, env_credential
from .sizing import sizing

__all__ = ["E2BSandboxConfig", "E2BSandboxProvider", "E2BAdapter"]


class E2BSandboxConfig(CloudConfig):
    api_key: str | None = Field(None, description="None = $E2B_API_KEY")
    domain: str | None = None


class E2BAdapter:
    def __init__(self, config: E2BSandboxConfig, sdk: Any) -> None:
        self.config = config
        self.sdk = sdk
        self.api_key = config.api_key or env_credential("E2B_API_KEY")

    def create_params(self, spec: SandboxSpec, labels: dict[str, str]) -> dict[str, Any]:
        if spec.build is not None and spec.image is None and self.config.image is None:
            raise ConfigError(
                f"e2b: SandboxSpec.build={spec.build!r}: E2B runs templates, not Dockerfiles; build a "
                "template from it (`e2b template build`) and name it in SandboxSpec.image or sandbox.image"
            )
        params: dict[str, Any] = {
            "template": spec.image or self.config.image or "base",
            "timeout": int(sizing(spec, self.config.cpus, self.config.ttl_s).lifetime_s),
            "metadata": labels,
            "envs": dict(spec.env),
            "allow_internet_access": spec.network is not NetworkPolicy.NONE,
            "api_key": self.api_key,
        }
        if self.config.domain:
            params["domain"] = self.config.domain
        return params

    async def create(self, spec: SandboxSpec, labels: dict[str, str]) -> Any:
        return await self.sdk.AsyncSandbox.create(**self.create_params(spec, labels))

    async def run(self, handle: Any, script: str, timeout: float) -> tuple[int, str]:
        result = await handle.commands.run(script, timeout=timeout)
        return int(result.exit_code), str(result.stdout)

    async def delete(self, handle: Any) -> None:
        await handle.kill()

    def sandbox_id(self, handle: Any) -> str:
        return str(handle.sandbox_id)

    async def list_owned(self) -> list[tuple[str, dict[str, str]]]:
        query = self.sdk.SandboxQuery(metadata={"miles-env.managed": "1"})
        paginator = self.sdk.AsyncSandbox.list(query=query, api_key=self.api_key)
        found: list[tuple[str, dict[str, str]]] = []
        while paginator.has_next:
            for info in await paginator.next_items():
                found.append((str(info.sandbox_id), dict(info.metadata or {})))
        return found

    async def delete_id(self, sandbox_id: str) -> None:
        await self.sdk.AsyncSandbox.kill(sandbox_id, api_key=self.api_key)


class E2BSandboxProvider(CloudSandboxProvider):
    name = "e2b"

    def __init__(self, config: E2BSandboxConfig | None = None, *, sdk: Any = None) -> None:
        config = config or E2BSandboxConfig()
        if sdk is None and not (config.api_key or env_credential("E2B_API_KEY")):
            raise SandboxUnavailable("the e2b provider needs credentials: set E2B_API_KEY")
        if sdk is None:
            try:
                import e2b as sdk_module
            except ImportError as e:
                raise SandboxUnavailable("the e2b provider needs the `e2b` package: pip install e2b") from e
            sdk = sdk_module
        adapter = E2BAdapter(config, sdk)
        if not adapter.api_key:
            raise SandboxUnavailable("the e2b provider needs credentials: set E2B_API_KEY")
        super().__init__(config, adapter)

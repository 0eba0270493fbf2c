"""The agentenv provider ("agentenv"): Scale AI's AgentEnv sandbox providers (`agentenv-framework`).

AgentEnv fronts several backends (modal, e2b, daytona, ...), chosen by name
(config.backend, e.g. "modal" or "e2b,modal" for a fallback chain) through
`agent_env.providers.sandbox_providers.build_sandbox_provider`; credentials are
that backend's (AGENTENV_BACKEND picks it when config.backend is unset).
Mapping: spec.image -> image_name; spec.env -> env; memory_mb -> memory (MiB);
the task's cpus (else config.cpus) -> cpu; lifetime (sizing.py: TTL, at least the
task's timeouts) -> timeout; exec is `exec_with_output("sh", "-c", script)`.
AgentEnv has no label query, so reap() only sees sandboxes this process made.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from miles_env.errors import SandboxUnavailable
from miles_env.types import SandboxSpec

from .cloud import CloudConfig, CloudSandboxProvider, env_credential
from .sizing import sizing

__all__ = ["AgentEnvSandboxConfig", "AgentEnvSandboxProvider", "AgentEnvAdapter"]


class AgentEnvSandboxConfig(CloudConfig):
    backend: str | None = Field(
        None, description="AgentEnv sandbox backend name(s); None = $AGENTENV_BACKEND"
    )
    port: int = Field(8000, description="port AgentEnv publishes from the sandbox")


class AgentEnvAdapter:
    def __init__(self, config: AgentEnvSandboxConfig, provider: Any) -> None:
        self.config = config
        self.provider = provider
        self.made: dict[str, tuple[Any, dict[str, str]]] = {}

    def create_params(self, spec: SandboxSpec) -> dict[str, Any]:
        size = sizing(spec, self.config.cpus, self.config.ttl_s)
        return {
            "image_name": spec.image or self.config.image or "python:3.12-slim",
            "port": self.config.port,
            "env": dict(spec.env),
            "cpu": size.cpus,
            "memory": size.memory_mb,
            "timeout": int(size.lifetime_s),
        }

    async def create(self, spec: SandboxSpec, labels: dict[str, str]) -> Any:
        sb = await self.provider.create_sandbox(**self.create_params(spec))
        self.made[str(sb.sandbox_id)] = (sb, labels)
        return sb

    async def run(self, handle: Any, script: str, timeout: float) -> tuple[int, str]:
        code, out, _ = await handle.exec_with_output("sh", "-c", script)
        return int(code), str(out)

    async def delete(self, handle: Any) -> None:
        self.made.pop(str(handle.sandbox_id), None)
        await handle.terminate()

    def sandbox_id(self, handle: Any) -> str:
        return str(handle.sandbox_id)

    async def list_owned(self) -> list[tuple[str, dict[str, str]]]:
        return [(sid, labels) for sid, (_, labels) in self.made.items()]

    async def delete_id(self, sandbox_id: str) -> None:
        self.made.pop(sandbox_id, None)
        await self.provider.terminate_sandbox(sandbox_id)


class AgentEnvSandboxProvider(CloudSandboxProvider):
    name = "agentenv"

    def __init__(self, config: AgentEnvSandboxConfig | None = None, *, provider: Any = None) -> None:
        config = config or AgentEnvSandboxConfig()
        if provider is None:
            backend = config.backend or env_credential("AGENTENV_BACKEND")
            if not backend:
                raise SandboxUnavailable(
                    "the agentenv provider needs a backend with credentials: set AGENTENV_BACKEND (e.g. modal, e2b)"
                )
            try:
                from agent_env.providers.sandbox_providers import build_sandbox_provider
            except ImportError as e:
                raise SandboxUnavailable(
                    "the agentenv provider needs `agentenv-framework`: pip install agentenv-framework"
                ) from e
            provider = build_sandbox_provider(backend)
        super().__init__(config, AgentEnvAdapter(config, provider))

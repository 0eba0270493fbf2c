"""Configuration of the docker provider; stdlib and pydantic only, so it imports without the SDK.

A run config validates `DockerSandboxConfig` without the `docker` package installed;
the provider itself (provider.py) needs it. DEFAULT_IMAGE is the image
scripts/start-dockerd.sh imports from the host's own binaries (no registry).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_env.sandboxes.images.config import ImagesConfig

__all__ = ["DEFAULT_IMAGE", "DockerSandboxConfig"]

DEFAULT_IMAGE = "miles-env/hostroot:latest"


class DockerSandboxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str | None = Field(None, description="engine URL; None = DOCKER_HOST or the default socket")
    image: str = Field(DEFAULT_IMAGE, description="image used when SandboxSpec.image is None")
    cpus: float = Field(1.0, gt=0, description="CPU quota per sandbox")
    tmp_mb: int = Field(256, gt=0, description="size of the tmpfs at /tmp")
    run_root: str | None = Field(
        None, description="host dir for expose() sockets; None = <tmp>/miles-env-docker"
    )
    run_id: str | None = Field(None, description="ownership label; None = $MILES_ENV_RUN_ID or random")
    ttl_s: float = Field(6 * 3600, gt=0, description="age after which the reaper may remove a sandbox")
    api_timeout_s: float = Field(60.0, gt=0, description="per engine API call")
    expose_url: str | None = Field(
        None, description="public URL of the proxy to return from expose() (remote engines)"
    )
    images: ImagesConfig = Field(
        default_factory=ImagesConfig, description="where task images' bases come from (mirrors, aliases)"
    )
    build_network: Literal["default", "host"] | None = Field(
        None, description="network of RUN steps in builds; None = the engine's bridge, else the host's"
    )
    max_read_bytes: int = Field(
        64 << 20, gt=0, description="largest file read_file() returns; a larger one is a SandboxError"
    )

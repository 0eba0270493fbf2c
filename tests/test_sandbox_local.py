"""The local (bubblewrap) provider: the shared contract, then isolation and limits with hostile commands."""

from __future__ import annotations

import os
import socket
import threading
import time

import anyio
import pytest
from sandbox_contract import FETCH, SandboxContract, host_http_server  # noqa: F401

from miles_env.errors import ConfigError, SandboxError, SandboxUnavailable
from miles_env.sandboxes import get_provider
from miles_env.sandboxes.local import LocalSandboxConfig, LocalSandboxProvider
from miles_env.types import Resources, SandboxSpec

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def provider(tmp_path) -> LocalSandboxProvider:
    return LocalSandboxProvider(LocalSandboxConfig(root_dir=str(tmp_path / "sandboxes")))


class TestLocalContract(SandboxContract):
    pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _pids_with_marker(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return [p for p in found if _alive(p) and p != os.getpid()]

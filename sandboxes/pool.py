"""SandboxPool: a SandboxProvider in front of any provider, and the orphan reaper.

Concept: `SandboxPool(provider, max_concurrency=, warm=, ttl_s=, retry=)` is itself a
SandboxProvider, so it drops in wherever a provider goes. It bounds how many
sandboxes are open at once (a slot is taken in create() and given back by the
sandbox's close()), keeps up to `warm` ready sandboxes per spec (made by
`prewarm()`, refilled in the background while the pool is entered with `async
with`), and retries creation on SandboxThrottled with jittered exponential
backoff (full jitter, honouring the backend's retry-after hint).

Invariants: a create() that fails or is cancelled gives its slot back and leaves
no sandbox behind (providers clean up their own partial creations; the pool
closes a sandbox it can no longer hand out); warm sandboxes older than ttl_s
are closed instead of handed out; leaving the pool closes every warm sandbox.

Reaper: `reap(name, ttl_s)` removes sandboxes left behind by crashed runs through
the provider's `reap()` (the Reapable capability, miles_env/sandbox.py): by their
ownership labels (ownership.py); for "local", by the owner.json the pool writes
into each workspace it hands out (local/reaper.py).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from miles_env.errors import SandboxError, SandboxThrottled
from miles_env.limits import sandbox_lifetime_s
from miles_env.sandbox import Command, Reapable, Sandbox, SandboxProvider
from miles_env.sandboxes.fleet_config import RetryPolicy
from miles_env.types import ExecResult, SandboxSpec

from .ownership import DEFAULT_TTL_S, Ownership, owner_labels

__all__ = ["RetryPolicy", "SandboxPool", "PooledSandbox", "PoolStats", "reap", "reap_provider"]


@dataclass(slots=True)
class PoolStats:
    created: int = 0
    warm_hits: int = 0
    retries: int = 0
    expired: int = 0


@dataclass(slots=True)
class _Warm:
    sandbox: Sandbox
    made_at: float


class PooledSandbox:
    """A sandbox handed out by a pool: closing it gives the pool's slot back (once)."""

    def __init__(self, inner: Sandbox, release: Any) -> None:
        self.inner = inner
        self.id = inner.id
        self.workdir = inner.workdir
        self._release = release

    async def exec(
        self,
        cmd: Command,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        user: str | None = None,
    ) -> ExecResult:
        return await self.inner.exec(cmd, timeout=timeout, cwd=cwd, env=env, stdin=stdin, user=user)

    async def write_file(self, path: str, data: bytes | str) -> None:
        await self.inner.write_file(path, data)

    async def read_file(self, path: str) -> bytes:
        return await self.inner.read_file(path)

    async def expose(self, url: str) -> str:
        return await self.inner.expose(url)

    async def close(self) -> None:
        try:
            await self.inner.close()
        finally:
            if self._release is not None:
                release, self._release = self._release, None
                release()

    async def __aenter__(self) -> PooledSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __getattr__(self, name: str) -> Any:  # provider-specific extras (host_dir, container_id, ...)
        return getattr(self.inner, name)


class SandboxPool:
    """SandboxProvider wrapping `provider` with a concurrency limit, warm sandboxes and retries."""

    def __init__(
        self,
        provider: SandboxProvider,
        *,
        max_concurrency: int = 16,
        warm: int = 0,
        ttl_s: float = DEFAULT_TTL_S,
        retry: RetryPolicy | None = None,
    ) -> None:
        if max_concurrency < 1 or warm < 0:
            raise SandboxError(
                f"SandboxPool: max_concurrency={max_concurrency} must be >= 1, warm={warm} >= 0"
            )
        self.provider = provider
        self.name = provider.name
        self.max_concurrency = max_concurrency
        self.warm = warm
        self.ttl_s = ttl_s
        self.retry = retry or RetryPolicy()
        self.stats = PoolStats()
        self.owner = Ownership.here(None, ttl_s)
        self._slots = anyio.Semaphore(max_concurrency)
        self._warm: dict[str, deque[_Warm]] = defaultdict(deque)
        self._specs: dict[str, SandboxSpec] = {}
        self._filling: dict[str, int] = defaultdict(int)
        self._tg: TaskGroup | None = None

    @property
    def in_use(self) -> int:
        return self.max_concurrency - self._slots.value

    # -- creation ---------------------------------------------------------------------------
    async def _create_with_retry(self, spec: SandboxSpec) -> Sandbox:
        for attempt in range(self.retry.attempts):
            try:
                sandbox = await self.provider.create(spec)
            except SandboxThrottled as e:
                if attempt + 1 >= self.retry.attempts:
                    raise SandboxThrottled(
                        f"{self.name}: still throttled after {self.retry.attempts} attempts: {e}",
                        e.retry_after,
                    ) from e
                self.stats.retries += 1
                await anyio.sleep(self.retry.delay(attempt, e.retry_after))
                continue
            try:
                # A cancellation pending since the provider's last await must not lose the sandbox.
                await anyio.lowlevel.checkpoint_if_cancelled()
                _mark_local_owner(sandbox, self.owner, spec)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await sandbox.close()
                raise
            self.stats.created += 1
            return sandbox
        raise AssertionError("unreachable")

    def _take_warm(self, key: str) -> Sandbox | None:
        queue = self._warm.get(key)
        while queue:
            item = queue.popleft()
            if time.monotonic() - item.made_at <= self.ttl_s:
                self.stats.warm_hits += 1
                return item.sandbox
            self.stats.expired += 1
            if self._tg is not None:
                self._tg.start_soon(item.sandbox.close)
        return None

    async def create(self, spec: SandboxSpec) -> PooledSandbox:
        key = spec.model_dump_json()
        await self._slots.acquire()
        try:
            sandbox = self._take_warm(key) or await self._create_with_retry(spec)
        except BaseException:
            self._slots.release()
            raise
        if key in self._specs:
            self._refill(key)
        return PooledSandbox(sandbox, self._slots.release)

    # -- warm sandboxes ----------------------------------------------------------------------
    async def prewarm(self, spec: SandboxSpec, n: int | None = None) -> None:
        """Make the pool hold `n` (default: warm) ready sandboxes for `spec`, and keep it so."""
        key = spec.model_dump_json()
        self._specs[key] = spec
        target = self.warm if n is None else n
        missing = target - len(self._warm[key]) - self._filling[key]
        if missing > 0:
            async with anyio.create_task_group() as tg:
                for _ in range(missing):
                    tg.start_soon(self._fill_one, key)

    async def _fill_one(self, key: str) -> None:
        self._filling[key] += 1
        try:
            sandbox = await self._create_with_retry(self._specs[key])
        finally:
            self._filling[key] -= 1
        self._warm[key].append(_Warm(sandbox, time.monotonic()))

    def _refill(self, key: str) -> None:
        if self._tg is None:
            return
        missing = self.warm - len(self._warm[key]) - self._filling[key]
        for _ in range(max(0, missing)):
            self._tg.start_soon(self._fill_one_quietly, key)

    async def _fill_one_quietly(self, key: str) -> None:
        try:
            await self._fill_one(key)
        except SandboxError:
            pass  # the next create() makes one cold and reports the error itself

    async def __aenter__(self) -> SandboxPool:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)
        self._tg = None
        await self.aclose()

    async def aclose(self) -> None:
        """Close every warm sandbox (in use ones belong to their holders)."""
        with anyio.CancelScope(shield=True):
            for queue in self._warm.values():
                while queue:
                    await queue.popleft().sandbox.close()

    async def reap(self, ttl_s: float | None = None) -> list[str]:
        return await reap_provider(self.provider, ttl_s)


# -- the reaper --------------------------------------------------------------------------------


@runtime_checkable
class _HostWorkspace(Protocol):
    """A sandbox with a bookkeeping directory on this host (the local provider's)."""

    host_dir: Path


def _mark_local_owner(sandbox: Sandbox, owner: Ownership, spec: SandboxSpec) -> None:
    """Local workspaces get the ownership labels as <host_dir>/owner.json (outside every bind); the
    TTL there covers the task's agent + verifier timeouts, so the reaper never takes a live episode's."""
    if not isinstance(sandbox, _HostWorkspace):
        return
    host_dir = sandbox.host_dir
    if isinstance(host_dir, Path) and host_dir.is_dir():
        lifetime = sandbox_lifetime_s(spec.resources, owner.ttl_s)
        (host_dir / "owner.json").write_text(json.dumps(owner_labels(owner, lifetime)))


async def reap_provider(provider: SandboxProvider, ttl_s: float | None = None) -> list[str]:
    if not isinstance(provider, Reapable):
        raise SandboxError(f"provider {provider.name!r} cannot find its orphans (no reap())")
    return await provider.reap(ttl_s)


async def reap(name: str, ttl_s: float | None = None, **config: Any) -> list[str]:
    """Build provider `name` from its default config (plus `config`) and reap its orphans."""
    from . import get_provider

    return await reap_provider(get_provider(name, **config), ttl_s)

"""The shared half of the cloud providers (e2b, daytona, modal, agentenv).

Concept: each cloud SDK is reached through a small adapter (the SDK seam) that
can create a sandbox with labels, run one shell script and return (exit code,
stdout text), delete a sandbox, and list ours. Everything else is done here,
the same way for all of them, with one round trip per exec: the command is
wrapped in a POSIX script that feeds stdin from base64, applies the same
rlimits as the local provider, enforces the wall-clock limit with `timeout -k 1`
(exit 124 = timed out), caps stdout with `head -c` (SIGPIPE = output flood),
and prints one framed line `@@MILES@@ code out_bytes err_bytes` followed by the
base64 of the (capped) stdout and stderr. Files travel the same way (base64 in
a script), so an adapter needs no file API.

Errors: SDK exceptions become SandboxRateLimited (rate limit, 429), SandboxThrottled (quota,
capacity),
SandboxUnavailable (credentials) or SandboxError with the operation named.
Lifecycle: create (deleted again if anything after the SDK create fails or is
cancelled) -> exec/files/expose -> close (idempotent, shielded).
"""

from __future__ import annotations

import base64
import os
import posixpath
import re
import shlex
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import anyio
from pydantic import BaseModel, ConfigDict, Field

from miles_env.errors import (
    ConfigError,
    SandboxError,
    SandboxRateLimited,
    SandboxThrottled,
    SandboxUnavailable,
)
from miles_env.limits import sandbox_lifetime_s
from miles_env.sandbox import Command
from miles_env.types import ExecResult, SandboxSpec

from .execargs import command_argv, exec_args
from .ownership import Ownership, is_stale, owner_labels
from .results import RawResult, classify

__all__ = [
    "CloudConfig",
    "CloudAdapter",
    "NativeExpose",
    "CloudSandboxProvider",
    "CloudSandbox",
    "map_sdk_error",
    "frame_script",
]

MARK = "@@MILES@@"
_THROTTLE = re.compile(r"RateLimit|TooManyRequests|Quota|Throttl|Capacity|429")
_RATE = re.compile(r"RateLimit|Rate limit|TooManyRequests|Too Many Requests|429", re.IGNORECASE)
_AUTH = re.compile(r"Authentication|Unauthorized|Forbidden|Credential|Auth(Error|Exception)")


class CloudConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    image: str | None = Field(None, description="image/template used when SandboxSpec.image is None")
    cpus: float = Field(1.0, gt=0)
    ttl_s: float = Field(6 * 3600, gt=0, description="the backend's own lifetime limit and the reaper's TTL")
    run_id: str | None = None
    create_timeout_s: float = Field(300.0, gt=0)
    exec_margin_s: float = Field(
        30.0, gt=0, description="wait this long past an exec's timeout for the backend"
    )
    expose_url: str | None = Field(
        None, description="public origin of the proxy; expose(url) returns it + the path of url"
    )


class CloudAdapter(Protocol):
    """The SDK seam: one small class per provider (tests inject fakes of the SDK underneath)."""

    async def create(self, spec: SandboxSpec, labels: dict[str, str]) -> Any: ...
    async def run(self, handle: Any, script: str, timeout: float) -> tuple[int, str]: ...
    async def delete(self, handle: Any) -> None: ...
    async def list_owned(self) -> list[tuple[str, dict[str, str]]]: ...
    async def delete_id(self, sandbox_id: str) -> None: ...
    def sandbox_id(self, handle: Any) -> str: ...


@runtime_checkable
class NativeExpose(Protocol):
    """An adapter whose backend publishes a sandbox port itself (optional; else config.expose_url)."""

    async def expose(self, handle: Any, url: str) -> str | None: ...


def map_sdk_error(e: BaseException, what: str) -> SandboxError:
    """SDK exception -> our error, by the exception's class names and message (SDK-agnostic)."""
    if isinstance(e, SandboxError):
        return e
    names = " ".join(t.__name__ for t in type(e).__mro__)
    text = f"{names} {e}"
    if _THROTTLE.search(text):
        retry = getattr(e, "retry_after", None)
        kind = SandboxRateLimited if _RATE.search(text) else SandboxThrottled  # rate vs quota/capacity
        return kind(f"{what}: throttled: {e}", float(retry) if isinstance(retry, int | float) else None)
    if _AUTH.search(names):
        return SandboxUnavailable(f"{what}: credentials refused: {e}")
    if "NotFound" in names:
        return SandboxError(f"{what}: the sandbox disappeared: {e}")
    if "Timeout" in names or isinstance(e, TimeoutError):
        return SandboxError(f"{what}: the backend timed out: {e}")
    return SandboxError(f"{what}: {type(e).__name__}: {e}")


def frame_script(
    cmd: Command, *, env: Mapping[str, str], cwd: str, stdin: bytes | None, timeout: float, spec: SandboxSpec
) -> str:
    r = spec.resources
    argv = command_argv(cmd)
    assigns = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
    stdin_b64 = base64.b64encode(stdin or b"").decode()
    flood = r.output_bytes * 4 + 65536
    return f"""d=$(mktemp -d) || exit 99
printf %s {shlex.quote(stdin_b64)} | base64 -d > "$d/in"
{{ ( cd {shlex.quote(cwd)} && ulimit -S -t {r.cpu_seconds} && ulimit -H -t {r.cpu_seconds + 1} \
&& ulimit -v {r.memory_mb << 10} && ulimit -f {r.disk_mb << 11} || exit 125
exec env -i {assigns} timeout -k 1 {timeout:g} {shlex.join(argv)} ) < "$d/in" 2> "$d/err"; echo $? > "$d/code"; }} \
| head -c {flood} > "$d/out"
printf '\\n{MARK} %s %s %s\\n' "$(cat "$d/code" 2>/dev/null || echo 141)" "$(wc -c < "$d/out")" "$(wc -c < "$d/err")"
head -c {r.output_bytes} "$d/out" | base64 | tr -d '\\n'; echo
head -c {r.output_bytes} "$d/err" | base64 | tr -d '\\n'; echo
rm -rf "$d"
"""


def parse_frame(output: str, spec: SandboxSpec, what: str) -> RawResult:
    at = output.rfind("\n" + MARK + " ")
    if at < 0:
        raise SandboxError(f"{what}: the exec wrapper's output is unreadable: {output[-300:]!r}")
    lines = output[at + 1 :].split("\n")
    try:
        code_s, out_n, err_n = lines[0].split()[1:4]
        out, err = base64.b64decode(lines[1]), base64.b64decode(lines[2])
        code, n_out, n_err = int(code_s), int(out_n), int(err_n)
    except (IndexError, ValueError) as e:
        raise SandboxError(f"{what}: the exec wrapper's frame is malformed: {lines[:1]!r}") from e
    cap = spec.resources.output_bytes
    flood = cap * 4 + 65536
    return RawResult(
        returncode=code,
        stdout=out,
        stderr=err,
        timed_out=code == 124,
        output_killed=n_out >= flood,
        truncated=n_out > cap or n_err > cap,
        duration_s=0.0,
    )


class CloudSandbox:
    """A Sandbox over a CloudAdapter handle; built by CloudSandboxProvider."""

    def __init__(self, provider: CloudSandboxProvider, handle: Any, spec: SandboxSpec) -> None:
        self._provider = provider
        self._adapter = provider.adapter
        self.handle = handle
        self.id = provider.adapter.sandbox_id(handle)
        self.workdir = spec.workdir
        self.spec = spec
        self._closed = False

    async def _script(self, script: str, timeout: float, what: str) -> str:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        margin = self._provider.config.exec_margin_s
        try:
            # The backend gets a margin over the in-sandbox `timeout`, which is what normally fires.
            with anyio.fail_after(timeout + margin):
                _, out = await self._adapter.run(self.handle, script, timeout + margin / 2)
        except TimeoutError as e:
            raise SandboxError(
                f"sandbox {self.id}: {what}: no answer from the backend in {timeout + margin:g}s"
            ) from e
        except Exception as e:  # noqa: BLE001 - every SDK error is mapped
            raise map_sdk_error(e, f"sandbox {self.id}: {what}") from e
        return out

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
        if user is not None:  # the SDKs run every command as the template's user (E2B: two names)
            raise SandboxError(
                f"sandbox {self.id}: exec as user {user!r}: {self._provider.name} runs every command as "
                "the template's user; run this task on the local or docker provider"
            )
        args = exec_args(self.spec, self.workdir, timeout=timeout, cwd=cwd, env=env, stdin=stdin)
        limit = args.timeout
        script = frame_script(
            cmd, env=args.env, cwd=args.cwd, stdin=args.stdin, timeout=limit, spec=self.spec
        )
        start = anyio.current_time()
        raw = parse_frame(await self._script(script, limit, "exec"), self.spec, f"sandbox {self.id}: exec")
        code, killed_by = classify(raw, procs_refused=False)
        if raw.timed_out:
            code = -9
        elif code == 141 and raw.output_killed:
            code = -13
        return ExecResult(
            exit_code=code,
            stdout=raw.stdout.decode("utf-8", "replace"),
            stderr=raw.stderr.decode("utf-8", "replace"),
            timed_out=raw.timed_out,
            killed_by_limit=killed_by,
            truncated=raw.truncated,
            duration_s=anyio.current_time() - start,
        )

    def _inner(self, path: str) -> str:
        if not path or "\x00" in path:
            raise SandboxError(f"path {path!r}: must be a non-empty path without NUL bytes")
        norm = posixpath.normpath(posixpath.join(self.workdir, path))
        if not any(norm.startswith(m.rstrip("/") + "/") for m in (self.workdir, "/tmp")):
            raise SandboxError(f"path {path!r} resolves to {norm}, outside the sandbox's writable mounts")
        return norm

    async def write_file(self, path: str, data: bytes | str) -> None:
        inner = shlex.quote(self._inner(path))
        payload = base64.b64encode(data.encode() if isinstance(data, str) else bytes(data)).decode()
        chunks = [payload[i : i + 65536] for i in range(0, len(payload), 65536)] or [""]
        for i, chunk in enumerate(chunks):
            op = ">" if i == 0 else ">>"
            script = (
                f'mkdir -p "$(dirname {inner})" && [ ! -L {inner} ] && printf %s {shlex.quote(chunk)} '
                f"| base64 -d {op} {inner} && echo OK"
            )
            if "OK" not in await self._script(script, 60, f"write_file({path!r})"):
                raise SandboxError(
                    f"sandbox {self.id}: write_file({path!r}): refused (symlink or not writable)"
                )

    async def read_file(self, path: str) -> bytes:
        inner = shlex.quote(self._inner(path))
        script = (
            f"if [ -f {inner} ] && [ ! -L {inner} ]; then printf 'OK '; base64 < {inner} | tr -d '\\n'; fi"
        )
        out = (await self._script(script, 60, f"read_file({path!r})")).strip()
        if not out.startswith("OK"):
            raise SandboxError(f"path {path!r}: no such regular file in the sandbox")
        return base64.b64decode(out[2:].strip())

    async def expose(self, url: str) -> str:
        if isinstance(self._adapter, NativeExpose):
            found = await self._adapter.expose(self.handle, url)
            if found:
                return found
        base = self._provider.config.expose_url
        if not base:
            raise SandboxError(
                f"sandbox {self.id}: expose({url!r}): {self._provider.name} sandboxes cannot reach this host; "
                "set the provider's expose_url to the proxy's public URL"
            )
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        return base.rstrip("/") + parts.path + (f"?{parts.query}" if parts.query else "")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            try:
                await self._adapter.delete(self.handle)
            except Exception as e:  # noqa: BLE001
                mapped = map_sdk_error(e, f"sandbox {self.id}: close")
                if "disappeared" not in str(mapped):
                    raise mapped from e

    async def __aenter__(self) -> CloudSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class CloudSandboxProvider:
    """A SandboxProvider over a CloudAdapter; the e2b/daytona/modal/agentenv modules subclass it."""

    name = "cloud"

    def __init__(self, config: CloudConfig, adapter: CloudAdapter) -> None:
        self.config = config
        self.adapter = adapter
        self.owner = Ownership.here(config.run_id, config.ttl_s)

    async def create(self, spec: SandboxSpec) -> CloudSandbox:
        if not isinstance(spec, SandboxSpec):
            raise ConfigError(f"create(spec): expected a SandboxSpec, got {type(spec).__name__}")
        if spec.rootfs is not None:
            raise ConfigError(
                f"SandboxSpec.rootfs: the {self.name} provider takes an image, not a host directory"
            )
        if not spec.workdir.startswith("/"):
            raise ConfigError(f"SandboxSpec.workdir={spec.workdir!r}: must be absolute")
        try:
            with anyio.fail_after(self.config.create_timeout_s):
                lifetime = sandbox_lifetime_s(spec.resources, self.owner.ttl_s)
                handle = await self.adapter.create(spec, owner_labels(self.owner, lifetime))
        except TimeoutError as e:
            raise SandboxError(
                f"{self.name}: create timed out after {self.config.create_timeout_s:g}s"
            ) from e
        except Exception as e:  # noqa: BLE001
            raise map_sdk_error(e, f"{self.name}: create") from e
        sandbox = CloudSandbox(self, handle, spec)
        try:
            await sandbox.exec(f"mkdir -p {shlex.quote(spec.workdir)}", cwd="/")
            for path, text in spec.files.items():
                await sandbox.write_file(path, text)
        except BaseException:
            await sandbox.close()
            raise
        return sandbox

    async def reap(self, ttl_s: float | None = None) -> list[str]:
        try:
            owned = await self.adapter.list_owned()
            removed = []
            for sid, labels in owned:
                if is_stale(labels, ttl_s):
                    await self.adapter.delete_id(sid)
                    removed.append(sid)
        except Exception as e:  # noqa: BLE001
            raise map_sdk_error(e, f"{self.name}: reap") from e
        return removed


def env_credential(*names: str) -> str | None:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    return None

"""A Harbor environment backed by a miles-env sandbox on the host (Harbor's `import_path` mechanism).

`harbor_env:MilesSandboxEnvironment` forwards exec/upload/download to the host over
the worker protocol's callbacks (`sandbox.exec`, `sandbox.write`, `sandbox.read`,
`sandbox.list`), where one of our sandboxes (any provider) runs the commands. The
sandbox to use is the context variable CURRENT_SANDBOX, set by the worker's `trial`
handler. Harbor's absolute `/logs`, `/tests`, `/solution`, `/installed-agent` and
`/oracle` paths are rebased under `/tmp/harbor` (the local sandbox's root is read-only),
in commands and in uploaded text files (UTF-8, at most 1 MiB) alike; every other file is
uploaded byte for byte, and every file keeps its permission bits (as `docker cp` does).

Each of our execs may be its own process namespace (the local sandbox: a fresh
bwrap per exec), so a tmux server started by one exec would die with it. A command
that starts a tmux session (Terminus-2's terminal) is therefore sent as
`sandbox.keep`: the host runs it in an exec that stays alive while a tmux server
does; later execs reach that server through its socket under /tmp.
"""

from __future__ import annotations

import base64
import contextvars
import re
from pathlib import Path
from typing import Any

from _rpc import host_call
from harbor.environments.base import BaseEnvironment, ExecResult

CURRENT_SANDBOX: contextvars.ContextVar[str] = contextvars.ContextVar("miles_sandbox")
ROOT = "/tmp/harbor"
_REBASE_LIMIT = 1 << 20
_ABS = re.compile(r"(?<![\w.~/-])/(logs|tests|solution|installed-agent|oracle)(?=/|\b)")


def rebase(text: str) -> str:
    return _ABS.sub(lambda m: f"{ROOT}/{m.group(1)}", text)


class MilesSandboxEnvironment(BaseEnvironment):
    @staticmethod
    def type() -> str:
        return "miles-env"

    def _validate_definition(self) -> None:
        return None

    async def _call(self, method: str, **params: Any) -> Any:
        return await host_call(method, {"sandbox": CURRENT_SANDBOX.get(), **params})

    async def start(self, force_build: bool) -> None:
        await self._call(
            "sandbox.exec", command=f"mkdir -p {ROOT}/logs/agent {ROOT}/logs/verifier", timeout=30
        )

    async def stop(self, delete: bool) -> None:
        return None  # the host owns the sandbox and closes it

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        data = Path(source_path).read_bytes()
        try:
            if len(data) <= _REBASE_LIMIT:
                data = rebase(data.decode()).encode()
        except UnicodeDecodeError:
            pass
        mode = Path(source_path).stat().st_mode & 0o7777
        await self._call(
            "sandbox.write", path=rebase(target_path), data=base64.b64encode(data).decode(), mode=mode
        )

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        for p in sorted(Path(source_dir).rglob("*")):
            if p.is_file():
                await self.upload_file(p, f"{target_dir.rstrip('/')}/{p.relative_to(source_dir)}")

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self._call("sandbox.read", path=rebase(source_path))
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        Path(target_path).write_bytes(base64.b64decode(data))

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        src = rebase(source_dir).rstrip("/")
        for rel in await self._call("sandbox.list", path=src):
            await self.download_file(f"{src}/{rel}", Path(target_dir) / rel)

    async def _keep(
        self, command: str, cwd: str | None, env: dict[str, str], timeout_sec: int | None
    ) -> ExecResult:
        r = await self._call(
            "sandbox.keep", command=command, cwd=cwd, env=env, timeout=timeout_sec, alive="tmux has-session"
        )
        return ExecResult(stdout=r["stdout"], stderr=r["stderr"], return_code=r["exit_code"])

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        if "tmux new-session" in command:
            return await self._keep(
                rebase(command),
                rebase(cwd) if cwd else None,
                {k: rebase(v) for k, v in (env or {}).items()},
                timeout_sec,
            )
        r = await self._call(
            "sandbox.exec",
            command=rebase(command),
            cwd=rebase(cwd) if cwd else None,
            env={k: rebase(v) for k, v in (env or {}).items()},
            timeout=timeout_sec,
        )
        return ExecResult(stdout=r["stdout"], stderr=r["stderr"], return_code=r["exit_code"])

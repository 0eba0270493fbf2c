"""Shared machinery of the agent-CLI harnesses (Claude Code, Codex, opencode): install once, run in a sandbox.

Concept: a CLI is an npm package pinned to one version (`CliPackage`), installed
with npm into `${MILES_ENV_CACHE:-~/.cache/miles-env}/clis/<name>-<version>` the
first time it is needed (scripts/install-clis.sh makes the same layout). Each CLI
has a small tuple of *tested* pins (`TESTED`, newest first, the first is the
default): a harness runs any of them (`tested_pin`), CI runs the scripted
end-to-end test against each, so an upgrade that changes request shapes shows
up as a failing version, not as a user's broken run. A run bind-mounts the
install directory read-only into the sandbox at `/.miles-cli/<name>`, gives the
CLI a private HOME under the sandbox's /tmp, points it at the TITO session
through `sandbox.expose()` (the sandbox has no other network) and execs its
entry point (`command()`: a native binary, or a JS file run by the host's node,
which the sandbox sees through its read-only /usr) with one wall-clock budget.

Invariants: an install is complete iff its `.complete` marker exists (written
last, under a file lock, so concurrent episodes install once); a run never
raises for what the CLI does: hang, crash or budget kill all come back as a
`CliRun`, which `cli_status` maps to an episode status. The sandbox (its pid
namespace) takes the CLI's processes with it when the exec ends.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from miles_env.errors import ConfigError, HarnessError, SandboxError
from miles_env.harness import HarnessResult
from miles_env.sandbox import Sandbox
from miles_env.types import EpisodeEnd, Status

__all__ = [
    "POLICY_FORMAT",
    "policy_end",
    "cli_result",
    "CliPackage",
    "CliRun",
    "CLAUDE_CODE",
    "CODEX",
    "OPENCODE",
    "TESTED",
    "tested_pin",
    "cli_cache_root",
    "ensure_cli",
    "mount_cli",
    "run_cli",
    "cli_status",
    "last_json",
]

INNER_ROOT = "/.miles-cli"  # where install dirs appear inside the sandbox
# The end class of a harness exit caused by the model's output: a policy end, scored like any other,
# never an infrastructure failure.
POLICY_FORMAT = EpisodeEnd.POLICY_FORMAT
HOME = "/tmp/.agent-home"  # private per sandbox (its /tmp), writable, gone with the sandbox


@dataclass(frozen=True, slots=True)
class CliPackage:
    name: str  # cache dir prefix and log name
    package: str  # npm package
    version: str  # pinned; keep in sync with scripts/install-clis.sh
    binary: str  # entry point relative to the install dir: a native executable, or a script for `runner`
    path_dirs: tuple[str, ...] = ()  # extra PATH entries (relative), e.g. codex's bundled rg
    runner: tuple[str, ...] = ()  # argv before the entry point, e.g. ("node",) for a JS file
    # Address space the CLI needs (MB). The local sandbox applies Resources.memory_mb as RLIMIT_AS,
    # which counts virtual reservations: JIT runtimes reserve far more than they touch.
    memory_mb: int = 1024
    env: tuple[tuple[str, str], ...] = ()  # variables this pin needs in the sandbox
    context_env: str | None = None  # variable that tells this pin the model's context window, if any
    lean_args: tuple[str, ...] = ()  # argv this pin adds to trim its prompt (the harness's `lean`)

    def inner(self, rel: str = "") -> str:
        base = f"{INNER_ROOT}/{self.name}"
        return f"{base}/{rel}" if rel else base

    def command(self, binary: str | None = None) -> list[str]:
        """argv prefix that starts this CLI inside the sandbox (`binary` overrides the entry point)."""
        return [binary] if binary else [*self.runner, self.inner(self.binary)]


CLAUDE_CODE = CliPackage(
    "claude-code",
    "@anthropic-ai/claude-code",
    "2.1.332",
    "node_modules/@anthropic-ai/claude-code/bin/claude.exe",
    # 2.1 reads it as the window of a model it does not know (ours): its auto-compaction threshold
    # and its reaction to "prompt is too long" follow it. 2.0 has no such variable (its window is
    # fixed per model; CLAUDE_AUTOCOMPACT_PCT_OVERRIDE is only a percentage of that).
    context_env="CLAUDE_CODE_MAX_CONTEXT_TOKENS",
    # 2.1's minimal mode: no hooks, plugins, CLAUDE.md, attribution reminder or auto-memory, and its
    # short tool descriptions (CLAUDE_CODE_SIMPLE): ~0.65k tokens with one tool and a short prompt.
    lean_args=("--bare",),
)
# The previous minor's newest patch. Claude Code 2.0 ships JavaScript (cli.js), not a native binary.
# Node's WebAssembly trap handler reserves ~10 GB of address space per Wasm memory (Claude Code
# 2.0 instantiates some at start): without --disable-wasm-trap-handler no RLIMIT_AS below that works.
# 2.0 also "warms up" three subagents with a model call each at start unless prompt caching is off
# (cache_control means nothing to TITO). Its Bash tool still asks the model, after every command,
# which file paths the command read (querySource bash_extract_command_paths): those calls reach the
# session as extra branches; no setting turns them off in 2.0.
_CLAUDE_CODE_2_0 = CliPackage(
    "claude-code",
    "@anthropic-ai/claude-code",
    "2.0.77",
    "node_modules/@anthropic-ai/claude-code/cli.js",
    runner=("node", "--disable-wasm-trap-handler"),
    memory_mb=3072,  # measured: killed at 1024, passes at 2048
    env=(("DISABLE_PROMPT_CACHING", "1"),),
)
_CODEX_VENDOR = "node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl"
CODEX = CliPackage(
    "codex",
    "@openai/codex",
    "0.171.0",
    f"{_CODEX_VENDOR}/bin/codex",
    (f"{_CODEX_VENDOR}/codex-path",),
)
# The previous minor on npm (there is no 0.170.x); same layout as 0.171.
_CODEX_0_169 = CliPackage("codex", "@openai/codex", "0.169.0", CODEX.binary, CODEX.path_dirs)
# opencode-ai's postinstall links the platform's native binary (AVX2 or baseline build) to bin/opencode.exe.
# Its JavaScriptCore heap reserves ~4.5 GB of address space (RSS ~600 MB): at 4096 it aborts with
# "MemoryExhaustion" or a Bun panic (SIGILL), at 4608 it passes.
OPENCODE = CliPackage(
    "opencode", "opencode-ai", "1.18.33", "node_modules/opencode-ai/bin/opencode.exe", memory_mb=6144
)

# name -> tested pins, newest first; the first is the default. Keep in sync with scripts/install-clis.sh.
TESTED: dict[str, tuple[CliPackage, ...]] = {
    "claude-code": (CLAUDE_CODE, _CLAUDE_CODE_2_0),
    "codex": (CODEX, _CODEX_0_169),
    "opencode": (OPENCODE,),
}


def tested_pin(name: str, version: str | None = None) -> CliPackage:
    """The tested pin of CLI `name` at `version` (None: the default); ConfigError for an untested one."""
    pins = TESTED[name]
    if version is None:
        return pins[0]
    for pin in pins:
        if pin.version == version:
            return pin
    tested = ", ".join(p.version for p in pins)
    raise ConfigError(
        f"{name} version {version!r} is not a tested pin (tested: {tested}); add it to "
        "miles_env/harnesses/_cli.py TESTED and scripts/install-clis.sh, then run its end-to-end test"
    )


def cli_cache_root() -> Path:
    root = os.environ.get("MILES_ENV_CACHE") or os.path.join(Path.home(), ".cache", "miles-env")
    return Path(root) / "clis"


def _install_blocking(pkg: CliPackage, target: Path, npm: str | None) -> Path:
    marker = target / ".complete"
    if marker.exists():
        return target
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    npm_bin = npm or shutil.which("npm")
    if npm is None and missing:
        raise HarnessError(
            f"harness {pkg.name!r} needs {pkg.package}@{pkg.version}, which is not installed in {target}, "
            f"and {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not on PATH: install "
            "Node.js >= 18 with npm, or run scripts/install-clis.sh on a machine that has them"
        )
    target.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one installer per version; the others wait, then see the marker
        if marker.exists():
            return target
        argv = [str(npm_bin), "install", "--prefix", str(target), "--no-audit", "--no-fund"]
        argv += ["--loglevel=error", f"{pkg.package}@{pkg.version}"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise HarnessError(
                f"npm install {pkg.package}@{pkg.version} into {target} failed "
                f"(exit {proc.returncode}): {proc.stderr.strip()[-800:]}"
            )
        if not os.access(target / pkg.binary, os.X_OK):
            raise HarnessError(f"{pkg.package}@{pkg.version}: no executable at {target / pkg.binary}")
        marker.touch()
    return target


async def ensure_cli(pkg: CliPackage, *, cache_root: Path | None = None, npm: str | None = None) -> Path:
    """The install dir of `pkg`, installing it with npm first if needed (HarnessError if impossible)."""
    target = (cache_root or cli_cache_root()) / f"{pkg.name}-{pkg.version}"
    return await anyio.to_thread.run_sync(_install_blocking, pkg, target, npm)


def mount_cli(sandbox: Sandbox, pkg: CliPackage, install_dir: Path) -> None:
    mount = getattr(sandbox, "mount_ro", None)
    if mount is None:
        raise SandboxError(
            f"harness {pkg.name!r}: sandbox {type(sandbox).__name__} cannot mount the CLI read-only "
            "(no mount_ro); use the 'local' sandbox provider"
        )
    mount(str(install_dir), pkg.inner())


@dataclass(frozen=True, slots=True)
class CliRun:
    argv: tuple[str, ...]
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    killed_by_limit: str | None
    duration_s: float
    started_at: float  # time.time() when the exec began (to compare with the session's first turn)
    extra: dict[str, Any] = field(default_factory=dict)


async def run_cli(
    sandbox: Sandbox,
    argv: Sequence[str],
    env: Mapping[str, str],
    budget_s: float,
) -> CliRun:
    """Exec the CLI in the sandbox under a wall-clock budget; never raises for the CLI's own failure."""
    started = time.time()
    res = await sandbox.exec(list(argv), timeout=budget_s, env=dict(env), stdin=b"")
    return CliRun(
        tuple(argv),
        res.exit_code,
        res.stdout,
        res.stderr,
        res.timed_out,
        res.killed_by_limit,
        res.duration_s,
        started,
    )


_OUT_OF_MEMORY = re.compile(r"MemoryExhaustion|Out of memory|bad_alloc|Cannot allocate memory|MemoryError")


def policy_end(exit_reason: str | None, format_exits: frozenset[str]) -> EpisodeEnd | None:
    """The end class of a harness run that stopped for `exit_reason` (the agent's own name for why,
    e.g. mini-swe-agent's exit status, Claude Code's terminal_reason): POLICY_FORMAT when it is one
    of the harness's `format_exits` (the agent gave up on replies it could not parse), else None
    (the status says it). The one place the class is decided; cli_result records it."""
    return POLICY_FORMAT if exit_reason is not None and exit_reason in format_exits else None


def cli_result(
    pkg: CliPackage,
    run: CliRun,
    status: Status,
    error: str | None,
    *,
    instruction: str,
    final: object,
    output: object,
    timing: tuple[float, float],
    stdout_tail: bool = False,
    end: EpisodeEnd | None = None,
) -> HarnessResult:
    """What every CLI harness returns: the task and the CLI's final text, plus the run's record.

    `timing` is (start, prepared) wall-clock times; `stdout_tail` keeps the end of stdout when the
    CLI's own output could not be read; `end` is `policy_end`'s class (HarnessResult.end, and
    metadata "end" for a reader of the episode's harness record).
    """
    t0, prepared = timing
    metadata: dict[str, Any] = {
        "cli": pkg.name,
        "version": pkg.version,
        "exit_code": run.exit_code,
        "timed_out": run.timed_out,
        "output": output,
        "stderr_tail": run.stderr[-2000:],
        "prepare_s": prepared - t0,
        "cli_start": run.started_at,
        "cli_s": run.duration_s,
    }
    if stdout_tail:
        metadata["stdout_tail"] = run.stdout[-2000:]
    if end is not None:
        metadata["end"] = end
    transcript = [{"role": "user", "content": instruction}]
    if isinstance(final, str):
        transcript.append({"role": "assistant", "content": final})
    return HarnessResult(status, transcript, error, metadata, end=end)


def cli_status(run: CliRun, pkg: CliPackage | None = None) -> tuple[Status, str | None]:
    """Budget kill -> TRUNCATED; crash, signal or nonzero exit -> ABORTED; exit 0 -> COMPLETED."""
    if run.timed_out:
        return Status.TRUNCATED, f"CLI wall-clock budget exceeded after {run.duration_s:.1f}s"
    if run.killed_by_limit:
        error = f"CLI killed by the sandbox {run.killed_by_limit} limit"
        return Status.ABORTED, _memory_hint(pkg, error) if run.killed_by_limit == "memory" else error
    if run.exit_code != 0:
        tail = run.stderr.strip()[-400:] or run.stdout.strip()[-400:]
        error = f"CLI exited with status {run.exit_code}: {tail}"
        return Status.ABORTED, _memory_hint(pkg, error) if _OUT_OF_MEMORY.search(run.stderr) else error
    return Status.COMPLETED, None


def _memory_hint(pkg: CliPackage | None, error: str) -> str:
    if pkg is None:
        return error
    return (
        f"{pkg.name} {pkg.version} ran out of address space: give the task's sandbox "
        f"Resources.memory_mb >= {pkg.memory_mb} (applied as RLIMIT_AS). {error}"
    )


def last_json(text: str) -> Any:
    """The last line of `text` that parses as a JSON object, else None (CLIs print JSON last)."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None

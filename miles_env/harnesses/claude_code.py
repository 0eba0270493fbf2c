"""The `claude-code` harness: the real Claude Code CLI, unmodified, acting inside the sandbox.

Lifecycle of one run: install (cached) -> mount the install dir read-only ->
expose the TITO session root inside the sandbox -> `claude -p TASK --output-format
json` with a private HOME, the session key and telemetry/non-essential traffic
off -> exit status and Claude Code's own JSON result into the metadata.

Claude Code speaks Anthropic Messages (`POST {ANTHROPIC_BASE_URL}/v1/messages`),
so it gets the session *root* URL; its tool calls (Bash, Write, ...) run in the
sandbox because the CLI itself runs there. It runs as the sandbox's root user,
hence IS_SANDBOX=1 with --dangerously-skip-permissions (no approval prompts). It
is told the session's context (CLAUDE_CODE_MAX_CONTEXT_TOKENS, 2.1), so that it
compacts a long conversation instead of ending at the proxy's context refusal, and
its tool-output limits follow the window (`output_limits`): its compaction drops
only older turns, so a single tool result larger than the window could never be
recovered from.
"""

from __future__ import annotations

import time
from typing import Any

from miles_env.harness import Endpoint, HarnessResult
from miles_env.harnesses._cli import (
    HOME,
    cli_result,
    cli_status,
    ensure_cli,
    last_json,
    mount_cli,
    run_cli,
    tested_pin,
)
from miles_env.harnesses.configs import ClaudeCodeConfig
from miles_env.sandbox import Sandbox
from miles_env.types import Status, Task

__all__ = ["ClaudeCodeConfig", "ClaudeCodeHarness", "output_limits"]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def output_limits(context: int) -> dict[str, str]:
    """Claude Code's own tool-output caps for a `context`-token window (an eighth of it).

    Claude Code 2.1 compacts by its estimate of the history (~4 characters a token) well below the
    window, but a tool result goes into the next request whole: one larger than the room left
    comes back as "prompt is too long", and its compaction, which keeps the latest turns, cannot
    shrink it. Bash output is kept to BASH_MAX_OUTPUT_LENGTH characters (a token is at least one
    character for a byte-level BPE over ASCII), an MCP tool's to MAX_MCP_OUTPUT_TOKENS; 30000
    characters is Claude Code's own default, never raised here.
    """
    cap = max(min(30000, context // 8), 1000)
    return {"BASH_MAX_OUTPUT_LENGTH": str(cap), "MAX_MCP_OUTPUT_TOKENS": str(cap // 4)}


class ClaudeCodeHarness:
    name = "claude-code"

    def __init__(self, config: ClaudeCodeConfig | None = None, **overrides: Any) -> None:
        base = (config or ClaudeCodeConfig()).model_dump()
        self.config = ClaudeCodeConfig(**{**base, **overrides})
        self.pin = tested_pin("claude-code", self.config.version)

    def argv(self, task: Task, endpoint: Endpoint) -> list[str]:
        cfg = self.config
        argv = [*self.pin.command(cfg.binary), "-p", task.instruction]
        argv += ["--output-format", "json", "--dangerously-skip-permissions", "--model", endpoint.model]
        if cfg.max_turns is not None:
            argv += ["--max-turns", str(cfg.max_turns)]
        if cfg.tools is not None:
            argv += ["--tools", cfg.tools]
        return argv + list(cfg.extra_args)

    def env(self, root_url: str, endpoint: Endpoint) -> dict[str, str]:
        return {
            "PATH": DEFAULT_PATH,
            "HOME": HOME,
            "ANTHROPIC_BASE_URL": root_url,
            "ANTHROPIC_API_KEY": endpoint.api_key,
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "IS_SANDBOX": "1",
            **self._context_env(endpoint),
            **dict(self.pin.env),
            **self.config.extra_env,
        }

    def _context_env(self, endpoint: Endpoint) -> dict[str, str]:
        """The session's max_context as this pin's context-window variable (when it has one) and as
        tool-output caps, and the reply size when configured: Claude Code sizes its compaction
        threshold from both."""
        env = {}
        if endpoint.max_context is not None:
            env.update(output_limits(endpoint.max_context))
            if self.pin.context_env is not None:
                env[self.pin.context_env] = str(endpoint.max_context)
        if self.config.output_tokens is not None:
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(self.config.output_tokens)
        return env

    async def run(self, task: Task, sandbox: Sandbox, endpoint: Endpoint) -> HarnessResult:
        t0 = time.time()
        install_dir = await ensure_cli(self.pin)
        mount_cli(sandbox, self.pin, install_dir)
        root = endpoint.root_url or endpoint.base_url.removesuffix("/v1")
        inner_root = await sandbox.expose(root)
        await sandbox.exec(["mkdir", "-p", HOME], timeout=30)
        prepared = time.time()
        run = await run_cli(
            sandbox, self.argv(task, endpoint), self.env(inner_root, endpoint), self.config.budget_s
        )
        status, error = cli_status(run, self.pin)
        output = last_json(run.stdout)
        if status is Status.COMPLETED and isinstance(output, dict) and output.get("is_error"):
            # Claude Code exits 0 on some failures (max turns, API errors) and says so in its JSON.
            sub = str(output.get("subtype", ""))
            status = Status.TRUNCATED if "max_turns" in sub else Status.ABORTED
            error = f"Claude Code result {sub or 'error'}: {str(output.get('result', ''))[:400]}"
        final = output.get("result") if isinstance(output, dict) else None
        return cli_result(
            self.pin, run, status, error, instruction=task.instruction, final=final, output=output,
            timing=(t0, prepared), stdout_tail=output is None,
        )  # fmt: skip

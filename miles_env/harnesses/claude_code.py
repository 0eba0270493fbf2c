"""The `claude-code` harness: the real Claude Code CLI, unmodified, acting inside the sandbox.

Lifecycle of one run: install (cached) -> mount the install dir read-only ->
expose the TITO session root inside the sandbox -> `claude -p TASK --output-format
json` with a private HOME, the session key and telemetry/non-essential traffic
off -> exit status and Claude Code's own JSON result into the metadata.

Claude Code speaks Anthropic Messages (`POST {ANTHROPIC_BASE_URL}/v1/messages`),
so it gets the session *root* URL; its tool calls (Bash, Write, ...) run in the
sandbox because the CLI itself runs there. It runs as the sandbox's root user,
hence IS_SANDBOX=1 with --dangerously-skip-permissions (no approval prompts). It
is told the session's context (CLAUDE_CODE_MAX_CONTEXT_TOKENS, 2.1) and sized for
it (`context_env`): room for a reply it can actually get, compaction only where the
window leaves it room, tool-output limits that follow the window (its compaction drops
only older turns, so a single tool result larger than the window could never be
recovered from). `lean` trims what it sends for a small model (--bare, the Bash tool,
a short system prompt). Its JSON result says how it ended (`outcome`).
"""

from __future__ import annotations

import re
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
    policy_end,
    run_cli,
    tested_pin,
)
from miles_env.harnesses.configs import LEAN_PROMPT, ClaudeCodeConfig
from miles_env.sandbox import Sandbox
from miles_env.types import EpisodeEnd, Status, Task

__all__ = ["ClaudeCodeConfig", "ClaudeCodeHarness", "context_env", "outcome", "output_limits"]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Claude Code 2.1's own sizes (read in its code, checked against the proxy): it keeps
# min(max output tokens, 20k) of the window free for the reply (its own max output for a model it
# does not know: 32k), compacts when the conversation reaches the window less that and 13k, and
# refuses to send ("Prompt is too long", terminal_reason blocking_limit) 3k before the window less
# that room: with its defaults, a window under ~23k refuses the very first request.
REPLY_ROOM_CAP = 20000
COMPACT_BUFFER = 13000
# Claude Code's terminal_reason values: the context ended it (a budget), or it gave up on tool calls
# it could not parse (the model's output: a policy end).
CONTEXT_ENDS = frozenset({"prompt_too_long", "blocking_limit"})
FORMAT_EXITS = frozenset({"malformed_tool_use_exhausted"})
# Its result when replies keep stopping at the reply size (CLAUDE_CODE_MAX_OUTPUT_TOKENS) after its
# own continuation attempts: terminal_reason "api_error", this wording. The output budget: truncated.
OUTPUT_CAP = re.compile(r"response exceeded the \d+ output token maximum")


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


def context_env(context: int, output_tokens: int | None) -> dict[str, str]:
    """What Claude Code 2.1 is told for a `context`-token window, besides the window itself.

    The reply size (CLAUDE_CODE_MAX_OUTPUT_TOKENS): `output_tokens`, else an eighth of a window
    under 160k (where its own 20k reply room would be more; an 8k window would refuse every request),
    else its own. Compaction: when its threshold (window - reply room - 13k) is under a quarter of
    the window it would compact after nearly every turn, so it is off (DISABLE_AUTO_COMPACT): Claude
    Code then compacts only on the proxy's "prompt is too long". Tool outputs: `output_limits`.
    """
    env = output_limits(context)
    reply = output_tokens if output_tokens is not None else context // 8
    if reply < REPLY_ROOM_CAP or output_tokens is not None:
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(reply)
    room = min(reply, REPLY_ROOM_CAP)
    if context - room - COMPACT_BUFFER < context // 4:
        env["DISABLE_AUTO_COMPACT"] = "1"
    return env


def outcome(output: Any, status: Status, error: str | None) -> tuple[Status, str | None, EpisodeEnd | None]:
    """(status, error, end class) from Claude Code's JSON result, when it reports an error; else the
    exit status's. Claude Code exits 0 on some failures (max turns, API errors) and 1 on others,
    and says which in its JSON: max turns, the context and the reply size are budgets (truncated),
    giving up on unparsable tool calls is the model's doing (aborted, POLICY_FORMAT), anything else
    aborted."""
    if not isinstance(output, dict) or not output.get("is_error"):
        return status, error, None
    sub, reason = str(output.get("subtype", "")), str(output.get("terminal_reason") or "")
    error = f"Claude Code result {reason or sub or 'error'}: {str(output.get('result', ''))[:400]}"
    budget = reason in CONTEXT_ENDS or OUTPUT_CAP.search(str(output.get("result", ""))) is not None
    if "max_turns" in sub or reason == "max_turns" or budget:
        return Status.TRUNCATED, error, None
    return Status.ABORTED, error, policy_end(reason, FORMAT_EXITS)


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
        if cfg.lean:
            argv += list(self.pin.lean_args)
        if cfg.max_turns is not None:
            argv += ["--max-turns", str(cfg.max_turns)]
        tools = cfg.tools if cfg.tools is not None or not cfg.lean else "Bash"
        if tools is not None:
            argv += ["--tools", tools]
        prompt = cfg.system_prompt if cfg.system_prompt is not None or not cfg.lean else LEAN_PROMPT
        if prompt is not None:
            argv += ["--system-prompt", prompt.format(tool="Bash")]
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
        """The session's max_context as this pin's context-window variable and the sizes that go
        with it (`context_env`); a pin without the variable (2.0) gets the tool-output caps only."""
        out = self.config.output_tokens
        env = {} if out is None else {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(out)}
        if endpoint.max_context is None:
            return env
        if self.pin.context_env is None:
            return {**output_limits(endpoint.max_context), **env}
        return {**context_env(endpoint.max_context, out), self.pin.context_env: str(endpoint.max_context)}

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
        end: EpisodeEnd | None = None
        if not run.timed_out and not run.killed_by_limit:  # its own account beats a bare exit status
            status, error, end = outcome(output, status, error)
        final = output.get("result") if isinstance(output, dict) else None
        return cli_result(
            self.pin, run, status, error, instruction=task.instruction, final=final, output=output,
            timing=(t0, prepared), stdout_tail=output is None, end=end,
        )  # fmt: skip

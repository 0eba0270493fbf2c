"""The `codex` harness: the real Codex CLI, unmodified, acting inside the sandbox.

Lifecycle of one run: install (cached) -> mount the install dir read-only ->
expose the TITO session inside the sandbox -> write `$CODEX_HOME/config.toml`
with a custom provider (Responses wire API at the exposed `/v1`, key from an env
var) -> `codex exec --json TASK < /dev/null` -> exit status and Codex's JSONL
events into the metadata.

Why a custom provider: Codex ignores OPENAI_BASE_URL and its built-in provider
tries a WebSocket first; a custom provider speaks plain streamed Responses. Codex
runs its shell tool (`exec_command`) in the sandbox because the CLI itself runs
there; its own sandboxing is off (bwrap is the sandbox). Long episodes: Codex is
told the session's context (`model_context_window`, an auto-compaction limit below
it, and a `tool_output_token_limit` that keeps any one tool output inside the room
between the two: Codex ends the turn on context_length_exceeded rather than compact)
and keeps its own bounded retries; its multi-agent tools (sub-agents, one more branch
of the same session) are on by default. `lean` trims what it sends for a small model:
short instructions, no skills list, only its shell tools (`lean_toml`).
"""

from __future__ import annotations

import json
import time
from typing import Any

from miles_env.harness import Endpoint, HarnessResult
from miles_env.harnesses._cli import HOME, cli_result, cli_status, ensure_cli, mount_cli, run_cli, tested_pin
from miles_env.harnesses.configs import LEAN_PROMPT, MULTI_AGENT_MIN_CONTEXT, CodexConfig
from miles_env.sandbox import Sandbox
from miles_env.types import Task

__all__ = ["CodexConfig", "CodexHarness", "codex_config_toml", "lean_toml", "tool_output_limit"]

CODEX_HOME = f"{HOME}/.codex"
KEY_VAR = "TITO_API_KEY"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def multi_agent_for(setting: bool | None, max_context: int | None, lean: bool = False) -> bool:
    """The multi-agent tools alone take ~2.6k prompt tokens: by default only where they leave room
    (and never with `lean`)."""
    if setting is not None:
        return setting
    return not lean and (max_context is None or max_context >= MULTI_AGENT_MIN_CONTEXT)


# What `lean` turns off (Codex 0.169/0.171 config keys; each one checked by Codex, which names any
# key it ignores): the tools a shell task needs none of (goals, image generation, view_image,
# request_user_input) and the skills list. Left: exec_command, write_stdin, the environment context.
_LEAN_FEATURES = ("goals = false", "image_generation = false", "view_image = false")
_LEAN_TABLES = (
    "[skills]",
    "include_instructions = false",
    "",
    "[tools.experimental_request_user_input]",
    "enabled = false",
    "",
)


def lean_toml(instructions: str | None) -> tuple[list[str], list[str], list[str]]:
    """(top-level keys, [features] keys, tables) that trim Codex's first prompt to ~1k tokens:
    `instructions` (default LEAN_PROMPT) in place of its ~17k-character base instructions."""
    text = instructions if instructions is not None else LEAN_PROMPT.format(tool="exec_command")
    return [f"instructions = {_q(text)}"], list(_LEAN_FEATURES), list(_LEAN_TABLES)


def tool_output_limit(context: int, auto_compact: float) -> int:
    """Codex's `tool_output_token_limit` for a window: half the room above the compaction limit.

    Codex keeps a tool output to 4 bytes per limit token (its estimate), and a token is at least
    one byte, so an output costs at most 4 * limit tokens: after the largest one, the request (and
    the compaction request Codex then sends) still fits. Codex's default for a model it does not
    know (10 kB) overflows a small window in one `cat`, and it does not recover from the proxy's
    context_length_exceeded (the turn ends: "Codex ran out of room in the model's context window").
    """
    room = context - max(int(context * auto_compact), 1)
    return max(room // 8, 16)


def _q(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def codex_config_toml(
    base_url: str,
    model: str,
    extra: str = "",
    *,
    context: int | None = None,
    auto_compact: float = 0.8,
    retries: int = 4,
    multi_agent: bool = True,
    lean: bool = False,
    instructions: str | None = None,
) -> str:
    """config.toml pointing Codex at `base_url` (…/v1) with the key in $TITO_API_KEY.

    `context` (the session's max_context) becomes `model_context_window`, and `auto_compact` of it
    `model_auto_compact_token_limit`: Codex knows no window for an unknown model, so without them it
    never compacts and a long episode ends at the proxy's context_length_exceeded. With them comes
    `tool_output_token_limit` (`tool_output_limit`), unless `extra` sets it: no single tool output
    can carry a request from under the compaction limit past the window. `lean` adds `lean_toml`;
    `instructions` (without `lean`) replaces Codex's base instructions alone.
    """
    top = [
        f"model = {_q(model)}",
        'model_provider = "tito"',
        'approval_policy = "never"',
        'sandbox_mode = "danger-full-access"',
        "check_for_update_on_startup = false",
    ]
    if context is not None:
        top += [
            f"model_context_window = {context}",
            f"model_auto_compact_token_limit = {max(int(context * auto_compact), 1)}",
        ]
        if "tool_output_token_limit" not in extra:
            top.append(f"tool_output_token_limit = {tool_output_limit(context, auto_compact)}")
    features: list[str] = []
    tables: list[str] = []
    if lean:
        keys, features, tables = lean_toml(instructions)
        top += keys
    elif instructions is not None:
        top.append(f"instructions = {_q(instructions)}")
    # `extra` goes before the first table so that its bare keys stay top-level keys.
    lines = (
        top
        + ([extra] if extra else [])
        + [
            "",
            "[model_providers.tito]",
            'name = "tito"',
            f"base_url = {_q(base_url)}",
            'wire_api = "responses"',
            f"env_key = {_q(KEY_VAR)}",
            f"request_max_retries = {retries}",  # a 502 (engine failure) or a dropped stream is retried
            f"stream_max_retries = {retries}",
            "",
            "[features]",
            f"multi_agent = {'true' if multi_agent else 'false'}",
            *features,
            "",
            "[analytics]",
            "enabled = false",
            "",
            *tables,
        ]
    )
    return "\n".join(lines)


def parse_events(stdout: str) -> list[dict[str, Any]]:
    out = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _failure(events: list[dict[str, Any]]) -> str | None:
    """Codex's own account of a failed turn (its JSON events), when it gave one."""
    for ev in reversed(events):
        if ev.get("type") in ("turn.failed", "error"):
            err = ev.get("error")
            msg = err.get("message") if isinstance(err, dict) else ev.get("message")
            return str(msg)[:400] if msg else None
    return None


def _final_message(events: list[dict[str, Any]]) -> str | None:
    for ev in reversed(events):
        item = ev.get("item")
        if (
            ev.get("type") == "item.completed"
            and isinstance(item, dict)
            and item.get("type") == "agent_message"
        ):
            text = item.get("text")
            return text if isinstance(text, str) else None
    return None


class CodexHarness:
    name = "codex"

    def __init__(self, config: CodexConfig | None = None, **overrides: Any) -> None:
        base = (config or CodexConfig()).model_dump()
        self.config = CodexConfig(**{**base, **overrides})
        self.pin = tested_pin("codex", self.config.version)

    def argv(self, task: Task) -> list[str]:
        argv = [
            *self.pin.command(self.config.binary),
            "exec",
            "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox",
            "--json",
        ]
        return argv + list(self.config.extra_args) + [task.instruction]

    def env(self, endpoint: Endpoint) -> dict[str, str]:
        path = ":".join([*(self.pin.inner(d) for d in self.pin.path_dirs), DEFAULT_PATH])
        return {
            "PATH": path,
            "HOME": HOME,
            "CODEX_HOME": CODEX_HOME,
            KEY_VAR: endpoint.api_key,
            "NO_COLOR": "1",
            **dict(self.pin.env),
        }

    async def run(self, task: Task, sandbox: Sandbox, endpoint: Endpoint) -> HarnessResult:
        t0 = time.time()
        install_dir = await ensure_cli(self.pin)
        mount_cli(sandbox, self.pin, install_dir)
        inner_v1 = await sandbox.expose(endpoint.base_url)
        await sandbox.exec(["mkdir", "-p", CODEX_HOME], timeout=30)
        cfg = self.config
        toml = codex_config_toml(
            inner_v1, endpoint.model, cfg.extra_config, context=endpoint.max_context,
            auto_compact=cfg.auto_compact, retries=cfg.retries,
            multi_agent=multi_agent_for(cfg.multi_agent, endpoint.max_context, cfg.lean),
            lean=cfg.lean, instructions=cfg.system_prompt,
        )  # fmt: skip
        await sandbox.write_file(f"{CODEX_HOME}/config.toml", toml)
        prepared = time.time()
        env = {**self.env(endpoint), **self.config.extra_env}
        run = await run_cli(sandbox, self.argv(task), env, self.config.budget_s)
        status, error = cli_status(run, self.pin)
        events = parse_events(run.stdout)
        final = _final_message(events)
        failure = _failure(events)
        if error is not None and failure:
            error = f"{error.split(':', 1)[0]}: {failure}"
        return cli_result(
            self.pin, run, status, error, instruction=task.instruction, final=final, output=events,
            timing=(t0, prepared),
        )  # fmt: skip

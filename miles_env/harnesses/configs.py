"""The harness configs: one options model per harness, and their union keyed on `name`.

Concept: a run config's `harness:` section is `name` plus that harness's own options,
checked at load time (`harness.max_turn (name builtin): Extra inputs are not permitted`).
Each harness module builds from its model (`BuiltinHarness(BuiltinConfig(...))`); the
framework harness forwards its extra options to the adapter's own `run_episode`, which
checks them there. Invariant: stdlib and pydantic only, so the core may import this
module and never a harness (INVARIANTS.md, layering).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

__all__ = [
    "BuiltinConfig",
    "ClaudeCodeConfig",
    "CodexConfig",
    "FrameworkConfig",
    "HarnessConfig",
    "MiniSweAgentConfig",
    "OpencodeConfig",
    "LEAN_PROMPT",
    "MULTI_AGENT_MIN_CONTEXT",
    "SYSTEM_PROMPT",
]

SYSTEM_PROMPT = (
    "You are a Linux shell assistant. You complete tasks by running shell commands in the "
    "current directory. Answer with one shell command in a code block. "
    "When the task is complete, answer DONE."
)

# Below this context an 8k model (SmolLM2) has no room for Codex's ~9k-token first prompt with them.
MULTI_AGENT_MIN_CONTEXT = 16384

# The system prompt of a CLI run with `lean` (in place of the CLI's own, ~6.7k characters for Claude
# Code, ~17k for Codex); {tool} is the CLI's shell tool.
LEAN_PROMPT = (
    "You are an agent in a Linux shell. Do the user's task in the current directory: run shell "
    "commands with the {tool} tool and read their output. When the task is done, answer with one "
    "short sentence and no tool call."
)


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BuiltinConfig(_Options):
    """The built-in terminal agent (builtin.py)."""

    name: Literal["builtin"] = "builtin"
    max_turns: int = Field(4, ge=1)
    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    command_timeout_s: float = Field(10.0, gt=0)
    observation_chars: int = Field(600, ge=16)
    system_prompt: str = SYSTEM_PROMPT
    few_shot: bool = True
    request_timeout_s: float = Field(300.0, gt=0)
    retries: int = Field(0, ge=0, description="the openai client's max_retries (a retried turn never trains)")


class ClaudeCodeConfig(_Options):
    """The real Claude Code CLI (claude_code.py)."""

    name: Literal["claude-code"] = "claude-code"
    budget_s: float = Field(default=300.0, gt=0, description="wall-clock budget of one CLI run")
    version: str | None = Field(
        default=None, description="a tested Claude Code version (_cli.TESTED); None = the default"
    )
    max_turns: int | None = Field(default=None, ge=1, description="Claude Code --max-turns")
    tools: str | None = Field(
        default=None,
        description="Claude Code --tools (built-in tools offered, e.g. 'Bash'); None = all ('Bash' with lean)",
    )
    lean: bool = Field(
        default=False,
        description="trim the first prompt (~12.6k tokens -> ~0.65k) for a small model: --bare, the Bash "
        "tool only (unless `tools` says otherwise), `system_prompt` (default LEAN_PROMPT) in place of "
        "Claude Code's own",
    )
    system_prompt: str | None = Field(
        default=None, description="Claude Code --system-prompt: replaces its own system prompt"
    )
    output_tokens: int | None = Field(
        default=None,
        ge=1,
        description="CLAUDE_CODE_MAX_OUTPUT_TOKENS, also the room Claude Code keeps free for a reply (up "
        "to 20k); None: an eighth of a session context under 160k (claude_code.context_env), else its own",
    )
    binary: str | None = Field(
        default=None, description="inner path of the executable (fault injection); None = pinned"
    )
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = Field(default_factory=dict)


class CodexConfig(_Options):
    """The real Codex CLI (codex.py)."""

    name: Literal["codex"] = "codex"
    budget_s: float = Field(default=300.0, gt=0, description="wall-clock budget of one CLI run")
    version: str | None = Field(
        default=None, description="a tested Codex version (_cli.TESTED); None = the default"
    )
    binary: str | None = Field(
        default=None, description="inner path of the executable (fault injection); None = pinned"
    )
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = Field(default_factory=dict)
    extra_config: str = Field(
        default="", description="TOML added to config.toml before its tables (top-level keys allowed)"
    )
    retries: int = Field(
        default=4, ge=0, le=10, description="Codex request_max_retries and stream_max_retries (5xx, drops)"
    )
    auto_compact: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="model_auto_compact_token_limit as a fraction of the session's max_context",
    )
    multi_agent: bool | None = Field(
        default=None,
        description="offer Codex's multi-agent tools (spawn_agent and its family, ~2.6k prompt tokens); "
        f"None: on unless `lean` or the session's max_context is under {MULTI_AGENT_MIN_CONTEXT}",
    )
    lean: bool = Field(
        default=False,
        description="trim the first prompt (~6.3k tokens -> ~1k) for a small model: `system_prompt` "
        "(default LEAN_PROMPT) as Codex's instructions, no skills list, and only its shell tools "
        "(exec_command, write_stdin): goals, image generation, view_image, request_user_input and "
        "the multi-agent tools off",
    )
    system_prompt: str | None = Field(
        default=None, description="Codex `instructions` (config.toml): replaces its own base instructions"
    )


class OpencodeConfig(_Options):
    """The real opencode CLI (opencode.py)."""

    name: Literal["opencode"] = "opencode"
    budget_s: float = Field(default=300.0, gt=0, description="wall-clock budget of one CLI run")
    version: str | None = Field(default=None, description="a tested opencode-ai version; None = the default")
    context_tokens: int | None = Field(default=None, gt=0, description="model limit.context told to opencode")
    output_tokens: int | None = Field(
        default=None, gt=0, description="model limit.output (opencode's max_tokens); None = opencode's 32000"
    )
    binary: str | None = Field(
        default=None, description="inner path of the executable (fault injection); None = pinned"
    )
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = Field(default_factory=dict)
    extra_config: dict[str, Any] = Field(
        default_factory=dict, description="top-level keys merged into opencode.json"
    )


class MiniSweAgentConfig(_Options):
    """mini-swe-agent from its own venv (mini_swe_agent.py)."""

    name: Literal["mini-swe-agent"] = "mini-swe-agent"
    budget_s: float = Field(default=300.0, gt=0, description="wall-clock budget of one run")
    step_limit: int = Field(default=50, ge=0, description="mini-swe-agent agent.step_limit (0 = none)")
    command_timeout_s: int = Field(default=60, gt=0, description="per command (environment.timeout)")
    python: str = Field(
        default="/usr/bin/python3", description="base interpreter of the venv built on first use"
    )
    binary: str | None = Field(
        default=None, description="inner path of the interpreter (fault injection); None = the venv's"
    )
    extra_config: tuple[str, ...] = Field(
        default=(), description="more `-c key=value` specs, e.g. model.model_kwargs.temperature=0"
    )
    extra_env: dict[str, str] = Field(default_factory=dict)


class FrameworkConfig(BaseModel):
    """A framework adapter's own agent loop (adapters/framework_harness.py): `isolation` here; any other key is
    the adapter's (harbor's `agent`, `max_turns`...), forwarded to its `run_episode`, checked there."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: Literal["framework"] = "framework"
    isolation: Literal["sandbox", "none"] | None = None  # None: "sandbox" (adapters/isolation.py)


def _default_name(value: Any) -> Any:
    """A section without `name` is the builtin harness (the default run)."""
    return {"name": "builtin", **value} if isinstance(value, dict) and "name" not in value else value


HarnessConfig = Annotated[
    BuiltinConfig | ClaudeCodeConfig | CodexConfig | OpencodeConfig | MiniSweAgentConfig | FrameworkConfig,
    BeforeValidator(_default_name),
    Field(discriminator="name"),
]

"""Agent harnesses: loops that act in a sandbox and talk to a TITO session.

`get_harness(name, **options)` builds one by name through HARNESSES, the plug-in
table; `build_harness(cfg)` builds the one a run config's `harness:` section
(configs.HarnessConfig) names. Each harness lives in its own module and is imported
lazily, so core never depends on a harness's extras; their option models live in
configs.py, which imports no harness.
"""

from __future__ import annotations

from typing import Any

from miles_env.harness import Harness
from miles_env.harnesses.configs import HarnessConfig
from miles_env.plugins import PluginTable

__all__ = ["HARNESSES", "build_harness", "get_harness"]

# name -> "module:factory"; a factory takes the harness's options as keyword arguments
HARNESSES = PluginTable(
    "harness",
    {
        "builtin": "miles_env.harnesses.builtin:BuiltinHarness",
        "claude-code": "miles_env.harnesses.claude_code:ClaudeCodeHarness",  # the real Claude Code CLI
        "codex": "miles_env.harnesses.codex:CodexHarness",  # the real Codex CLI
        "opencode": "miles_env.harnesses.opencode:OpencodeHarness",  # the real opencode CLI
        "mini-swe-agent": "miles_env.harnesses.mini_swe_agent:MiniSweAgentHarness",  # mini-swe-agent (pip)
        "framework": "miles_env.adapters.framework_harness:FrameworkHarness",  # a framework adapter's own agent loop
    },
)


def get_harness(name: str, **options: Any) -> Harness:
    harness: Harness = HARNESSES.load(name)(**options)
    return harness


def build_harness(cfg: HarnessConfig) -> Harness:
    """The harness `cfg` names, with the options it sets (the harness's defaults for the rest)."""
    return get_harness(cfg.name, **cfg.model_dump(exclude={"name"}, exclude_unset=True))

"""Agent harnesses: loops that act in a sandbox and talk to a TITO session.

`get_harness(name, **config)` builds one by name; each harness lives in its own
module and is imported lazily, so core never depends on a harness's extras.
"""

from __future__ import annotations

import importlib
from typing import Any

from miles_env.errors import ConfigError
from miles_env.harness import Harness

__all__ = ["HARNESSES", "get_harness"]

# name -> "module:factory"
HARNESSES: dict[str, str] = {
    "builtin": "miles_env.harnesses.builtin:BuiltinHarness",
    "claude-code": "miles_env.harnesses.claude_code:ClaudeCodeHarness",  # the real Claude Code CLI
    "codex": "miles_env.harnesses.codex:CodexHarness",  # the real Codex CLI
    "opencode": "miles_env.harnesses.opencode:OpencodeHarness",  # the real opencode CLI
    "mini-swe-agent": "miles_env.harnesses.mini_swe_agent:MiniSweAgentHarness",  # mini-swe-agent (pip)
    "framework": "miles_env.adapters.harness:FrameworkHarness",  # a framework adapter's own agent loop
}


def get_harness(name: str, **config: Any) -> Harness:
    target = HARNESSES.get(name)
    if target is None:
        raise ConfigError(f"harness {name!r} is unknown; known harnesses: {', '.join(sorted(HARNESSES))}")
    module, attr = target.split(":")
    factory = getattr(importlib.import_module(module), attr)
    return factory(**config)  # type: ignore[no-any-return]

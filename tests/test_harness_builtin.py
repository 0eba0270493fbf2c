from __future__ import annotations

from typing import Any

import pytest

from miles_env.errors import ConfigError
from miles_env.harnesses import get_harness
from miles_env.harnesses.builtin import BuiltinHarness, format_observation, parse_command
from miles_env.types import ExecResult


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("```sh\necho hi > a.txt\n```", "echo hi > a.txt"),
        ("Here you go:\n```bash\n$ mkdir data\n```\nThis makes it.", "mkdir data"),
        ("```\ntouch x\nls\n```", "touch x\nls"),
        ("run this\n$ wc -l in.txt > n.txt\n", "wc -l in.txt > n.txt"),
        ("```sh\necho unterminated", "echo unterminated"),
        ("DONE", None),
        ("done.", None),
        ("I cannot help with that.", None),
        ("", None),
        ("```\n\n```", None),
    ],
)
def test_parse_command(text: str, expected: str | None) -> None:
    assert parse_command(text) == expected


def test_observation_reports_limits_and_truncates() -> None:
    r = ExecResult(exit_code=-9, stdout="x" * 100, stderr="", killed_by_limit="memory")
    obs = format_observation(r, limit=20)
    assert "Exit code: -9 (killed: memory limit)" in obs
    assert obs.endswith("[output truncated]")
    assert "(none)" in format_observation(ExecResult(0, "", ""), limit=20)


def test_registry_of_harnesses() -> None:
    h = get_harness("builtin", max_turns=2)
    assert isinstance(h, BuiltinHarness) and h.config.max_turns == 2
    with pytest.raises(ConfigError, match="known: builtin"):
        get_harness("nope")
    with pytest.raises(ValueError, match="max_turns"):
        get_harness("builtin", max_turns=0)


def test_an_episode_records_each_command_as_the_sandbox_ran_it() -> None:
    """ScriptedEngine -> TITO -> builtin harness -> a real local sandbox: `metadata.harness.execs`
    holds each command with its exit code, duration and output (what `miles-env view` shows)."""
    import anyio

    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.models import load_tokenizer
    from miles_env.registry import load_environment
    from miles_env.rollout import run_episode
    from miles_env.stack import StackConfig, open_stack

    env = load_environment("terminal-basics")
    task = env.tasks("train")[0]
    replies = ["```sh\nfalse\n```", "```sh\nsleep 0.2; echo hi\n```", "DONE"]

    async def main() -> Any:
        engine = ScriptedEngine(load_tokenizer("smollm2"), replies)
        async with open_stack(StackConfig(), engine=engine) as stack:
            return await run_episode(stack.rollout_context(env, BuiltinHarness()), task)

    ep = anyio.run(main)
    execs = ep.metadata["harness"]["execs"]
    assert [(e["command"], e["exit_code"], e["output"]) for e in execs] == [
        ("false", 1, ""),
        ("sleep 0.2; echo hi", 0, "hi"),
    ]
    assert execs[1]["duration_s"] >= 0.2 and ep.metadata["harness"]["commands"] == 2

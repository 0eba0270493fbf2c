from __future__ import annotations

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

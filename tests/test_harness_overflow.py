"""A tool result that alone overflows the context: each real CLI never reaches the proxy's 400.

Neither CLI recovers from the proxy's context refusal when one tool result is the cause: Codex
0.171 ends the turn on `context_length_exceeded` ("Codex ran out of room in the model's context
window"), and Claude Code 2.1 answers "prompt is too long" with a compaction that keeps the latest
turns, so the oversized result stays and the compaction overflows too. The refusals already read
as the real APIs' (checked here: OpenAI's `context_length_exceeded`, Anthropic's "prompt is too
long: N tokens > M maximum" `invalid_request_error`), so the fix is the CLIs' own tool-output
limits, set by each harness from the session's window: Codex `tool_output_token_limit`, Claude
Code `BASH_MAX_OUTPUT_LENGTH` / `MAX_MCP_OUTPUT_TOKENS`. End to end (real CLI, scripted policy):
`seq` prints far more tokens than the whole window, the CLI cuts it, the episode passes with no
context refusal at all, exact tokens and a clean audit.
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from miles_env.engines.scripted import PolicyRule, ScriptedEngine, ScriptedPolicy
from miles_env.harness import Endpoint
from miles_env.harnesses import get_harness
from miles_env.harnesses._cli import CLAUDE_CODE, CODEX
from miles_env.harnesses.claude_code import ClaudeCodeHarness, output_limits
from miles_env.harnesses.codex import codex_config_toml, tool_output_limit
from miles_env.models import load_tokenizer
from miles_env.registry import load_environment
from miles_env.rollout import run_episode
from miles_env.stack import StackConfig, open_stack
from miles_env.tito import anthropic_messages as am
from miles_env.tito.errors import ProxyError, context_exceeded
from miles_env.types import Episode, Status
from tests.cli_harness_support import check_exact, require_cli, two_step_task

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


def test_refusal_reads_like_the_real_apis() -> None:
    err = context_exceeded(208432, 200000)
    assert err.status == 400
    openai = err.body()["error"]
    assert openai["type"] == "invalid_request_error" and openai["code"] == "context_length_exceeded"
    assert am.error_body(err) == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "prompt is too long: 208432 tokens > 200000 maximum",
        },
    }


def test_tool_output_limits_follow_the_window() -> None:
    cfg = tomllib.loads(codex_config_toml("http://h/v1", "policy", context=12000, auto_compact=0.8))
    assert cfg["tool_output_token_limit"] == tool_output_limit(12000, 0.8) == 300  # (12000-9600)//8
    # At 4 bytes a limit token and at most one token a byte, the largest output fits the room.
    assert 4 * tool_output_limit(12000, 0.8) <= (12000 - 9600) // 2
    own = codex_config_toml("http://h/v1", "policy", "tool_output_token_limit = 99", context=12000)
    assert tomllib.loads(own)["tool_output_token_limit"] == 99  # the user's own setting wins
    assert "tool_output_token_limit" not in tomllib.loads(codex_config_toml("http://h/v1", "policy"))
    assert output_limits(32000) == {"BASH_MAX_OUTPUT_LENGTH": "4000", "MAX_MCP_OUTPUT_TOKENS": "1000"}
    assert output_limits(1 << 20)["BASH_MAX_OUTPUT_LENGTH"] == "30000"  # never above Claude Code's default
    ep = Endpoint("http://h/s/x/v1", "k", "x", "policy", "http://h/s/x", max_context=32000)
    env = ClaudeCodeHarness().env("http://h/s/x", ep)
    assert env["BASH_MAX_OUTPUT_LENGTH"] == "4000"
    mine = ClaudeCodeHarness(extra_env={"BASH_MAX_OUTPUT_LENGTH": "777"}).env("http://h/s/x", ep)
    assert mine["BASH_MAX_OUTPUT_LENGTH"] == "777"
    bare = Endpoint("http://h/s/x/v1", "k", "x", "policy", "http://h/s/x")
    assert "BASH_MAX_OUTPUT_LENGTH" not in ClaudeCodeHarness().env("http://h/s/x", bare)


COMPACTION = (
    "You are performing a CONTEXT CHECKPOINT COMPACTION",  # Codex
    "Your task is to create a detailed summary of the conversation so far",  # Claude Code
)
SUMMARY = "first.txt holds alpha; what remains: write second.txt as the content of first.txt plus ' beta'."


class CompactingEngine(ScriptedEngine):
    """The scripted policy for the agent's turns; a summary for the CLI's compaction requests."""

    def _next_ids(self, session_id: str | None, input_ids: Sequence[int] = ()) -> list[int]:
        tail = self.tokenizer.decode(list(input_ids[-1500:]))
        if any(mark in tail for mark in COMPACTION):
            return self._encode_reply(f"<analysis>Two steps.</analysis>\n<summary>{SUMMARY}</summary>")
        return super()._next_ids(session_id, input_ids)


def flood_policy(n: int) -> ScriptedPolicy:
    """`seq 1 n` in the first command: its output alone is larger than the whole window."""
    steps = (
        {"shell": f"seq 1 {n}; echo alpha > first.txt"},
        {"shell": 'echo "$(cat first.txt) beta" > second.txt'},
        "Both files are written.",
    )
    return ScriptedPolicy((PolicyRule("first.txt", steps),))


def seq_tokens(tok: Any, n: int) -> int:
    return len(tok.encode("".join(f"{i}\n" for i in range(1, n + 1)), add_special_tokens=False))


async def run_counting(harness: str, engine: Any, store: Path, **cfg: Any) -> tuple[Episode, list[str]]:
    """One episode through a real stack; also every context refusal the proxy answered."""
    refusals: list[str] = []
    stack_cfg = StackConfig(engine={"kind": "scripted"}, store_dir=store)
    async with open_stack(stack_cfg, engine=engine) as st:
        for name in ("serve", "count_tokens"):  # a spy around the real methods, not a stand-in
            real = getattr(st.proxy, name)

            async def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
                try:
                    return await _real(*args, **kwargs)
                except ProxyError as e:
                    if e.code == "context_length_exceeded":
                        refusals.append(_name)
                    raise

            setattr(st.proxy, name, spy)
        ctx = st.rollout_context(load_environment("terminal-basics"), get_harness(harness, **cfg))
        return await run_episode(ctx, two_step_task()), refusals


def check_passed(ep: Episode, engine: ScriptedEngine, store: Path, limit: int, refusals: list[str]) -> None:
    assert ep.status is Status.COMPLETED, (ep.error, ep.metadata["harness"])
    assert ep.reward is not None and ep.reward.passed, ep.reward
    assert refusals == [], refusals  # the CLI never reached the proxy's 400
    assert all(len(c.input_ids) + len(c.generation.output_ids) <= limit for c in engine.calls)
    check_exact(ep, engine, store)


@pytest.mark.slow
@pytest.mark.parametrize("default", [False, True], ids=["harness-limits", "cli-defaults"])
async def test_codex_cuts_a_tool_output_larger_than_the_window(
    tok: Any, tmp_path: Path, default: bool
) -> None:
    """12k window, a ~24k-token `seq`. At Codex's own size for an unknown model (~10 kB, set
    explicitly here) the next request is past the window: one context_length_exceeded, and Codex
    ends the turn ("ran out of room"), no retry. With the harness's tool_output_token_limit (300:
    1.2 kB) it goes on and passes without a single refusal."""
    require_cli(CODEX)
    limit, n = 12000, 5000
    assert seq_tokens(tok, n) > limit
    engine = CompactingEngine(tok, policy=flood_policy(n), max_context=limit)
    extra = "tool_output_token_limit = 2500" if default else ""
    ep, refusals = await run_counting("codex", engine, tmp_path / "store", budget_s=240, extra_config=extra)
    if default:
        assert ep.status is Status.ABORTED and refusals == ["serve"], (ep.status, refusals)
        assert "ran out of room" in str(ep.error)
        return
    check_passed(ep, engine, tmp_path / "store", limit, refusals)
    assert ep.metadata["transcript"][-1] == {"role": "assistant", "content": "Both files are written."}


@pytest.mark.slow
@pytest.mark.parametrize("default", [False, True], ids=["harness-limits", "cli-defaults"])
async def test_claude_code_cuts_a_tool_output_larger_than_the_window(
    tok: Any, tmp_path: Path, default: bool
) -> None:
    """24k window, a `seq` of ~26k characters (~26k tokens). Claude Code's default Bash limit (30000
    characters; a longer output it stores in a file and shows a preview) sends it whole: "prompt is
    too long", then a compaction that keeps the latest turn and overflows again, several times,
    and the run ends at the context (truncated). With BASH_MAX_OUTPUT_LENGTH=3000 (the harness's, from the window) it goes on
    and passes without a single refusal."""
    require_cli(CLAUDE_CODE)
    limit, n = 24000, 5500
    text = "".join(f"{i}\n" for i in range(1, n + 1))
    assert len(text) < 30000 and seq_tokens(tok, n) > limit
    engine = CompactingEngine(tok, policy=flood_policy(n), max_context=limit)
    extra = {"BASH_MAX_OUTPUT_LENGTH": "30000"} if default else {}
    ep, refusals = await run_counting(
        "claude-code", engine, tmp_path / "store", budget_s=240, tools="Bash", output_tokens=2000,
        extra_env=extra,
    )  # fmt: skip
    if default:  # the context ended it (terminal_reason prompt_too_long): a budget, not a crash
        assert ep.status is Status.TRUNCATED and refusals, (ep.status, refusals)
        assert ep.metadata["harness"]["output"]["terminal_reason"] == "prompt_too_long", ep.error
        return
    check_passed(ep, engine, tmp_path / "store", limit, refusals)
    assert ep.metadata["harness"]["output"]["result"] == "Both files are written."

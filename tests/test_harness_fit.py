"""Fitting a CLI to a small model (issue 31): sizes, trimmed prompts, and a first prompt that cannot fit.

Unit level: what Claude Code 2.1 is told for a window (a reply room it can get, compaction off
where its 13k buffer leaves no room), `lean`'s argv and config.toml, how Claude Code's JSON result
and mini-swe-agent's exit status become a status and an end class. Proxy and rollout level (the
scripted engine, the builtin harness, a real sandbox): the session keeps its first request's size,
answered or refused, and an episode whose first prompt the context cannot hold fails in one line
that says so, with the size. The same with the real CLIs: tests/test_harness_docs.py.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from miles_env.engines.scripted import ScriptedEngine
from miles_env.harness import Endpoint
from miles_env.harnesses import get_harness
from miles_env.harnesses._cli import POLICY_FORMAT, TESTED, policy_end
from miles_env.harnesses.claude_code import context_env, outcome
from miles_env.harnesses.codex import codex_config_toml, multi_agent_for
from miles_env.harnesses.configs import LEAN_PROMPT
from miles_env.harnesses.mini_swe_agent import FORMAT_EXITS
from miles_env.models import load_tokenizer
from miles_env.tito import TitoProxy
from miles_env.tito.errors import ProxyError
from miles_env.tito.messages import ChatRequest, Message
from miles_env.types import EpisodeEnd, Status
from tests.cli_harness_support import run_one, two_step_task

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


def _endpoint(context: int | None) -> Endpoint:
    return Endpoint("http://h/s/x/v1", "k", "x", "policy", "http://h/s/x", max_context=context)


def test_claude_code_gets_a_reply_room_and_compaction_that_fit_the_window() -> None:
    """8k: an eighth for the reply (its own 20k would refuse every request) and no auto-compaction
    (its threshold, 8k - 1k - 13k, is below zero); 32k with 2k replies keeps it (17k >= 8k); a 200k
    window keeps Claude Code's own reply size."""
    small = context_env(8192, None)
    assert small["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "1024" and small["DISABLE_AUTO_COMPACT"] == "1"
    assert small["BASH_MAX_OUTPUT_LENGTH"] == "1024"
    mid = context_env(32000, 2000)
    assert mid["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "2000" and "DISABLE_AUTO_COMPACT" not in mid
    big = context_env(200000, None)
    assert "CLAUDE_CODE_MAX_OUTPUT_TOKENS" not in big and "DISABLE_AUTO_COMPACT" not in big
    env = get_harness("claude-code").env("http://h", _endpoint(8192))
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "8192" and env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "1024"
    old = get_harness("claude-code", version=TESTED["claude-code"][1].version).env(
        "http://h", _endpoint(8192)
    )
    assert "DISABLE_AUTO_COMPACT" not in old and "CLAUDE_CODE_MAX_CONTEXT_TOKENS" not in old  # 2.0: no window
    assert "CLAUDE_CODE_MAX_OUTPUT_TOKENS" not in get_harness("claude-code").env("http://h", _endpoint(None))


def test_lean_trims_what_claude_code_sends() -> None:
    task, ep = two_step_task(), _endpoint(8192)
    argv = get_harness("claude-code", lean=True).argv(task, ep)
    assert "--bare" in argv and argv[argv.index("--tools") + 1] == "Bash"
    assert argv[argv.index("--system-prompt") + 1] == LEAN_PROMPT.format(tool="Bash")
    own = get_harness("claude-code", lean=True, tools="Bash,Write", system_prompt="Be brief.").argv(task, ep)
    assert (
        own[own.index("--tools") + 1] == "Bash,Write" and own[own.index("--system-prompt") + 1] == "Be brief."
    )
    plain = get_harness("claude-code", system_prompt="Be brief.").argv(task, ep)
    assert "--bare" not in plain and "--tools" not in plain and "--system-prompt" in plain
    old = get_harness("claude-code", lean=True, version=TESTED["claude-code"][1].version).argv(task, ep)
    assert "--bare" not in old and "--tools" in old  # 2.0 has no minimal mode
    assert "--bare" not in get_harness("claude-code").argv(task, ep)


def test_lean_trims_what_codex_sends() -> None:
    cfg = tomllib.loads(
        codex_config_toml("http://h/v1", "policy", context=8192, lean=True, multi_agent=False)
    )
    assert cfg["instructions"] == LEAN_PROMPT.format(tool="exec_command")
    assert cfg["features"] == {
        "multi_agent": False,
        "goals": False,
        "image_generation": False,
        "view_image": False,
    }
    assert cfg["skills"] == {"include_instructions": False}
    assert cfg["tools"] == {"experimental_request_user_input": {"enabled": False}}
    assert cfg["model_providers"]["tito"]["wire_api"] == "responses"  # the provider is untouched
    assert not multi_agent_for(None, 1 << 20, lean=True) and multi_agent_for(True, 1 << 20, lean=True)
    own = tomllib.loads(codex_config_toml("http://h/v1", "policy", instructions="Be brief."))
    assert own["instructions"] == "Be brief." and "skills" not in own and "goals" not in own["features"]
    assert "instructions" not in tomllib.loads(codex_config_toml("http://h/v1", "policy"))


def test_how_claude_code_results_end() -> None:
    """Its JSON result decides, exit 0 or 1: budgets truncate; unparsable tool calls are the policy's."""

    def result(reason: str, sub: str = "success") -> dict[str, Any]:
        return {"is_error": True, "terminal_reason": reason, "subtype": sub, "result": "x"}

    assert outcome(result("malformed_tool_use_exhausted"), Status.ABORTED, "e")[::2] == (
        Status.ABORTED,
        POLICY_FORMAT,
    )
    assert outcome(result("prompt_too_long"), Status.ABORTED, "e")[::2] == (Status.TRUNCATED, None)
    assert outcome(result("blocking_limit"), Status.COMPLETED, None)[0] is Status.TRUNCATED
    assert outcome(result("", "error_max_turns"), Status.COMPLETED, None)[0] is Status.TRUNCATED
    assert outcome(result("model_error"), Status.COMPLETED, None)[::2] == (Status.ABORTED, None)
    # SmolLM2 rambling past a 96-token reply size, Claude Code's continuations too (seen in a run)
    capped = {
        **result("api_error"),
        "result": "API Error: Claude's response exceeded the 96 output token maximum.",
    }
    assert outcome(capped, Status.ABORTED, "e")[0] is Status.TRUNCATED
    assert outcome({"is_error": False}, Status.COMPLETED, None) == (Status.COMPLETED, None, None)
    assert policy_end("RepeatedFormatError", FORMAT_EXITS) == POLICY_FORMAT
    assert policy_end("Submitted", FORMAT_EXITS) is None and policy_end(None, FORMAT_EXITS) is None


async def test_the_session_keeps_its_first_requests_size(tok: Any, tmp_path: Path) -> None:
    """Refused for the context: the size the proxy counted; answered: the first turn's prompt;
    neither changes after, and an answered one survives a replay of the journal."""
    engine = ScriptedEngine(tok, max_context=64)
    proxy = TitoProxy(engine, tok, store_dir=tmp_path)
    long = ChatRequest(messages=(Message("user", "word " * 100),))
    refused = proxy.create_session().session_id
    with pytest.raises(ProxyError) as e:
        await proxy.chat(refused, long)
    size = proxy.get_session(refused).first_prompt
    assert e.value.code == "context_length_exceeded" and size is not None and str(size) in e.value.message
    engine.push("ok")
    await proxy.chat(refused, ChatRequest(messages=(Message("user", "hi"),)))
    assert proxy.get_session(refused).first_prompt == size
    answered = proxy.create_session().session_id
    engine.push("ok")
    r = await proxy.chat(answered, ChatRequest(messages=(Message("user", "hi"),)))
    assert proxy.get_session(answered).first_prompt == r.prompt_tokens > 0
    assert TitoProxy(engine, tok, store_dir=tmp_path).get_session(answered).first_prompt == r.prompt_tokens


async def test_a_first_prompt_the_context_cannot_hold_fails_the_episode_saying_so(
    tok: Any, tmp_path: Path
) -> None:
    """The builtin agent's first prompt (~300 tokens) in a 64-token context: refused, nothing
    sampled, the episode FAILED with one line naming the harness, the size and the context."""
    from miles_env.cli.eval import episode_line, summarize

    ep = await run_one("builtin", ScriptedEngine(tok, max_context=64), tmp_path / "store")
    first = ep.metadata["first_prompt_tokens"]
    assert ep.status is Status.FAILED and first > 64 and not ep.samples, (ep.status, ep.error)
    assert ep.end is EpisodeEnd.PROXY_REFUSAL and not ep.end.policy  # never trained
    assert ep.error == (
        f"builtin's first prompt is {first} tokens, more than the model's context (64 tokens): nothing "
        "was sampled; trim what it sends (--harness-opt lean=true, docs/harnesses.md 'Small models') "
        "or give the engine a larger context"
    )
    assert f"first prompt {first} tokens" in episode_line(ep) and "\n" not in episode_line(ep)
    assert summarize([ep])["first_prompt_tokens"] == {"min": first, "max": first}
    fits = await run_one("builtin", ScriptedEngine(tok, max_context=8192), tmp_path / "store2")
    assert fits.status is not Status.FAILED and fits.metadata["first_prompt_tokens"] == first


async def test_the_scripted_engine_takes_max_context_without_a_script() -> None:
    from miles_env.engines import build_engine
    from miles_env.engines.configs import ScriptedEngineConfig

    assert (await (await build_engine(ScriptedEngineConfig(max_context=65536))).info()).max_context == 65536
    assert (await (await build_engine(ScriptedEngineConfig())).info()).max_context == 8192

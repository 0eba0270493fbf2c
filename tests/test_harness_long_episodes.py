"""Long episodes: the CLIs learn the session's context, retry engine failures, compact and finish.

Unit level: a session's `truncated` flag tells the end state (a client that recovers from a
context refusal and finishes is not truncated); each harness passes the session's max_context
to its CLI (Codex config.toml, Claude Code 2.1's context-window variable), keeps Codex's own
bounded retries and turns its multi-agent tools off. End to end (real CLIs, scripted policy):
a tool output that overflows a small max_context, the CLI's compaction answered with a summary
by the policy, the task passed, every sampled token in exactly one exported sample.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
from miles_env.tito import TitoProxy
from miles_env.tito.config import Budget
from miles_env.tito.errors import ProxyError
from miles_env.tito.messages import ChatRequest, Message

from miles_env.engines.scripted import ScriptedEngine
from miles_env.harness import Endpoint
from miles_env.harnesses import get_harness
from miles_env.harnesses._cli import TESTED
from miles_env.harnesses.codex import codex_config_toml
from miles_env.models import load_tokenizer

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


def _ask(text: str) -> ChatRequest:
    return ChatRequest(messages=(Message("user", text),))


async def test_truncated_tells_the_end_state_not_the_history(tok: Any, tmp_path: Path) -> None:
    engine = ScriptedEngine(tok, max_context=4096)
    proxy = TitoProxy(engine, tok, store_dir=tmp_path)
    sid = proxy.create_session(budget=Budget(max_context=64)).session_id
    with pytest.raises(ProxyError) as refused:
        await proxy.chat(sid, _ask("word " * 100))
    assert refused.value.code == "context_length_exceeded"
    assert proxy.get_session(sid).truncated == "max_context"
    # The client recovers (compacts, asks shorter) and is answered in full: not truncated any more.
    engine.push("fine")
    assert (await proxy.chat(sid, _ask("hi"))).finish_reason == "stop"
    assert proxy.get_session(sid).truncated is None
    # A replayed journal says the same.
    assert TitoProxy(engine, tok, store_dir=tmp_path).get_session(sid).truncated is None
    # The last turn cut by the context: truncated again, and so after a replay.
    engine.push("a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3)
    assert (await proxy.chat(sid, _ask("more"))).finish_reason == "length"
    assert proxy.get_session(sid).truncated == "max_context"
    assert TitoProxy(engine, tok, store_dir=tmp_path).get_session(sid).truncated == "max_context"


def test_codex_config_carries_context_retries_and_no_multi_agent() -> None:
    cfg = tomllib.loads(codex_config_toml("http://h/v1", "policy", context=32768, auto_compact=0.75))
    assert cfg["model_context_window"] == 32768 and cfg["model_auto_compact_token_limit"] == 24576
    provider = cfg["model_providers"]["tito"]
    assert provider["request_max_retries"] == provider["stream_max_retries"] == 4
    assert cfg["features"] == {"multi_agent": False}
    bare = tomllib.loads(codex_config_toml("http://h/v1", "policy", retries=0, multi_agent=True))
    assert "model_context_window" not in bare and "model_auto_compact_token_limit" not in bare
    assert bare["model_providers"]["tito"]["request_max_retries"] == 0 and bare["features"]["multi_agent"]


def test_claude_code_21_is_told_the_context_20_has_no_variable_for_it() -> None:
    ep = Endpoint("http://h/s/x/v1", "k", "x", "policy", "http://h/s/x", max_context=40000)
    new, old = TESTED["claude-code"]
    env = get_harness("claude-code", version=new.version).env("http://h/s/x", ep)
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "40000"
    assert "CLAUDE_CODE_MAX_CONTEXT_TOKENS" not in get_harness("claude-code", version=old.version).env(
        "http://h/s/x", ep
    )
    unknown = Endpoint("http://h/s/x/v1", "k", "x", "policy", "http://h/s/x")
    assert "CLAUDE_CODE_MAX_CONTEXT_TOKENS" not in get_harness("claude-code").env("http://h/s/x", unknown)
